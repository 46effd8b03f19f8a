"""Export static-shape torch modules to ONNX, then give graphs that share weights one weight file.

Prefill (AR-N) and decode (AR-1) graphs of a shard are exported separately from the same module
weights; ``share_weights`` moves every initializer into one external-data file, de-duplicated by
content, so the two graphs point at the same bytes on disk (half the bundle size).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import signal
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ...bundle.errors import BuildError
from ...bundle.manifest import TensorSpec
from ...families.graphio import GraphIO

EXPORTERS = ("torchscript", "dynamo")
MIN_EXTERNAL_BYTES = 1024  # smaller initializers stay inline
ALIGN = 64


def export_module(module, path: Path, exporter: str = "dynamo", fold: bool = False
                  ) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Export ``module`` (with .io: GraphIO and .example_inputs()) to ``path``; -> (inputs, outputs).

    fold (torchscript): export without torch's shape inference and fold the shapes afterwards
    on the graph alone (forge/export/shapefold.py): the same graph, ~40 % less export time at real
    size (docs/notes/realsize.md#where-the-time-goes). The decoder graphs take it; the encoders
    do not (without it the Gemma-4 audio conformer's export is invalid: a ConcatFromSequence typed
    int64)."""
    import torch

    io: GraphIO = module.io
    args = module.example_inputs()
    with torch.no_grad():
        outs = module(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    in_names = [n for n, _ in io.inputs]
    out_names = [n for n, _ in io.outputs]
    try:
        # no_grad: the torchscript trace runs the module on real tensors, and with the weights'
        # requires_grad autograd kept every layer's activations for a backward pass that never
        # comes (Gemma-4-E4B's vision tower, [12, 2520, 2520] attention: four times the memory).
        # The graph is the same either way.
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            if exporter == "dynamo":
                logging.getLogger("torch.onnx").setLevel(logging.ERROR)
                torch.onnx.export(module, args, str(path), input_names=in_names,
                                  output_names=out_names, dynamo=True, opset_version=21,
                                  external_data=False, verbose=False)
            elif exporter == "torchscript" and fold:
                # torch.onnx.export has no switch for it; its torchscript _export has (torch is
                # pinned in pyproject.toml)
                from torch.onnx._internal.torchscript_exporter import utils

                utils._export(module, args, str(path), input_names=in_names,
                              output_names=out_names, opset_version=18,
                              do_constant_folding=True, onnx_shape_inference=False)
            elif exporter == "torchscript":
                torch.onnx.export(module, args, str(path), input_names=in_names,
                                  output_names=out_names, dynamo=False, opset_version=18,
                                  do_constant_folding=True)
            else:
                raise BuildError(f"unknown exporter {exporter!r}; choose from {EXPORTERS}")
    except BuildError:
        raise
    except Exception as e:
        raise BuildError(f"ONNX export of {path.name} failed: {type(e).__name__}: {e}") from e
    import onnx

    m = onnx.load(str(path), load_external_data=False)  # once: a 262k-row head is ~1 s a load
    _check_io(m, path, in_names, out_names)
    if gather_side_files(path, m):
        m = onnx.load(str(path), load_external_data=False)  # the file was rewritten
    changed = _fold_identities(m)
    if fold and exporter == "torchscript":
        from .shapefold import fold_shapes

        changed = fold_shapes(m) or changed
    if changed:
        onnx.save(m, str(path))
    del m
    return io.specs(list(args), "inputs"), io.specs(list(outs), "outputs")


def export_modules(jobs: list[tuple[object, Path]], exporter: str, fold: bool = False,
                   done: Callable[[int, float], None] = lambda i, seconds: None,
                   workers: int | None = None) -> list[tuple[list[TensorSpec], list[TensorSpec]]]:
    """``export_module`` of each (module, path), up to ``workers`` at once (default: one per
    CPU, at most 3) in forked children, as memory allows; ``done(i, seconds)`` as job i
    finishes. -> (inputs, outputs) per job, in order.

    Why: an export is one core's work (torch's trace, the fold, the proto's serialization) and a
    real-size build runs dozens of them, most of a minute each (docs/notes/realsize.md). A
    forked child reads the shard's fp32 weights the parent holds copy-on-write; what it adds is
    the trace and the proto, about twice the module's fp32 weights at most, and ~3x its example
    inputs, the caches at --context (``export_need``; docs/notes/measurements.md, "build
    memory"). A child starts while the machine's available memory holds its need and the
    running children's; the first always starts."""
    from ..heap import available_bytes

    workers = min(len(jobs), workers or min(os.cpu_count() or 1, 3))
    if workers <= 1 or not hasattr(os, "fork"):
        out = []
        for i, (module, path) in enumerate(jobs):
            t = time.perf_counter()
            out.append(export_module(module, path, exporter, fold))
            done(i, time.perf_counter() - t)
        return out
    need = [export_need(module) for module, _ in jobs]
    results: list = [None] * len(jobs)
    running: dict[int, tuple[int, float]] = {}  # pid -> (job, start)
    pending = list(range(len(jobs)))
    gc.collect()
    gc.freeze()  # the children's collector leaves the parent's objects (and their pages) alone
    try:
        while pending or running:
            while pending and len(running) < workers and (not running or _fits(
                    need[pending[0]] + sum(need[i] for i, _ in running.values()),
                    available_bytes())):
                i = pending.pop(0)
                running[_fork_export(*jobs[i], exporter, fold)] = (i, time.perf_counter())
            for pid in list(running):
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:
                    i, t = running.pop(pid)
                    results[i] = _export_result(jobs[i][1], status)
                    done(i, time.perf_counter() - t)
            time.sleep(0.02)
    finally:
        for pid, (i, _) in running.items():  # an error or an interrupt: no child outlives it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            _read_and_clean(jobs[i][1])
        gc.unfreeze()
    return results


def export_need(module) -> int:
    """Bytes an export of ``module`` may add to the process (``memory.export_need_bytes``): its
    weights and its example inputs — at a long --context mostly the caches, which the weights
    alone missed: three side-by-side exports of a 135M model at 1M tokens of context were killed
    by the OOM killer. The inputs are sized on torch's meta device: nothing is allocated."""
    import torch

    from ..heap import export_need_bytes

    params = getattr(module, "parameters", None)
    weights = sum(p.numel() for p in params()) if params else 0
    try:
        with torch.device("meta"):
            inputs = module.example_inputs()
        input_bytes = sum(t.numel() * t.element_size() for t in inputs
                          if isinstance(t, torch.Tensor))
    except Exception:  # an input made from data (not shapes) has no meta form: weights alone
        input_bytes = 0
    return export_need_bytes(weights, input_bytes)


def _fits(need: int, available: int | None) -> bool:
    return available is not None and need <= available


def _fork_export(module, path: Path, exporter: str, fold: bool) -> int:
    """Fork a child that exports ``module`` to ``path`` and leaves its result (the IO specs or
    the error) in ``<path>.export.json``; -> its pid.

    The child exports into a folder of its own and moves the graph (and its ``.data``) beside
    ``path`` when done: a graph over 2 GB first comes out as one file per tensor, named by the
    exporter (``onnx__MatMul_5298``), and two exports in one folder overwrote each other's
    (Qwen3.5-4B's 16-layer prefill and decode: a weight of the wrong size)."""
    pid = os.fork()
    if pid:
        return pid
    code, result = 1, _result_file(path)
    try:
        import torch

        torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
        work = _work_folder(path)
        work.mkdir()
        ins, outs = export_module(module, work / path.name, exporter, fold)
        for f in work.iterdir():  # the graph and its gathered <graph>.data
            os.replace(f, path.parent / f.name)
        work.rmdir()
        result.write_text(json.dumps({"inputs": [s.model_dump() for s in ins],
                                      "outputs": [s.model_dump() for s in outs]}))
        code = 0
    except BaseException as e:
        try:
            result.write_text(json.dumps(
                {"error": str(e) if isinstance(e, BuildError) else f"{type(e).__name__}: {e}"}))
        except BaseException:
            pass
    finally:
        os._exit(code)  # no atexit handlers, no inherited buffers flushed twice


def _work_folder(path: Path) -> Path:
    return path.with_name(f".{path.name}.export")


def _result_file(path: Path) -> Path:
    return path.with_name(path.name + ".export.json")


def _read_and_clean(path: Path) -> dict:
    """A child's result for ``path`` (empty if it wrote none, or was killed writing it); its
    result file and its folder (what a failed or killed child left) removed."""
    result = _result_file(path)
    try:
        r = json.loads(result.read_text())
    except (OSError, ValueError):
        r = {}
    result.unlink(missing_ok=True)
    shutil.rmtree(_work_folder(path), ignore_errors=True)
    return r


def _export_result(path: Path, status: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    r = _read_and_clean(path)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        raise BuildError(f"the export of {path.name} was killed by signal {sig}"
                         + (" (out of memory?)" if sig == signal.SIGKILL else ""))
    if "error" in r or os.waitstatus_to_exitcode(status) != 0:
        raise BuildError(r.get("error") or f"the export of {path.name} failed")
    return ([TensorSpec.model_validate(s) for s in r["inputs"]],
            [TensorSpec.model_validate(s) for s in r["outputs"]])


def gather_side_files(path: Path, model=None) -> int:
    """A graph over protobuf's 2 GB leaves the exporter's weights as one file per tensor beside
    it (names like ``onnx__MatMul_5298``, which the next export may reuse for another tensor), the
    values of large Constant nodes too (``_shard_shard_layers.3_mixer_Constant_18_attr__value``):
    move the weights into ``<graph>.data`` at once, which ``share_weights`` then takes in, and the
    Constants' values into the graph — a tensor at a time (a real-size shard is GBs). -> files."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    m = model if model is not None else onnx.load(str(path), load_external_data=False)
    data = path.name + ".data"
    side = {ExternalDataInfo(t).location for t in _tensors(m.graph)
            if t.data_location == onnx.TensorProto.EXTERNAL}
    side.discard(data)
    if not side:
        return 0
    def outside(t) -> bool:  # stored in a file other than <graph>.data
        return t.data_location == onnx.TensorProto.EXTERNAL and ExternalDataInfo(t).location != data

    # each side file goes once its last tensor is read: the graph's weights on disk once, not
    # twice (a Genie split of Qwen3.5-4B is ~10 GB in fp32; its build stopped with a full disk)
    left = Counter(ExternalDataInfo(t).location for t in _tensors(m.graph) if outside(t))

    def read_once(t) -> bytes:
        loc = ExternalDataInfo(t).location
        raw = read_external(t, path.parent)
        left[loc] -= 1
        if not left[loc]:
            (path.parent / loc).unlink(missing_ok=True)
        return raw

    with open(path.parent / data, "ab") as f:
        for t in m.graph.initializer:  # the weights stay outside the graph, now in <graph>.data
            if outside(t):
                append_external(f, t, data, read_once(t))
    for t in _attribute_tensors(m.graph):  # attribute values inline (onnx's convert_attribute=False)
        if outside(t):
            raw = read_once(t)
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
            t.raw_data = raw
    onnx.save(m, str(path))
    return len(side)


def read_external(t, folder: Path) -> bytes:
    """The bytes of externally stored tensor ``t`` (its location is relative to ``folder``)."""
    from onnx.external_data_helper import ExternalDataInfo

    info = ExternalDataInfo(t)
    with open(folder / info.location, "rb") as f:
        f.seek(info.offset or 0)
        return f.read(info.length) if info.length else f.read()


def append_external(f, t, location: str, raw: bytes) -> None:
    """``raw`` appended to ``f`` (the file ``location``) at the next ALIGN boundary, and ``t``
    made to read it from there."""
    f.write(b"\0" * ((-f.tell()) % ALIGN))
    point_at(t, location, f.tell(), len(raw))
    f.write(raw)


def point_at(t, location: str, offset: int, length: int) -> None:
    """Make ``t`` read ``length`` bytes at ``offset`` of ``location``: onnx's set_external_data,
    without its demand that raw_data be set (a second copy of every weight in the message)."""
    import onnx

    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
        t.ClearField(field)
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v
    t.data_location = onnx.TensorProto.EXTERNAL


def _tensors(graph):
    """The graph's initializers and its nodes' tensor attribute values (our graphs have no
    subgraphs)."""
    yield from graph.initializer
    yield from _attribute_tensors(graph)


def _attribute_tensors(graph):
    from onnx import AttributeProto

    for node in graph.node:
        for a in node.attribute:
            if a.type == AttributeProto.TENSOR:
                yield a.t
            elif a.type == AttributeProto.TENSORS:
                yield from a.tensors


def fold_initializer_identities(path: Path) -> int:
    """Rewire consumers of ``Identity(initializer)`` to the initializer itself; -> nodes removed.

    The exporter dedupes equal constants (e.g. the chunked delta rule's triangles, one per layer)
    into one initializer plus an Identity per extra user. Once quantized, that is a weight
    DequantizeLinear feeding an Identity, which the QNN EP does not claim."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    n = _fold_identities(m)
    if n:
        onnx.save(m, str(path))
    return n


def _fold_identities(m) -> int:
    inits = {t.name for t in m.graph.initializer}
    outputs = {o.name for o in m.graph.output}
    alias = {n.output[0]: n.input[0] for n in m.graph.node
             if n.op_type == "Identity" and n.input[0] in inits and n.output[0] not in outputs}
    if not alias:
        return 0
    keep = [n for n in m.graph.node if not (n.op_type == "Identity" and n.output[0] in alias)]
    for n in keep:
        n.input[:] = [alias.get(x, x) for x in n.input]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    return len(alias)


def _check_io(m, path: Path, in_names: list[str], out_names: list[str]) -> None:
    got_in = [i.name for i in m.graph.input]
    got_out = [o.name for o in m.graph.output]
    if got_in != in_names or got_out != out_names:
        raise BuildError(f"{path.name}: exported I/O {got_in} -> {got_out} differs from the module "
                         f"contract {in_names} -> {out_names} (an unused input was dropped?)")


def share_weights(graph_files: list[Path], weights_name: str,
                  transform: Callable[[object], object] | None = None,
                  extend: bool = False) -> int:
    """Move initializers of ``graph_files`` into one de-duplicated external file next to them;
    ``transform`` (e.g. ``fuse.fuse_cpu_graph``) edits each loaded model first, weights in hand.
    Without one, the weights are streamed a tensor at a time (a real-size HTP shard's fp32 graph
    is GBs: loaded whole, it was the build's peak memory).

    ``extend``: the file exists and the graphs that read from it already are left as they are
    (their bytes indexed, not copied); the others' weights are added to it, those it holds
    already not twice. A graph exported after another of the same weights (Genie's AR-1 after
    its AR-N) then takes no more disk than its own export, where a new file beside both took
    three times the weights.

    Returns the bytes written. All graph files must be in the same directory.
    """
    import onnx

    folder = graph_files[0].parent
    wpath = folder / weights_name
    offsets: dict[str, tuple[int, int]] = {}
    if extend and wpath.exists():
        with open(wpath, "r+b") as f:
            f.seek(0, os.SEEK_END)
            start = f.tell()
            for gf in graph_files:
                model = onnx.load(str(gf), load_external_data=False)
                if _index_weights(model, wpath, offsets):
                    del model
                    continue  # already reads from it
                _move_graph_out(model, gf, f, weights_name, offsets)
                del model
            written = f.tell() - start
        return written
    # written beside, then renamed: the graphs may still read weights from a file of that name
    # (weight-only graphs keep their float norms where the float graphs had them)
    tmp = wpath.with_name(weights_name + ".partial")
    with open(tmp, "wb") as f:
        for gf in graph_files:
            if transform is not None:
                model = onnx.load(str(gf))  # loads any external data the exporter wrote
                transform(model)
            else:
                model = onnx.load(str(gf), load_external_data=False)
            _move_graph_out(model, gf, f, weights_name, offsets)
            # protobuf frees a message's bytes with the message, not as fields are cleared: the
            # next graph loads only once this one is gone (E2B cpu, last shard + head: both
            # graphs' weights were alive at once)
            del model
        written = f.tell()
    os.replace(tmp, wpath)
    return written


def _move_graph_out(model, gf: Path, f, weights_name: str,
                    offsets: dict[str, tuple[int, int]]) -> None:
    """Graph ``gf``'s (loaded as ``model``) initializers into ``f``, its exporter's side file
    removed, the graph saved reading them from there."""
    import onnx

    folder = gf.parent
    for t in model.graph.initializer:
        external = t.data_location == onnx.TensorProto.EXTERNAL
        _move_out(t, f, weights_name, offsets, read_external(t, folder) if external else None)
    for stale in folder.glob(gf.name + ".data"):  # exporter side files, now merged
        stale.unlink()
    onnx.save(model, str(gf))


def _index_weights(model, wpath: Path, offsets: dict[str, tuple[int, int]]) -> bool:
    """The bytes ``model``'s initializers read from ``wpath`` into ``offsets`` (as ``_move_out``
    keys them); -> whether it reads any from there."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    found = False
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = ExternalDataInfo(t)
        if info.location != wpath.name:
            continue
        raw = read_external(t, wpath.parent)
        offsets.setdefault(hashlib.sha1(raw).hexdigest() + f":{t.data_type}",
                           (info.offset or 0, len(raw)))
        found = True
    return found


def _move_out(t, f, location: str, offsets: dict[str, tuple[int, int]],
              raw: bytes | None = None) -> None:
    """Initializer ``t``'s bytes (``raw``, where they are not in ``t``) to ``f`` (unless equal
    bytes are there already) and ``t`` made to read them from there; small ones stay inline."""
    from onnx import numpy_helper

    if raw is None:
        raw = t.raw_data or numpy_helper.to_array(t).tobytes()
    if len(raw) < MIN_EXTERNAL_BYTES:
        if t.data_location:  # a small tensor the exporter stored outside: inline again
            del t.external_data[:]
            t.data_location = 0
            t.raw_data = raw
        return
    key = hashlib.sha1(raw).hexdigest() + f":{t.data_type}"
    if key not in offsets:
        f.write(b"\0" * ((-f.tell()) % ALIGN))
        offsets[key] = (f.tell(), len(raw))
        f.write(raw)
    del raw
    point_at(t, location, *offsets[key])
