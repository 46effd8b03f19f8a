"""The KV cache's I/O rewrites (forge/htp/kvcast.py) on a tiny graph, run by onnxruntime's CPU EP:
what the rewritten graph computes with is the cache the float graph saw, to the format's step."""

from __future__ import annotations

import numpy as np
import pytest

from hexforge.forge.htp.kvcast import fp16_kv_graph, kv_u8_scale, u8_kv_graph
from hexforge.manifest import GraphSpec, TensorSpec

BINDS = {"state:L0.k", "new:L0.k"}


def _graph(path):
    """score = ReduceSum(past * q) (a stand-in for QK^T over the cache); new = q * 3."""
    import onnx
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["past.L0.k", "q"], ["prod"]),
             helper.make_node("ReduceSum", ["prod"], ["score"], keepdims=0),
             helper.make_node("Mul", ["q", "three"], ["new.L0.k"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("past.L0.k", f, [1, 1, 8, 4]),
                                       helper.make_tensor_value_info("q", f, [1, 1, 8, 4])],
                          [helper.make_tensor_value_info("score", f, []),
                           helper.make_tensor_value_info("new.L0.k", f, [1, 1, 8, 4])],
                          [helper.make_tensor("three", f, [], [3.0])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    t = dict(shape=[1, 1, 8, 4], dtype="float32")
    return GraphSpec(name="s0.decode", role="decode", file=path.name, seq_len=1,
                     inputs=[TensorSpec(name="past.L0.k", bind="state:L0.k", **t),
                             TensorSpec(name="q", bind="input:q", **t)],
                     outputs=[TensorSpec(name="score", shape=[], dtype="float32", bind="output:s"),
                              TensorSpec(name="new.L0.k", bind="new:L0.k", **t)])


def _run(path, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("form", ["fp16", "u8"])
def test_the_rewritten_cache_io_computes_what_the_float_graph_did(tmp_path, form):
    rng = np.random.default_rng(0)
    past = rng.uniform(-2, 2, (1, 1, 8, 4)).astype(np.float32)
    q = rng.uniform(-0.5, 0.5, (1, 1, 8, 4)).astype(np.float32)
    path = tmp_path / "g.onnx"
    spec = _graph(path)
    want_score, want_new = _run(path, {"past.L0.k": past, "q": q})
    if form == "fp16":
        out, step = fp16_kv_graph(path, spec, BINDS), 2e-3
        held = past.astype(np.float16)
    else:
        out, step = u8_kv_graph(path, spec, BINDS, {"L0.k": 2.0}), kv_u8_scale(2.0)
        held = (np.round(past / step) + 128).astype(np.uint8)  # the buffer the runtime keeps
    dtype = "float16" if form == "fp16" else "uint8"
    assert [t.dtype for t in out.inputs] == [dtype, "float32"]
    assert [t.dtype for t in out.outputs] == ["float32", dtype]
    score, new = _run(path, {"past.L0.k": held, "q": q})
    assert new.dtype == np.dtype(dtype)
    back = new.astype(np.float32) if form == "fp16" else (new.astype(np.float32) - 128) * step
    assert np.abs(back - want_new).max() <= step * 2  # new rows: one rounding of the format
    assert abs(float(score) - float(want_score)) <= step * np.abs(q).sum()
    assert u8_kv_graph(path, out, BINDS, {"L0.k": 2.0}) == out  # idempotent: not float32 now


def test_u8_scale_covers_the_calibrated_peak_with_a_margin():
    s = kv_u8_scale(10.0)
    assert 127 * s > 10.0  # the peak does not clip
    assert 127 * s < 20.0  # and the step is not wasted on range no text reached
