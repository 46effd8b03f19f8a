"""Qwen3.5 text (tiny random checkpoint: 8 layers = (GatedDeltaNet x3, gated full attention) x2,
2 key / 4 value linear heads, conv kernel 4, partial rotary)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hexforge
from hexforge.runtime.stepinputs import tail_selector
from tests.conftest import N, prompt_ids

LENGTHS = [1, N - 1, N + 1, 3 * N + 5]


@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_equals_hf(bundle, hf_greedy, length):
    ids = prompt_ids(length)
    got = hexforge.load(bundle("qwen3_5")).generate(ids, max_new_tokens=64, ignore_eos=True)
    assert got.token_ids == hf_greedy("qwen3_5", ids, 64)


def test_manifest_state_has_conv_fifo_ssm_and_kv(bundle):
    m = json.loads((bundle("qwen3_5") / "manifest.json").read_text())
    state = {s["name"]: s for s in m["state"]}
    assert state["L0.conv"]["kind"] == "conv_fifo" and state["L0.conv"]["shape"] == [3, 128]
    assert state["L0.ssm"]["kind"] == "ssm" and state["L0.ssm"]["shape"] == [4, 16, 16]
    assert state["L3.k"]["kind"] == "kv_full" and state["L3.k"]["shape"] == [2, 256, 32]
    assert "L3.conv" not in state and "L0.k" not in state
    prefill = next(g for g in m["targets"]["cpu"]["graphs"] if g["name"] == "s0.prefill")
    binds = {i["bind"] for i in prefill["inputs"]}
    assert {"valid", "tail:3", "state:L0.conv", "state:L0.ssm", "state:L3.k"} <= binds


@pytest.mark.parametrize("length", [N, 2 * N + 3])
def test_ar_n_prefill_and_decode_over_prompt_give_the_same_state_and_tokens(bundle, length):
    """The chunked (matmul-only) delta rule with padded last chunks vs the one-token recurrence."""
    model = hexforge.load(bundle("qwen3_5"))
    eng, ids = model.engine, prompt_ids(length)
    eng.reset()
    a = eng.prefill(ids, mode="chunked")
    state_a = {k: v.copy() for k, v in eng.state.buffers.items()}
    eng.reset()
    b = eng.prefill(ids, mode="decode")
    # a chunk's pad rows land in the caches past the prompt (in-place prefill): never read
    held = {s.name: s.kind == "kv_full" for s in model.manifest.state}
    for name, buf in eng.state.buffers.items():
        got, want = (buf[..., :length, :], state_a[name][..., :length, :]) if held[name] else (
            buf, state_a[name])
        np.testing.assert_allclose(want, got, atol=2e-5, err_msg=name)
    np.testing.assert_allclose(a, b, atol=1e-4)
    r1 = model.generate(ids, max_new_tokens=32, ignore_eos=True)
    r2 = model.generate(ids, max_new_tokens=32, ignore_eos=True, prefill_mode="decode")
    assert r1.token_ids == r2.token_ids


def test_two_shards_equal_one(bundle, hf_greedy):
    two = bundle("qwen3_5", max_shard_bytes=800_000)
    m = json.loads((two / "manifest.json").read_text())
    shards = [s["layers"] for s in m["targets"]["cpu"]["plan"]["shards"]]
    assert shards == [[0, 4], [4, 8]]  # a linear-state layer on each side of the cut
    ids = prompt_ids(3 * N + 5)
    a = hexforge.load(bundle("qwen3_5")).generate(ids, max_new_tokens=64, ignore_eos=True)
    b = hexforge.load(two).generate(ids, max_new_tokens=64, ignore_eos=True)
    assert a.token_ids == b.token_ids == hf_greedy("qwen3_5", ids, 64)


def test_cpu_decode_runs_the_gated_delta_net_as_onnxruntimes_fused_ops(bundle):
    """Written out, the GatedDeltaNet is ~95 nodes a linear layer (shifted-add conv, expanded key
    heads, softplus gate, l2 norms, delta-rule matmuls) with its states copied after every step,
    which left the decode behind onnxruntime-genai's. The cpu decode graph runs one
    LinearAttentionGate and LinearAttention per linear layer, LinearAttention writing its state in
    place. The conv step is Concat, Mul, ReduceSum, SiLU, Slice (faster than onnxruntime's
    CausalConvWithState), its fifo written in place too; the gated norm is a
    SimplifiedLayerNormalization x SiLU(z) (faster than GatedRMSNorm). The prefill graph keeps the
    chunk form (the tests above hold both to HF's greedy tokens)."""
    import onnx

    b = bundle("qwen3_5")
    m = json.loads((b / "manifest.json").read_text())
    linear = [s["layer"] for s in m["state"] if s["kind"] == "ssm"]
    fused = ("LinearAttentionGate", "LinearAttention")
    graphs = {g["role"]: g for g in m["targets"]["cpu"]["graphs"]}
    states = {f"alias:past.L{i}.{s}" for i in linear for s in ("ssm", "conv")}
    for role, count in (("decode", len(linear)), ("prefill", 0)):
        g = graphs[role]
        nodes = onnx.load(str(b / g["file"]), load_external_data=False).graph.node
        ops = [n.op_type for n in nodes]
        assert [ops.count(op) for op in fused] == [count] * 2, role
        assert not {"CausalConvWithState", "GatedRMSNorm"} & set(ops)
        in_place = {o["bind"]: o["name"] for o in g["outputs"] if o["bind"].startswith("alias:")}
        assert states & set(in_place) == (states if count else set()), role
        for bind in states & set(in_place):
            assert_in_place_is_safe(nodes, bind[6:], in_place[bind])
    ops = [n.op_type for n in onnx.load(str(b / graphs["decode"]["file"]),
                                        load_external_data=False).graph.node]
    assert not {"Softplus", "Exp", "Expand", "Where"} & set(ops)
    # 620 nodes before (tiny: 6 linear + 2 full layers + the head)
    assert len([op for op in ops if op != "Constant"]) < 300


def assert_in_place_is_safe(nodes, state: str, output: str) -> None:
    """A state input may share its buffer with an output only if every node reading the old
    state runs before the node writing the new one, whatever order onnxruntime picks: each
    reader is the writer or one of its ancestors (the writer waits for its inputs)."""
    producer = {o: n for n in nodes for o in n.output}
    writer = producer[output]
    ancestors, todo = set(), [writer]
    while todo:
        for i in todo.pop().input:
            if i in producer and id(producer[i]) not in ancestors:
                ancestors.add(id(producer[i]))
                todo.append(producer[i])
    readers = [n for n in nodes if state in n.input]
    assert readers, state
    for n in readers:
        assert n is writer or id(n) in ancestors, (state, n.name, "may run after", writer.name)


def test_in_place_safety_check_catches_a_late_reader():
    """The check above fails where a node outside the writer's inputs reads the old state."""
    from onnx import helper

    ok = [helper.make_node("Concat", ["past", "x"], ["win"], axis=1),
          helper.make_node("Slice", ["win", "s", "e", "a"], ["present"])]
    assert_in_place_is_safe(ok, "past", "present")
    late = [*ok, helper.make_node("Add", ["past", "x"], ["other"])]
    with pytest.raises(AssertionError, match="may run after"):
        assert_in_place_is_safe(late, "past", "present")


def test_fused_gated_delta_net_step_equals_the_written_out_one(ckpt, hf_model):
    """The cpu decode form's wiring (q|k|v split, l2 norm as an RMSNorm, q's scale moved into the
    op, interleaved key heads) in eager torch, with the ops' math as onnxruntime documents it,
    against the HTP form: the same output, fifo and state."""
    import torch

    from hexforge.families.form import CPU
    from hexforge.families.qwen3_5 import Args, GatedDeltaNet

    args = Args.from_config(json.loads((ckpt("qwen3_5") / "config.json").read_text()))
    hf_lin = hf_model("qwen3_5").model.layers[0].linear_attn
    plain, fused = GatedDeltaNet(hf_lin, args, 1), GatedDeltaNet(hf_lin, args, 1, CPU)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, args.hidden_size, generator=g)
    fifo = torch.randn(1, args.linear_conv_kernel_dim - 1, args.conv_dim, generator=g)
    S = torch.randn(1, args.linear_num_value_heads, args.linear_key_head_dim,
                    args.linear_value_head_dim, generator=g) * 0.1
    with torch.no_grad():
        want, got = plain(x, fifo, S), fused(x, fifo, S)
    for w, o in zip(want, got, strict=True):
        assert torch.allclose(w, o, atol=1e-5, rtol=1e-4), (w - o).abs().max()


