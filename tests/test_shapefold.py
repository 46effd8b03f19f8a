"""The decoder graphs are exported without torch's shape inference and their shapes folded
afterwards (forge/export/shapefold.py): node for node the graphs torch's own shape inference gives."""

from __future__ import annotations

from collections import Counter

import pytest

FAMILIES = ["llama", "qwen3", "gemma4", "qwen3_5", "qwen3_vl"]
GENIE = {"llama", "qwen3"}  # the families Genie bundles are built for: their Genie graphs too


def _ops(path) -> list[str]:
    """The graph's ops once its constants are folded (torch folds some constant chains the
    other export leaves, and the other way round: the same values)."""
    import onnx

    from hexforge.forge.export.shapefold import fold_shapes

    m = onnx.load(str(path), load_external_data=False)
    fold_shapes(m)
    return [n.op_type for n in m.graph.node if n.op_type != "Constant"]


@pytest.mark.parametrize("family", FAMILIES)
def test_folded_export_is_node_for_node_torchs_shape_inference(ckpt, tmp_path, monkeypatch,
                                                               family):
    import hexforge.forge.export.onnxexport as export
    from hexforge.forge.pipeline import BuildOptions, build

    # verify_len=0: the cpu AR-k verify graph is the prefill module at another length
    opts = dict(targets="v81", quant="fp16", context=64, prefill_len=8, verify_len=0,
                verify=False, keep_work=True, genie=family in GENIE)
    folded = build(ckpt(family), tmp_path / "folded", BuildOptions(**opts), log=lambda m: None)
    real = export.export_module
    monkeypatch.setattr(export, "export_module",
                        lambda module, path, exporter="dynamo", fold=False: real(
                            module, path, exporter))
    for mod in ("hexforge.forge.export.graphs", "hexforge.forge.genie.decoder"):
        monkeypatch.setattr(f"{mod}.export_module", export.export_module, raising=False)
    plain = build(ckpt(family), tmp_path / "plain", BuildOptions(**opts), log=lambda m: None)

    graphs = sorted(p.relative_to(plain) for p in plain.rglob("*.onnx")
                    if not p.name.endswith(".ctx.onnx"))
    assert len(graphs) >= 5  # cpu prefill / decode / head, the HTP's float graphs
    assert (family in GENIE) == any("genie" in g.parts for g in graphs)
    for g in graphs:
        a, b = _ops(plain / g), _ops(folded / g)
        assert a == b, (g, Counter(a) - Counter(b), Counter(b) - Counter(a))


def _anon_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise OSError("no RssAnon in /proc/self/status")


def _graph_file(path, rows: int):
    """x [2, rows] @ w [rows, 8192] (inline), reshaped by a shape the fold computes."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((rows, 8192), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("Shape", ["y"], ["s"]),  # folds to a constant
             helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(
                 np.array([2, -1], np.int64))),
             helper.make_node("Mul", ["s", "two"], ["s2"]),  # evaluated: constant inputs
             helper.make_node("Reshape", ["y", "s2"], ["z"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, rows])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def test_regression_the_fold_kept_every_exported_graph_alive(tmp_path):
    """Qwen3.5-4B's cpu target grew ~1.7 GB of memory per exported graph (13.7 GB after four):
    the fold's reference evaluators (reference cycles) held nodes of the graph, and with them
    its protobuf memory, inline weights and all, until the cyclic gc happened to run. A folded
    and deleted graph frees its weights with the cyclic gc off (the C heap trimmed before each
    reading: the suite runs this after other tests in the same process, and glibc may keep what
    a process freed; memory still in use cannot be trimmed)."""
    import gc

    import onnx

    from hexforge.forge.export.shapefold import fold_shapes
    from hexforge.forge.heap import release_heap

    def fold(path) -> int:
        m = onnx.load(str(path))
        n = fold_shapes(m)
        del m
        return n

    fold(_graph_file(tmp_path / "small.onnx", 16))  # the imports and caches of a first fold
    big = _graph_file(tmp_path / "big.onnx", 4096)  # 128 MiB of weights
    gc.collect()
    gc.disable()
    try:
        release_heap()
        before = _anon_bytes()
        assert fold(big) >= 2
        release_heap()
        kept = _anon_bytes() - before
    finally:
        gc.enable()
    assert kept < 32 << 20, f"{kept / 2**20:.0f} MiB still held after the graph was deleted"
