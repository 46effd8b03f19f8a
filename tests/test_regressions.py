"""Regression tests named after the bugs they pin down."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from hexforge.families import blocks


def _export(module, x, path):
    torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=18)


@pytest.mark.parametrize("level", [ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                   ort.GraphOptimizationLevel.ORT_ENABLE_ALL])
@pytest.mark.parametrize("prescale", [1.0, 256.0])
def test_rmsnorm_export_matches_torch_for_inputs_other_than_the_traced_one(tmp_path, level,
                                                                         prescale):
    """A max-abs RMSNorm variant matched ORT's SimplifiedLayerNormalization fusion, which treated
    its dynamic eps term as a constant (wrong outputs at ORT_ENABLE_EXTENDED and above)."""
    torch.manual_seed(0)
    norm = blocks.RMSNorm(torch.randn(8), 1e-6, prescale=prescale)
    x = torch.randn(1, 4, 8) * 0.01
    _export(norm, x, tmp_path / "n.onnx")
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    sess = ort.InferenceSession(str(tmp_path / "n.onnx"), so, providers=["CPUExecutionProvider"])
    for scale in (1.0, 7.0, 0.001):
        y = sess.run(None, {sess.get_inputs()[0].name: (x * scale).numpy()})[0]
        want = norm(x * scale).detach().numpy()
        assert np.abs(y - want).max() < 1e-5 * max(1.0, np.abs(want).max())


def test_rmsnorm_prescale_is_exact_and_uses_no_pow():
    """Pow's exponent went through Q/DQ and dequantized to 1.99997: NaN for negative bases."""
    torch.manual_seed(0)
    w = torch.randn(16)
    x = torch.randn(2, 3, 16) * 1e-3
    plain, scaled = blocks.RMSNorm(w, 1e-6), blocks.RMSNorm(w, 1e-6, prescale=1024.0)
    assert torch.allclose(plain(x), scaled(x), rtol=1e-6, atol=1e-7)
    graph = torch.jit.trace(scaled, (x,)).graph
    assert "aten::pow" not in str(graph)


def test_gelu_tanh_rewrite_equals_hf_gelu_pytorch_tanh():
    """QNN fused the 0.5x(1+tanh(..)) pattern into a less accurate fp16 GELU; the sigmoid form is
    the same function."""
    x = torch.linspace(-8, 8, 4001)
    ref = torch.nn.functional.gelu(x, approximate="tanh")
    assert torch.allclose(blocks.gelu_tanh(x), ref, atol=2e-6)


