"""cpu graph fusions (forge/export/fuse.py): each rewrite keeps the graph's values, on hand-made graphs
with the shapes that break a careless rewrite, and lands in the built bundles."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from hexforge.forge.export.fuse import fuse_skip_norms, pack_sibling_matmuls

H = 64


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                               helper.make_opsetid("com.microsoft", 1)],
                             ir_version=9)


def _run(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _residual_graph(skip_shape):
    """x + d -> norm, and x + d also used after the norm (the residual stream) and as an output;
    the norm's user is listed before a second user of the sum."""
    gamma = numpy_helper.from_array(np.linspace(0.5, 1.5, H, dtype=np.float32), "gamma")
    nodes = [
        helper.make_node("Add", ["x", "d"], ["sum"]),
        helper.make_node("SimplifiedLayerNormalization", ["sum", "gamma"], ["normed"],
                         axis=-1, epsilon=1e-6, stash_type=1),
        helper.make_node("Mul", ["normed", "normed"], ["sq"]),
        helper.make_node("Add", ["sum", "sq"], ["y"]),
    ]
    return _model(nodes, [_vi("x", [1, 3, H]), _vi("d", skip_shape)],
                  [_vi("y", [1, 3, H]), _vi("sum", [1, 3, H])], [gamma])


def test_skip_norm_fusion_keeps_values_and_the_sum_for_its_other_users():
    m = _residual_graph([1, 3, H])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 3, H), np.float32),
             "d": rng.standard_normal((1, 3, H), np.float32)}
    want = _run(m, feeds)
    assert fuse_skip_norms(m) == 1
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 1 and ops.count("Add") == 1
    onnx.checker.check_model(m)  # still topologically sorted
    for got, ref in zip(_run(m, feeds), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_skip_norm_fusion_leaves_a_broadcasting_add_alone():
    """x [1,3,H] + d [1,1,H] is not a residual sum: SkipSimplifiedLayerNormalization's skip
    input would be read as [1,3,H]."""
    m = _residual_graph([1, 1, H])
    assert fuse_skip_norms(m) == 0


def _quantized_siblings(tmp_path, n_out=(48, 16, 16)):
    """Three MatMuls on one input (q/k/v), quantized to int4 MatMulNBits the way the build does."""
    from hexforge.forge.quantize.nbits import quantize_cpu_graph

    rng = np.random.default_rng(1)
    K = 64
    ws = [numpy_helper.from_array(rng.standard_normal((K, n), np.float32) * 0.1, f"w{i}")
          for i, n in enumerate(n_out)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(len(n_out))]
    nodes.append(helper.make_node("MatMul", ["y0", "w_out"], ["z"]))  # a user of one output
    w_out = numpy_helper.from_array(rng.standard_normal((n_out[0], K), np.float32) * 0.1, "w_out")
    m = _model(nodes, [_vi("x", [1, 5, K])],
               [_vi(f"y{i}", [1, 5, n]) for i, n in enumerate(n_out)] + [_vi("z", [1, 5, K])],
               [*ws, w_out])
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    quantize_cpu_graph(path, bits=4, block_size=32)
    return onnx.load(str(path)), {"x": rng.standard_normal((1, 5, K), np.float32)}


def test_packed_matmulnbits_give_the_same_outputs(tmp_path):
    m, feeds = _quantized_siblings(tmp_path)
    want = _run(m, feeds)
    assert sum(n.op_type == "MatMulNBits" for n in m.graph.node) == 4
    assert pack_sibling_matmuls(m) == 2
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("MatMulNBits") == 2 and ops.count("Split") == 1
    assert len(m.graph.initializer) == 5  # packed B, scales, split sizes + the lone MatMul's two
    for got, ref in zip(_run(m, feeds), want, strict=True):
        np.testing.assert_array_equal(got, ref)  # the same int8 dot products, bit for bit


def test_a_pair_of_siblings_stays_unpacked(tmp_path):
    """gate/up pairs stay apart (``min_group`` 3), as genai keeps them."""
    m, _ = _quantized_siblings(tmp_path, n_out=(48, 48))
    assert pack_sibling_matmuls(m) == 0


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_built_cpu_graphs_carry_the_fused_nodes(bundle, weights, tmp_path):
    """The qwen3 cpu bundle: every residual norm but the first is a skip norm, int4 q/k/v run as
    one MatMulNBits; the decode graph's attention is MatMul/norm/rope/GQA with no reshape
    round trips (2 Reshapes per layer: the q and k head norms' views)."""
    import json

    b = bundle("qwen3", cpu_weights=weights)
    man = json.loads((b / "manifest.json").read_text())
    layers = man["num_layers"]
    dec = onnx.load(str(b / "cpu" / "s0.decode.onnx"), load_external_data=False)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(b / "cpu" / "s0.decode.onnx"), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(so.optimized_model_filepath, load_external_data=False)
    ops = [n.op_type for n in opt.graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers  # + the head's norm
    assert ops.count("Add") == 0
    assert ops.count("Reshape") == 4 * layers, ops.count("Reshape")
    packed = sum(n.op_type == "Split" for n in dec.graph.node)
    assert packed == (layers if weights == "int4" else 0)