def test_tail_selector_picks_the_last_valid_rows():
    """Regression: a padded last chunk must leave the fifo holding real inputs, not pad rows."""
    ext = np.arange(3 + 8, dtype=np.float32)[None, :, None]  # [fifo 0..2 | step rows 3..10]
    assert (tail_selector(3, 8, 8) @ ext).ravel().tolist() == [8, 9, 10]
    assert (tail_selector(3, 8, 2) @ ext).ravel().tolist() == [2, 3, 4]  # 1 old row, 2 new


# fp16 and the weight-only w8a16; the QDQ recipes (16-bit fixed-point activations, the recurrent
# state included) are tests/test_htp.py's, on the tiny llama (133 s of the suite here)
@pytest.mark.parametrize("quant", ["fp16", "w8-fp16"])
def test_htp_build_meets_its_gate_with_ar_n_prefill_on_the_npu(htp_bundle, quant):
    """Prefill AR-N (the matmul-only chunked delta rule) and decode both compile with CPU fallback
    disabled and keep the gate."""
    from tests.test_htp import QUANT_THRESHOLDS, report

    b = htp_bundle("qwen3_5", quant)
    rep = report(b)["v81"]
    assert rep["passed"] and rep["teacher_forced"]["cos_min"] >= QUANT_THRESHOLDS[quant]
    m = json.loads((b / "manifest.json").read_text())
    assert {g["role"] for g in m["targets"]["v81"]["graphs"]} >= {"prefill", "decode"}
    model = hexforge.load(b, backend="qnn-sim")
    r = model.generate(prompt_ids(20), max_new_tokens=8, ignore_eos=True)
    assert len(r.token_ids) == 8


def test_fold_initializer_identities_regression(tmp_path):
    """Regression (Qwen3.5 w8a16 failed to compile): the exporter shares equal per-layer constants
    through Identity nodes; a quantized weight DQ -> Identity is not claimed by the QNN EP."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from hexforge.forge.export.onnxexport import fold_initializer_identities

    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["w2"]), helper.make_node("MatMul", ["x", "w"], ["y"]),
         helper.make_node("MatMul", ["y", "w2"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])], [w])
    p = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g), str(p))
    assert fold_initializer_identities(p) == 1
    m = onnx.load(str(p))
    assert [n.op_type for n in m.graph.node] == ["MatMul", "MatMul"]
    assert list(m.graph.node[1].input) == ["y", "w"]