def test_widened_ranges_never_move_constants(tmp_path):
    """Widening every activation range also moved constant inputs (e.g. a Pow exponent)."""
    from onnx import TensorProto, helper, numpy_helper

    from hexforge.forge.quantize.qdq import widen_activation_ranges

    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    s = numpy_helper.from_array(np.array(2.0 / 65535, np.float32), "s")
    z = numpy_helper.from_array(np.array(0, np.uint16), "z")
    xs = numpy_helper.from_array(np.array(0.001, np.float32), "xs")
    xz = numpy_helper.from_array(np.array(32768, np.uint16), "xz")
    nodes = [helper.make_node("QuantizeLinear", ["two", "s", "z"], ["tq"]),
             helper.make_node("DequantizeLinear", ["tq", "s", "z"], ["t"]),
             helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("Pow", ["xd", "t"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                          [two, s, z, xs, xz])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    widen_activation_ranges(m, {t.name: t for t in m.graph.initializer}, 1.9)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": np.array([-1.0, -0.5, 0.5, 1.0], np.float32)})[0]
    assert np.isfinite(y).all() and np.allclose(y, [1.0, 0.25, 0.25, 1.0], atol=1e-2)


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_in_place_prefill_chunk_that_would_pass_the_cache_end_goes_through_ar1(bundle, hf_greedy,
                                                                              family):
    """An in-place cpu prefill graph writes all N rows of a chunk, pad rows included. A chat turn
    starting 6 rows before the end of the cache made GroupQueryAttention refuse the chunk
    ("total_sequence_length ... no greater than past_sequence_length"): such a tail of a prompt
    (< N tokens, once a prompt) now goes through the AR-1 graph. gemma4: its full caches are
    written in place, beside rings the engine writes."""
    import hexforge
    from hexforge.runtime.sampling import greedy
    from tests.conftest import CONTEXT, N, prompt_ids

    eng = hexforge.load(bundle(family)).engine
    assert eng.plan.prefill_in_place and eng.context == CONTEXT
    first, turn = prompt_ids(CONTEXT - 6), prompt_ids(4, seed=1)
    list(eng.generate_step(first, greedy, 1))  # the state holds the first prompt
    assert eng.pos + N > CONTEXT
    got = [t for t, _ in eng.generate_step(turn, greedy, 2, fresh=False)]
    assert got == hf_greedy(family, first + turn, 2)


def _w8a16_qdq(float_path, calib, tmp_path):
    """The build's path for one graph: GraphStats ranges over ``calib`` (feeds of x), ORT's QDQ
    tool, our weight + range pass (w8a16) -> the QDQ graph's path."""
    from hexforge.forge.quantize.calibstats import GraphStats
    from hexforge.forge.quantize.qdq import quantize_graph
    from hexforge.forge.quantize.recipes import RECIPES

    stats = GraphStats(float_path, tmp_path / "calib", hessians=False)
    for x in calib:
        stats.add({"x": x})
    ranges = stats.save_ranges(tmp_path / "ranges.json")
    stats.close()
    qdq_path = tmp_path / "q.onnx"
    quantize_graph(float_path, qdq_path, ranges, {}, {}, RECIPES["w8-u16"], "prefill")
    return qdq_path


def test_widened_range_keeps_the_clip_the_qdq_tool_folded_into_its_quantize(tmp_path):
    """ORT's QDQ tool drops a Clip whose output it quantizes: the QuantizeLinear's range *is* the
    clamp. Widening that range x3 let Qwen3.5's decay exp(clamp(cum_i - cum_j, -80, 0)) through at
    [-160, 80] (and gave a Sigmoid [-1, 2]): positive differences reached the Exp. The widened
    ranges now stop at the float ops' bounds (``value_bounds``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(v, np.float32), n)
             for n, v in (("two", 2.0), ("lo", -80.0), ("hi", 0.0))]
    inits.append(numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "w"))
    nodes = [helper.make_node("Mul", ["x", "two"], ["d"]),
             helper.make_node("Clip", ["d", "lo", "hi"], ["c"]),
             helper.make_node("Exp", ["c"], ["e"]),
             helper.make_node("MatMul", ["e", "w"], ["y"]),
             helper.make_node("Sigmoid", ["x"], ["s"]),
             helper.make_node("MatMul", ["s", "w"], ["y2"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, 8])
                           for y in ("y", "y2")], inits)
    float_path = tmp_path / "f.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9),
              str(float_path))
    # calibration never sees x > 0: the Clip's max 0 is only ever met, never cut
    calib = np.linspace(-60, 0, 8, dtype=np.float32)[None]
    qdq_path = _w8a16_qdq(float_path, [calib], tmp_path)

    qm = onnx.load(str(qdq_path))
    assert "Clip" not in {n.op_type for n in qm.graph.node}  # folded, as the tool does
    init = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
    span = {}
    for n in qm.graph.node:
        if n.op_type == "QuantizeLinear":
            s, z = float(init[n.input[1]]), int(init[n.input[2]])
            span[n.input[0]] = (-z * s, (65535 - z) * s)
    assert span["c"][0] >= -80.001 and span["c"][1] <= 1e-6  # widened, but within the clamp
    assert span["s"][0] >= -1e-6 and span["s"][1] <= 1.0 + 1e-6
    x = np.array([[-50, -20, -3, -0.5, 0.5, 3, 20, 50]], np.float32)  # half of it clamped
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"x": x})[0]
    ref, got = run(float_path), run(qdq_path)
    assert np.abs(got - ref).max() < 2e-2 * np.abs(ref).max()


def test_media_tower_norms_are_prescaled_out_of_the_fp16_subnormals(ckpt, monkeypatch):
    """CI's simulator host scored the tiny Gemma-4 vision tower cos 0.99888 in fp16 (this host
    0.999999, same graph): the post-FFN norm's input has rms ~1e-3, so its squares (~1e-6) are fp16
    subnormals, and an HTP that flushes them to zero loses the norm's scale (0.989 emulated). The
    decoder's text calibration never reached the towers' norms; the build now records their
    power-of-two prescales on the encoders' example inputs: every norm squares O(1) values."""
    import json

    from hexforge.families import encoder_families, gemma4_audio, load_family
    from hexforge.forge.export.encoders import calibrate_encoder_norms

    hf = load_family("gemma4").FAMILY.load_hf(ckpt("gemma4_mm"))
    config = json.loads((ckpt("gemma4_mm") / "config.json").read_text())
    encoders = encoder_families(config)
    specs = [enc.spec(hf, config) for enc in encoders]
    assert sorted(s.modality for s in specs) == ["audio", "image"]

    def norm_mean_squares() -> list[float]:
        """Median over rows of mean((k·x)^2) at every norm of both towers' export modules."""
        seen: list[float] = []

        def record(x, k):
            seen.append(float(((x.detach() * k) ** 2).mean(-1).flatten().median()))

        def rms(x, weight, eps, k=1.0, inner=gemma4_audio._rms):
            record(x, k)
            return inner(x, weight, eps, k)

        monkeypatch.setattr(gemma4_audio, "_rms", rms)
        for enc, spec in zip(encoders, specs, strict=True):
            module = enc.encoder_module(hf, spec)
            hooks = [m.register_forward_pre_hook(lambda m, a: record(a[0], m.prescale))
                     for m in module.modules() if isinstance(m, blocks.RMSNorm)]
            feeds = {k: torch.from_numpy(v) for k, v in enc.example_inputs(spec).items()}
            with torch.no_grad():
                module(*(feeds[b.removeprefix("media:")] for _, b in module.io.inputs))
            for h in hooks:
                h.remove()
        monkeypatch.undo()
        return seen

    blocks.clear_norm_prescales(hf)  # this model's norms start uncalibrated, as in a fresh build
    before = norm_mean_squares()
    assert len(before) > 20 and min(before) < 2.0**-14  # the bug: a subnormal mean square
    calibrate_encoder_norms(encoders, specs, hf)
    after = norm_mean_squares()
    assert len(after) == len(before)
    assert 2.0**-2 <= min(after) and max(after) <= 2.0**2


def test_gated_deltanet_output_norm_gets_its_prescale(ckpt):
    """The prescale hook matched class names ending in "RMSNorm", so Qwen3.5's GatedDeltaNet output
    norm (Qwen3_5RMSNormGated) kept k = 1: on the real-width 4-layer cut its input is ~1e-3 (a
    uint16 scale of 8e-8), and the HTP's x*x of it differed from its own QDQ graph on the CPU by
    10 % (the largest gap in the decode graph). Every RMSNorm-like module is calibrated now."""
    import json

    import torch

    from hexforge.families import load_family

    hf = load_family("qwen3_5_text").FAMILY.load_hf(ckpt("qwen3_5"))
    ids = torch.tensor([list(range(3, 60))])
    got = blocks.record_norm_prescales(hf, lambda: hf(ids, attention_mask=torch.ones_like(ids)))
    config = json.loads((ckpt("qwen3_5") / "config.json").read_text())
    linear = [i for i, t in enumerate(config["layer_types"]) if t == "linear_attention"]
    for i in linear:
        norm = hf.model.layers[i].linear_attn.norm
        assert type(norm).__name__ == "Qwen3_5RMSNormGated"
        name = f"model.layers.{i}.linear_attn.norm"
        assert name in got and blocks.RMSNorm.from_hf(norm).prescale == got[name]


def test_act_x_act_matmul_inputs_keep_their_calibrated_range(tmp_path):
    """The HTP's activation x activation MatMul keeps only the high bits of its 16-bit inputs:
    with the x3 widened ranges Qwen3.5's state read k·(S·decay) was 5.5x the CPU EP's error
    (0.048 vs 0.009 relative, real-width cut, v81 simulator), 0.008 with ranges 4x tighter. Its
    inputs now keep the calibrated range (and so does the int16 rhs made from it); every other
    activation is still widened x3."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), n)
             for n in ("wa", "wb")]
    nodes = [helper.make_node("MatMul", ["x", "wa"], ["a"]),
             helper.make_node("MatMul", ["x", "wb"], ["b"]),
             helper.make_node("Transpose", ["b"], ["bt"], perm=[1, 0]),
             helper.make_node("MatMul", ["a", "bt"], ["y"])]  # act x act: [1, 8] @ [8, 1]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])], inits)
    float_path = tmp_path / "f.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9),
              str(float_path))
    calib = rng.standard_normal((16, 1, 8)).astype(np.float32)
    qm = onnx.load(str(_w8a16_qdq(float_path, calib, tmp_path)))
    init = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
    width = {n.input[0]: float(init[n.input[1]]) * 65535 for n in qm.graph.node
             if n.op_type == "QuantizeLinear" and init[n.input[2]].dtype == np.uint16}
    a = calib @ numpy_helper.to_array(inits[0])  # the MatMul's lhs as calibrated
    assert width["a"] <= 1.01 * (max(0.0, a.max()) - min(0.0, a.min()))
    assert width["x"] >= 2.9 * (max(0.0, calib.max()) - min(0.0, calib.min()))  # still x3
    matmul = next(n for n in qm.graph.node if n.op_type == "MatMul" and n.output[0].startswith("y"))
    assert any("s16" in i for i in matmul.input)  # the rhs went int16 from the unwidened range


@pytest.mark.parametrize("fold", [False, True])
def test_regression_the_export_trace_kept_every_layers_activations_for_autograd(tmp_path, fold):
    """The torchscript export traced the module with autograd on (its weights require grad), so
    every layer's activations were saved for a backward pass: Gemma-4-E4B's vision tower (16
    layers of [12, 2520, 2520] attention) exported at 14.5 GB instead of 3.5. Every trace of the
    module runs without autograd now, and the graph is the one it was."""
    from hexforge.families.graphio import GraphIO
    from hexforge.forge.export.onnxexport import export_module

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)  # requires_grad, as the families' weights are
            self.grad_seen = []
            self.io = GraphIO(inputs=[("x", "x")], outputs=[("y", "y")])

        def example_inputs(self):
            return (torch.randn(1, 3, 8),)

        def forward(self, x):
            self.grad_seen.append(torch.is_grad_enabled())
            return torch.softmax(self.lin(x) @ x.transpose(1, 2), -1)

    probe = Probe()
    export_module(probe, tmp_path / "p.onnx", "torchscript", fold=fold)
    assert len(probe.grad_seen) >= 2 and not any(probe.grad_seen)  # the check run and the trace
    x = probe.example_inputs()[0]
    got = ort.InferenceSession(str(tmp_path / "p.onnx")).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, probe(x).detach().numpy(), rtol=1e-5, atol=1e-6)
