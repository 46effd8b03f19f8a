"""Streaming calibration (issue 10: real-size decode feeds each hold the whole KV cache, so the
build never stores them): GraphStats fed one call at a time gives ORT's one-shot MinMax ranges
and the exact GPTQ Hessians; HessianStore pools them on disk."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from hexforge.build.calibstats import Gram, GraphStats, HessianStore, _Reader, weight_key
from hexforge.build.quantize import _qnn_config, _quantize


def _graph(tmp_path):
    """x [1, T, 8] -> MatMul(w1) -> Relu -> MatMul(w2) (+ a past.* input through a Concat);
    weights external, as the build exports them."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 4)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
        helper.make_node("Concat", ["past.k", "y"], ["new.k"], axis=1),
    ]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8]),
         helper.make_tensor_value_info("past.k", TensorProto.FLOAT, [1, 5, 4])],
        [helper.make_tensor_value_info("new.k", TensorProto.FLOAT, [1, 8, 4])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "g.onnx"
    onnx.save(m, str(path), save_as_external_data=True, location="g.weights", size_threshold=0)
    feeds = [{"x": rng.standard_normal((1, 3, 8)).astype(np.float32) * (i + 1),
              "past.k": rng.standard_normal((1, 5, 4)).astype(np.float32)} for i in range(6)]
    return path, feeds, w1, w2


def _qparams(path) -> dict:
    m = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    return {n.output[0]: (inits[n.input[1]].tolist(), inits[n.input[2]].tolist())
            for n in m.graph.node if n.op_type == "QuantizeLinear"}


def test_streamed_ranges_equal_ort_one_shot_calibration(tmp_path):
    from onnxruntime.quantization import quantize

    path, feeds, *_ = _graph(tmp_path)
    cfg = _qnn_config(path, _Reader(feeds), {})
    quantize(str(path), str(tmp_path / "ort.qdq.onnx"), cfg)  # ORT pulling every feed at once

    stats = GraphStats(path, tmp_path / "work", hessians=False)
    for f in feeds:
        stats.add(f)
    cache = stats.save_ranges(tmp_path / "work" / "g.ranges.json")
    assert stats.past_absmax["past.k"] == max(float(np.abs(f["past.k"]).max()) for f in feeds)
    stats.close()
    _quantize(path, tmp_path / "ours.qdq.onnx", cache, {})
    ort_q, ours = _qparams(tmp_path / "ort.qdq.onnx"), _qparams(tmp_path / "ours.qdq.onnx")
    assert ort_q and ours == ort_q
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # cleaned


def test_streamed_hessians_are_sum_xtx_per_activation_and_pool_on_disk(tmp_path):
    path, feeds, w1, w2 = _graph(tmp_path)
    stats = GraphStats(path, tmp_path / "work", ranges=False)
    for f in feeds:
        stats.add(f)
    groups = dict((tuple(k), g) for k, g in stats.hessian_groups())
    stats.close()
    x = np.concatenate([f["x"].reshape(-1, 8) for f in feeds]).astype(np.float64)
    r = np.maximum(x @ w1.astype(np.float64), 0)
    # 18 rows of x (K 8) outgrew H and were folded; 18 rows of r (K 16) are kept as rows
    assert groups[(weight_key(w1),)].H is not None and groups[(weight_key(w2),)].rows is not None
    np.testing.assert_allclose(groups[(weight_key(w1),)].matrix(), x.T @ x, rtol=1e-5)
    np.testing.assert_allclose(groups[(weight_key(w2),)].matrix(), r.T @ r, rtol=1e-4)

    store = HessianStore(tmp_path / "h")
    store.add(list((list(k), H) for k, H in groups.items()))
    store.add(list((list(k), H) for k, H in groups.items()))  # a second graph, same weights
    np.testing.assert_allclose(store.get(weight_key(w1)), 2 * x.T @ x, rtol=1e-5)
    assert store.get("absent") is None and len(store) == 2
    assert store.solved("k", "int8") is None
    store.solved("k", "int8", (np.ones(3, np.float32), np.zeros((2, 3), np.int8)))
    assert store.solved("k", "int8")[1].shape == (2, 3)


def test_hessian_store_keeps_wide_inputs_as_rows_on_disk(tmp_path):
    """Regression (the real-size Gemma-4-E2B v81 build ran out of disk, ~29 GB of float64 H):
    an activation seen in fewer rows than 2K is stored as its rows, pooled by concatenating
    them, and made into H only when a weight asks for it."""
    rng = np.random.default_rng(1)
    K = 512
    xs = [rng.standard_normal((40, K)).astype(np.float32) for _ in range(3)]
    store = HessianStore(tmp_path / "h")
    store.add([(["a", "b"], Gram(rows=xs[0]))])
    store.add([(["a", "b"], Gram(rows=xs[1]))])  # the decode twin of the same weights
    store.add([(["c"], Gram(rows=xs[2]) + Gram(H=np.eye(K)))])  # rows + H -> H
    x = np.concatenate(xs[:2]).astype(np.float64)
    np.testing.assert_allclose(store.get("a"), x.T @ x, rtol=1e-6)
    assert store.get("b").shape == (K, K) and store.file_of["a"] == store.file_of["b"]
    sizes = {k: store.file_of[k].stat().st_size for k in ("a", "c")}
    assert sizes["a"] < 80 * K * 4 + 1024 < K * K * 8 <= sizes["c"]  # rows, not H
    x2 = xs[2].astype(np.float64)
    np.testing.assert_allclose(store.get("c"), x2.T @ x2 + np.eye(K), rtol=1e-6)
    many = Gram(rows=np.ones((2 * K - 1, K), np.float32)) + Gram(rows=np.ones((1, K), np.float32))
    assert many.rows is None and many.H.shape == (K, K)  # 2K rows: H is the smaller form


def _gptq_reference(w, H, B, scale_of, qlo, qhi, damp=0.01):
    """GPTQ as the paper states it: float64, one row at a time, the inverse Hessian's upper
    Cholesky factor from an explicit inverse."""
    K, N = w.shape
    W = w.astype(np.float64).copy()
    H = H.copy()
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[dead] = 0.0
    H[np.diag_indices(K)] += damp * np.mean(np.diag(H))
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    Q = np.zeros((K, N), np.int8)
    for b0 in range(0, K, B):
        s = scale_of(W[b0:b0 + B].astype(np.float32)).astype(np.float64)
        for i in range(b0, min(b0 + B, K)):
            q = np.clip(np.round(W[i] / s), qlo, qhi)
            Q[i] = q
            e = (W[i] - q * s) / U[i, i]
            W[i:] -= np.outer(U[i, i:], e)
    return Q


def test_blocked_float32_gptq_matches_the_row_by_row_reference_and_beats_rtn():
    from hexforge.build.quantize import gptq_int4, gptq_int8, int4_blocks, rtn_int8

    rng = np.random.default_rng(0)
    K, N = 160, 48  # K not a multiple of the 128-row block or the 16-row sub-block
    X = rng.standard_normal((40, K)) * (1 + 3 * rng.random(K))  # fewer rows than K, as calibrated
    X[:, 5] = 0  # a dead input
    H = X.T @ X
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)

    def out_err(deq):
        return np.linalg.norm(X @ deq - X @ w) / np.linalg.norm(X @ w)

    s8, q8 = gptq_int8(w, H)
    ref8 = _gptq_reference(w, H, K, lambda rows: s8, -127, 127)
    assert (q8 == ref8).mean() > 0.995 and np.abs(q8.astype(int) - ref8).max() <= 1
    rs, rq = rtn_int8(w)
    assert out_err(q8 * s8) < 0.7 * out_err(rq * rs)
    assert (q8[5] == 0).all()  # a dead input's row carries nothing

    K4 = 128
    s4, q4 = gptq_int4(w[:K4], H[:K4, :K4], 32)
    ref4 = _gptq_reference(w[:K4], H[:K4, :K4], 32, lambda rows: int4_blocks(rows, 32)[0][0], -8, 7)
    assert (q4 == ref4).mean() > 0.995 and q4.min() >= -8 and q4.max() <= 7
    deq4 = q4 * np.repeat(s4, 32, axis=0)
    rs4, rq4 = int4_blocks(w[:K4], 32)
    Xs = X[:, :K4]
    rtn_err = np.linalg.norm(Xs @ (rq4 * np.repeat(rs4, 32, axis=0)) - Xs @ w[:K4])
    assert np.linalg.norm(Xs @ deq4 - Xs @ w[:K4]) < 0.8 * rtn_err
