"""Weight-only int8 / int4 through onnxruntime's MatMulNBits: the cpu target's weights (fp32
activations) and the HTP's weight-only recipes (fp16 activations, ``weightonly.weight_only``), and the
host tables' formats under them.

    float ONNX ──every weight MatMul (not structural, whole blocks where asked)──▶ MatMulNBits
               the head (MatMuls to the vocabulary) in ``cpu_head_format``
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ...bundle.errors import BuildError
from ..heap import release_heap

# ---- cpu target: weight-only int8 / int4 through onnxruntime's MatMulNBits ----------------------
# name -> (bits, block size along K). accuracy_level 4: the activations are quantized to int8 per
# block at run time and the product runs on the int8 dot-product kernels (AVX512-VNNI / AVX-VNNI);
# the float fallback (level 0/1) dequantizes every weight block each call and is slower.
# int4-b128: one fp32 scale per 128 weights instead of per 32 (the common int4 group of GPTQ/AWQ
# checkpoints): 4.25 bits a weight instead of 5, so a decode token reads 15 % fewer bytes, and
# MLAS's int8 kernel does a quarter of the per-block scale work; int8-b128 likewise, 8.25 bits a
# weight instead of 9. Both run faster than block 32 (docs/notes/measurements.md).
CPU_WEIGHTS: dict[str, tuple[int, int] | None] = {
    "fp32": None, "int8": (8, 32), "int8-b128": (8, 128), "int4": (4, 32), "int4-b128": (4, 128)}
CPU_ACCURACY_LEVEL = 4
# the most fp32 weight bytes quantized in one one-node model: protobuf cannot serialize 2 GB, and
# a real-size tied head is over it (Qwen3.5-4B's 248,320 x 2,560: 2.5 GB)
ONE_NODE_BYTES = 1 << 30
# the media towers' weights under each --cpu-weights: int8 under int4 too, as an int4 tower's soft
# tokens moved far from fp32's for no speed (docs/notes/measurements.md)
CPU_ENCODER_WEIGHTS: dict[str, str] = {"fp32": "fp32", "int8": "int8", "int8-b128": "int8",
                                       "int4": "int8", "int4-b128": "int8"}


def check_cpu_weights(name: str) -> tuple[int, int] | None:
    if name not in CPU_WEIGHTS:
        raise BuildError(f"unknown --cpu-weights {name!r}; choose from {', '.join(CPU_WEIGHTS)}")
    return CPU_WEIGHTS[name]


def host_table_formats(weights: str, embed: str, extras: list[str], tensors: dict,
                       int8_embedding: bool = False, int4_extras: bool = False
                       ) -> dict[str, tuple[int, int]]:
    """The host tables quantized under --cpu-weights ``weights``: {table: (bits, block)}.

    fp32 keeps every table as the checkpoint holds it. Quantized weights quantize the tables too:
    the embedding in the head's format (``cpu_head_format``: int8 under int8 and int4 weights), so
    a tied head's weight is the same bytes and is stored once; int8 in blocks of 32 where that
    block does not divide its width, or ``int8_embedding`` (a bundle with HTP targets, which read
    the same table under 8- or 16-bit weights). The other tables (Gemma-4's per-layer inputs,
    ~35 rows a token of which each layer reads one) int8 rows with a scale per 32 columns, as no
    peer runs them at 4 bits to compare against; ``int4_extras`` (--int4-per-layer-tables, int4
    weights) puts them in the weights' int4 blocks where those divide their width. Qwen3.5-0.8B's
    embedding: 508 MB bf16, 286 MB int8."""
    from ...bundle.qtables import INT8_BLOCK

    fmt = check_cpu_weights(weights)
    if fmt is None:
        return {}
    bits, block = fmt
    out = {name: (bits, block) if int4_extras and bits == 4 and not tensors[name].shape[-1] % block
           else (8, INT8_BLOCK) for name in extras}
    head = cpu_head_format(bits, block)
    fallback = int8_embedding or tensors[embed].shape[-1] % head[1]
    out[embed] = (8, INT8_BLOCK) if fallback else head
    return out


def is_structural(w: np.ndarray) -> bool:
    """A constant MatMul operand holding only 0s and 1s: an operator written as a matrix
    (Qwen3.5's chunked delta rule takes the cumsum of its log decays as ``g @ upper``, a
    triangle of ones), not a learned weight. MatMulNBits stores 0/1 exactly, but at accuracy
    level 4 it reads the activation at int8 per 32-block: the decays' cumsum, which every later
    decay of the chunk multiplies, off by up to 0.14% of its range (a 64-token triangle). On the
    real-width random Qwen3.5 4-layer cut the int4 gate's numbers did not move (logits cos
    0.883455 either way): the weights' own rounding dominates there."""
    # a learned weight fails on its first values: the full pass runs on masks only
    return bool(np.isin(w.reshape(-1)[:256], (0, 1)).all() and np.isin(w, (0, 1)).all())


