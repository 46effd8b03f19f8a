"""Name the graph inside a QNN context binary that onnxruntime's QNN EP compiled.

Genie orders the graphs of a model cut over several contexts by their QNN graph names,
``<prefix>_<i>_of_<n>`` (AI Hub's ``prompt_ar128_cl4096_1_of_3``); graphs without that suffix
are "ordered after all graphs that do" — by name, which for onnxruntime's graphs is a hash of the
model's path (docs/genie.md). The QNN EP names each graph after its fused node,
``QNNExecutionProvider_QNNExecutionProvider_<hash>_1_0``, and onnxruntime's plugin EP takes no
option for it (``ep.context_node_name_prefix`` is not read by it: measured, onnxruntime-qnn 2.7.0).

So the name is rewritten after the compile, in both places that hold it::

    X.ctx.onnx      EPContext node name  ─┐  the same new name, of the same length as the old
    X.ctx_qnn.bin   the graph name (3x)  ─┘  one (the binary's strings are not re-laid out)

The new name keeps the old one's length. A Genie graph's is its phase, the old hash's digits
as letters to fill, then the rest, e.g. ``promptgeidjbajbcdefghij...xx_ar16_cl128_1_of_3``: one
name that libGenie orders by its ``_<i>_of_<n>`` suffix and reads AR / CL from, and that GenieX's
QAIRT plugin takes whole (``[a-zA-Z]+_ar<N>_cl<C>_<i>_of_<n>``; digits in the filler, as the
first form ``prompt_ar16_cl128_<digits>_1_of_3`` had them, it refuses). onnxruntime loads the
renamed EPContext model (the oracle runs it) and libGenie reads the names back ("Inserting graph
... as idx 0 for AR-16 CL-128"); tests hold both.
"""

from __future__ import annotations

import re
from pathlib import Path

from ...bundle.errors import BuildError

LETTERS = str.maketrans("0123456789", "abcdefghij")


def padded_name(old: str, readable: str, suffix: str = "", keep_digits: bool = True,
                sep: str = "_", letters: bool = False) -> str:
    """``readable`` + ``sep`` + filler + ``suffix``, exactly ``len(old)`` characters; the filler
    is the old name's digits (so two graphs renamed alike stay distinct; as the letters a-j with
    ``letters``) unless ``keep_digits`` is False, then ``x``."""
    room = len(old) - len(readable) - len(suffix) - len(sep)
    if room < 0:
        raise BuildError(f"graph name {old!r} is too short to carry {readable + suffix!r}")
    digits = "".join(re.findall(r"\d", old)) if keep_digits else ""
    filler = (digits.translate(LETTERS) if letters else digits) + "x" * room
    return f"{readable}{sep}{filler[:room]}{suffix}"


def graph_name_of(ctx_onnx: Path) -> str:
    import onnx

    nodes = [n for n in onnx.load(str(ctx_onnx), load_external_data=False).graph.node
             if n.op_type == "EPContext"]
    if len(nodes) != 1:
        raise BuildError(f"{ctx_onnx.name}: expected one EPContext node, found {len(nodes)}")
    return nodes[0].name


def rename_graph(ctx_onnx: Path, binary: Path, readable: str, suffix: str = "",
                 keep_digits: bool = True, sep: str = "_", letters: bool = False) -> str:
    """Rename the one graph of ``binary`` (and its EPContext node in ``ctx_onnx``) to
    ``padded_name(old, readable, suffix, keep_digits, sep, letters)``. -> the new name. The
    binary is rewritten through a temporary file, so an interruption leaves the old one whole."""
    import onnx

    model = onnx.load(str(ctx_onnx), load_external_data=False)
    (node,) = [n for n in model.graph.node if n.op_type == "EPContext"]
    old = node.name
    new = padded_name(old, readable, suffix, keep_digits, sep, letters)
    data = binary.read_bytes()
    count = data.count(old.encode())
    if count == 0:
        raise BuildError(f"{binary.name} does not hold graph name {old!r}")
    if data.count(new.encode()):
        raise BuildError(f"{binary.name} already holds {new!r}")
    tmp = binary.with_name(binary.name + ".renaming")
    tmp.write_bytes(data.replace(old.encode(), new.encode()))
    tmp.replace(binary)
    node.name = new
    onnx.save(model, str(ctx_onnx))
    return new