def quantize_cpu_graph(path: Path, bits: int, block_size: int, vocab_size: int | None = None,
                       accuracy_level: int = CPU_ACCURACY_LEVEL, whole_blocks: bool = False) -> int:
    """Every MatMul with a 2-D initializer weight (not ``is_structural``) -> com.microsoft
    MatMulNBits (symmetric, blocks of ``block_size`` along K), in place; the head's (the MatMuls
    to ``vocab_size`` columns) in ``cpu_head_format``. ``whole_blocks``: weights whose K is not
    a multiple of the block stay float (the HTP refuses a padded MatMulNBits: tiny Gemma-4's
    per-layer projection, K = 8).

    One weight in memory at a time (a real-size HTP shard's fp32 graph is ~7 GB): each is read
    from where the graph keeps it, quantized by onnxruntime's MatMulNBitsQuantizer alone in a
    one-node model, and its packed bytes appended to ``<graph>.data``, which the caller's
    ``share_weights`` takes in. -> MatMuls quantized."""
    import onnx
    from onnx import helper, numpy_helper

    from ..export.onnxexport import append_external, read_external

    model = onnx.load(str(path), load_external_data=False)
    folder, data = path.parent, path.name + ".data"
    inits = {t.name: t for t in model.graph.initializer}
    uses: dict[str, int] = {}
    for node in model.graph.node:
        for x in node.input:
            uses[x] = uses.get(x, 0) + 1

    def weight(t) -> np.ndarray:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            return numpy_helper.to_array(t)
        raw = read_external(t, folder)
        return np.frombuffer(raw, dtype=helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(
            tuple(t.dims))

    if any(t.data_location == onnx.TensorProto.EXTERNAL and
           any(e.key == "location" and e.value == data for e in t.external_data)
           for t in model.graph.initializer):
        raise BuildError(f"{path.name}: its weights are in {data}, which quantizing rewrites")
    nodes, added, done = [], [], {}
    n = 0
    with open(folder / data, "wb") as f:
        for i, node in enumerate(model.graph.node):
            t = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 \
                else None
            if t is None or len(t.dims) != 2 or t.data_type != onnx.TensorProto.FLOAT or \
                    (whole_blocks and t.dims[0] % block_size):
                nodes.append(node)
                continue
            fmt = cpu_head_format(bits, block_size) if vocab_size and t.dims[1] == vocab_size \
                else (bits, block_size)
            w = weight(t)
            if is_structural(w):
                nodes.append(node)
                continue
            node.name = node.name or f"matmul_{i}"
            q = _quantize_matmul(node, t, w, fmt, accuracy_level, model.opset_import)
            del w
            nodes.extend(q.node)
            for qt in q.initializer:
                if qt.name in done:
                    continue
                append_external(f, qt, data, qt.raw_data or numpy_helper.to_array(qt).tobytes())
                done[qt.name] = qt
                added.append(qt)
            uses[t.name] -= 1
            n += 1
    keep = [t for t in model.graph.initializer if uses.get(t.name, 0) > 0]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep + added)
    if n and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(path))
    release_heap()  # the quantizer's float copies, freed into the C heap (4.5 GB kept at 4B)
    return n


def _quantize_matmul(node, t, w: np.ndarray, fmt: tuple[int, int], accuracy_level: int,
                     opset_import):
    """One MatMul (weight ``t`` with values ``w`` [K, N]) -> onnxruntime's MatMulNBits graph for it.
    A weight over ONE_NODE_BYTES is quantized in column slices and the slices' packed weights and
    scales stacked along N: each output column's blocks are its own, so the result is the
    whole weight's, bit for bit (tests/test_quantize_stream.py)."""
    from onnx import helper, numpy_helper

    cols = max(1, ONE_NODE_BYTES // (w.shape[0] * w.itemsize))
    parts = []
    for c in range(0, w.shape[1], cols):
        one = helper.make_model(helper.make_graph(
            [node], "one", [helper.make_tensor_value_info(node.input[0], t.data_type, None)],
            [helper.make_tensor_value_info(node.output[0], t.data_type, None)],
            [numpy_helper.from_array(np.ascontiguousarray(w[:, c:c + cols]), t.name)]),
            opset_imports=opset_import)
        parts.append(_matmul_nbits(one, *fmt, accuracy_level, exclude=[]).graph)
    if len(parts) == 1:
        return parts[0]
    q = parts[0]
    (mm,) = q.node  # one MatMulNBits, inputs (x, B, scales[, zero points])
    stacked = {name: np.concatenate([numpy_helper.to_array(
        next(i for i in p.initializer if i.name == name)) for p in parts], axis=0)
        for name in mm.input[1:] if name}
    del q.initializer[:]
    q.initializer.extend(numpy_helper.from_array(v, name) for name, v in stacked.items())
    for a in mm.attribute:
        if a.name == "N":
            a.i = w.shape[1]
    return q


def cpu_head_format(bits: int, block_size: int) -> tuple[int, int]:
    """The lm_head's (bits, block) under weights of (bits, block): int4 weights keep an int8 head
    in blocks of 32 (and so an int8 embedding where it is tied), as llama.cpp keeps its output
    matrix at 6 bits in Q4_K_M: an int4 head alone costs most of an int4 model's KL to HF
    (docs/notes/measurements.md)."""
    return (8, 32) if bits == 4 else (bits, block_size)


def _matmul_nbits(model, bits: int, block_size: int, accuracy_level: int, exclude: list[str]):
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    cfg = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True,
                                       accuracy_level=accuracy_level, bits=bits)
    root_log = logging.getLogger()
    level = root_log.level
    root_log.setLevel(logging.ERROR)  # the quantizer logs every node at INFO
    try:
        q = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True,
                                 accuracy_level=accuracy_level, algo_config=cfg,
                                 nodes_to_exclude=exclude)
        q.process()
    finally:
        root_log.setLevel(level)
    return q.model.model
