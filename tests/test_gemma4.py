"""Gemma-4 text (tiny random checkpoint: 10 layers, sliding window 8 < prompts, full layers with
a wider head and proportional rope, the last 4 layers KV-shared, PLE, double-wide MLP, softcap)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import hexforge
from hexforge.bundle.errors import RequestError
from tests.conftest import N, prompt_ids

W = 8  # the tiny config's sliding window
LENGTHS = [1, N + 1, W + N + 3, 3 * N + 5]


@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_equals_hf(bundle, hf_greedy, length):
    ids = prompt_ids(length)
    got = hexforge.load(bundle("gemma4")).generate(ids, max_new_tokens=64, ignore_eos=True)
    assert got.token_ids == hf_greedy("gemma4", ids, 64)


def test_manifest_state_has_shared_kv_and_a_ring_buffer(bundle):
    m = json.loads((bundle("gemma4") / "manifest.json").read_text())
    state = {s["name"]: s for s in m["state"]}
    assert state["L6.k"]["kind"] == "kv_shared" and state["L6.k"]["source"] == "L5.k"
    assert state["L9.v"]["source"] == "L4.v"
    assert state["L0.k"]["kind"] == "kv_sliding" and state["L0.k"]["shape"][1] == W
    assert state["L4.k"]["kind"] == "kv_full" and state["L4.k"]["shape"][2] == 32  # wider head
    groups = {g["name"]: g for g in m["mask_groups"]}
    assert groups["sliding"]["window"] == W and groups["full"]["capacity"] == m["context"]
    assert {e["name"] for e in m["host"]["extra_embeds"]} == {"ple"}


def test_three_shards_across_the_kv_sharing_boundary_equal_one(bundle, hf_greedy):
    three = bundle("gemma4", max_shard_bytes=900_000)
    m = json.loads((three / "manifest.json").read_text())
    shards = [s["layers"] for s in m["targets"]["cpu"]["plan"]["shards"]]
    assert shards == [[0, 4], [4, 7], [7, 10]]
    last = next(g for g in m["targets"]["cpu"]["graphs"] if g["name"] == "s2.decode")
    binds = {i["bind"] for i in last["inputs"]}
    # the donor lives in shard 1, which wrote the step's rows into the cache in place: L9 reads
    # them back from it (no new: rows) and writes them again through its own alias output
    assert "state:L4.k" in binds and "new:L4.k" not in binds
    assert {"alias:past.L4.k", "alias:past.L4.v"} <= {o["bind"] for o in last["outputs"]}
    ids = prompt_ids(W + N + 3)
    a = hexforge.load(bundle("gemma4")).generate(ids, max_new_tokens=64, ignore_eos=True)
    b = hexforge.load(three).generate(ids, max_new_tokens=64, ignore_eos=True)
    assert a.token_ids == b.token_ids == hf_greedy("gemma4", ids, 64)


def test_gemma4_cpu_step_reads_only_the_cache_rows_held(bundle):
    """Regression: the cpu step attended over every cache row and masked the unwritten
    ones, so its cost followed --context (10-layer E2B cut: 35 vs 41-49 tok/s at 4096 vs 256).
    Now the rings are cut to the rows held and the full caches are read by GroupQueryAttention up
    to the rows held: NaN past them must not reach any output (a full cache's present is the
    cache itself: its rows held and the one written must be clean)."""
    import onnxruntime as ort

    path = bundle("gemma4")
    m = json.loads((path / "manifest.json").read_text())
    graph = next(g for g in m["targets"]["cpu"]["graphs"] if g["role"] == "decode")
    binds = {i["bind"] for i in graph["inputs"]}
    assert {"kv_seqlens:full", "kv_total:full", "mask:sliding"} <= binds
    assert "mask:full" not in binds  # the full caches take no mask: the op reads the rows held
    held = W - 3  # positions 0..4 held, the step writes 5: no ring has wrapped
    rng = np.random.default_rng(0)
    feeds = {}
    for i in graph["inputs"]:
        shape, bind = i["shape"], i["bind"]
        if bind.startswith("kv_total"):
            feeds[i["name"]] = np.array(held + 1, np.int32)
        elif bind.startswith("kv_seqlens"):
            feeds[i["name"]] = np.array([held], np.int32)
        elif bind.startswith("mask:"):  # [1, 1, 1, cap + 1]: the held rows and the new one visible
            mask = np.full(shape, -1e9, np.float32)
            mask[..., :held] = mask[..., -1] = 0
            feeds[i["name"]] = mask
        else:
            feeds[i["name"]] = rng.standard_normal(shape).astype(np.float32)
    sess = ort.InferenceSession(str(path / graph["file"]), providers=["CPUExecutionProvider"])
    caches = [i["name"] for i in graph["inputs"] if i["bind"].startswith("state:")]
    presents = [k for k, o in enumerate(graph["outputs"]) if o["bind"].startswith("alias:")]
    assert caches and presents
    outs = {}
    for fill in (0.0, np.nan):
        for name in caches:
            feeds[name][:, :, held:] = fill
        outs[fill] = sess.run(None, feeds)
    for k, (clean, poisoned) in enumerate(zip(outs[0.0], outs[np.nan], strict=True)):
        if k in presents:  # [1, KVH, C, D]: rows 0 .. held written, the rest as they came
            clean, poisoned = clean[:, :, :held + 1], poisoned[:, :, :held + 1]
        assert np.isfinite(poisoned).all()
        np.testing.assert_array_equal(clean, poisoned)


def test_both_ops_writing_one_full_cache_write_it_in_place(bundle):
    """Regression: a full cache that two ops of one graph write (the layer that owns
    it and a layer sharing it) is two outputs bound alias:<cache>. Binding only one of them left
    the other to onnxruntime: its op then copies the whole cache (all --context rows) into a
    present of its own every step, and the cache is written by the copy, not in place."""
    from hexforge.runtime.bound import BoundSession

    eng = hexforge.load(bundle("gemma4")).engine
    graph = eng.plan.graphs["decode"][0]
    aliases = [(k, o.bind[6:]) for k, o in enumerate(graph.outputs) if o.bind.startswith("alias:")]
    assert {"past.L4.k", "past.L4.v"} <= {name for _, name in aliases}
    assert len(aliases) > len({name for _, name in aliases})  # L4's cache has two writers
    sess = eng.sessions[graph.name]
    assert isinstance(sess, BoundSession)
    seen = {}

    def spy(output_names, feeds, run_options=None):
        seen["feeds"], seen["outs"] = feeds, BoundSession.run(sess, output_names, feeds,
                                                               run_options)
        return seen["outs"]

    sess.run = spy
    eng.prefill(prompt_ids(5))
    for token in (7, 8):
        eng.decode(token)
        for k, name in aliases:
            assert np.shares_memory(seen["outs"][k], seen["feeds"][name]), graph.outputs[k].name


def test_chat_template_renders_like_transformers(bundle, ckpt):
    from transformers import AutoTokenizer

    model = hexforge.load(bundle("gemma4"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = AutoTokenizer.from_pretrained(ckpt("gemma4")).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert model.apply_chat_template(messages) == want
    r = model.chat(messages, max_new_tokens=4, ignore_eos=True)
    assert r.prompt_tokens == len(model.tokenizer.encode(want, add_special_tokens=False))
    cli = subprocess.run([sys.executable, "-m", "hexforge", "run", str(bundle("gemma4")), "Hi!",
                          "--chat", "-n", "4", "--json"], capture_output=True, text=True)
    user_only = model.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["prompt_tokens"] == len(
        model.tokenizer.encode(user_only, add_special_tokens=False))


def test_chat_template_runs_in_a_sandbox():
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from hexforge.runtime.text import ChatTemplate

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with TemporaryDirectory() as d:
        Path(d, "chat_template.jinja").write_text(evil)
        tpl = ChatTemplate.load(Path(d))
        with pytest.raises(RequestError, match="sandbox"):
            tpl.render([{"role": "user", "content": "x"}])
        with pytest.raises(RequestError, match="messages"):
            tpl.render([{"content": "no role"}])


def test_tiny_fixture_is_well_conditioned(hf_model):
    """HF's own fp16 forward tracks its fp32 forward on the tiny checkpoint (tiny.TEMPER), so the
    HTP precision gates below measure our graphs, not the random model's chaos."""
    import copy

    model = hf_model("gemma4")  # shared by the session: the fp16 run uses a copy
    x = torch.tensor([prompt_ids(64)])
    with torch.no_grad():
        ref = model(x).logits[0].double()
        half = copy.deepcopy(model).to(torch.float16)(x).logits[0].double()
    cos = torch.nn.functional.cosine_similarity(ref, half, dim=-1)
    assert cos.min() > 0.99996
    # weight error (tiny.DECODER_TEMPER): HF fp32 with int8 per-channel RTN weights (lm_head untied,
    # int8 too) tracks itself, so the w8a16 gate (0.999) is reachable; 0.99994 measured
    w8 = copy.deepcopy(model)
    w8.lm_head.weight = torch.nn.Parameter(w8.lm_head.weight.detach().clone())
    with torch.no_grad():
        for mod in w8.modules():
            if isinstance(mod, torch.nn.Linear):
                s = mod.weight.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
                mod.weight.copy_((mod.weight / s).round().clamp(-127, 127) * s)
        quant = w8(x).logits[0].double()
    assert torch.nn.functional.cosine_similarity(ref, quant, dim=-1).min() > 0.9995


@pytest.mark.parametrize("quant", ["fp16", "w8-fp16"])  # the QDQ recipes: tests/test_htp.py
def test_htp_build_meets_the_gate_and_runs_on_the_simulator(htp_bundle, quant):
    from tests.test_htp import QUANT_THRESHOLDS, report

    b = htp_bundle("gemma4", quant)
    rep = report(b)["v81"]
    assert rep["passed"] and rep["teacher_forced"]["cos_min"] >= QUANT_THRESHOLDS[quant]
    model = hexforge.load(b, backend="qnn-sim")
    r = model.generate(prompt_ids(W + 12), max_new_tokens=8, ignore_eos=True)
    assert len(r.token_ids) == 8


def test_htp_activation_matmul_input1_keeps_16_bits(tmp_path):
    """The HTP held input 1 of a uint16 x uint16 activation MatMul (QK^T keys, probs.V values) at 8
    bits: HTP vs the same QDQ graph on the CPU EP cos 0.99997, which took tiny Gemma-4 w8a16 on
    v81 from 0.989 (CPU-QDQ) to 0.878. qdq.int16_matmul_rhs makes input 1 int16: exact."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from hexforge.forge.quantize.qdq import int16_matmul_rhs
    from hexforge.runtime import qnn
    rng = np.random.default_rng(0)
    a = rng.normal(size=(1, 1, 8, 64)).astype(np.float32)
    b = rng.normal(size=(1, 1, 64, 24)).astype(np.float32)
    inits, nodes = [], []

    def qdq(x: str, absmax: float) -> str:
        inits.extend([numpy_helper.from_array(np.array(2 * absmax / 65535, np.float32), f"{x}_s"),
                      numpy_helper.from_array(np.array(32768, np.uint16), f"{x}_z")])
        nodes.extend([helper.make_node("QuantizeLinear", [x, f"{x}_s", f"{x}_z"], [f"{x}_q"]),
                      helper.make_node("DequantizeLinear", [f"{x}_q", f"{x}_s", f"{x}_z"], [f"{x}_d"])])
        return f"{x}_d"

    nodes.append(helper.make_node("MatMul", [qdq("a", 5.0), qdq("b", 5.0)], ["y"]))
    nodes.append(helper.make_node("Identity", [qdq("y", 40.0)], ["out"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, a.shape),
                                       helper.make_tensor_value_info("b", TensorProto.FLOAT, b.shape)],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)

    def htp_vs_cpu(model) -> float:
        path = tmp_path / "m.onnx"
        onnx.save(model, str(path))
        feeds = {"a": a, "b": b}
        cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        so = qnn.session_options(qnn.provider_options(81, 87, False), {})
        with qnn.native_stdout_to_stderr():
            htp = ort.InferenceSession(str(path), so).run(None, feeds)[0]
        x, y = cpu.ravel().astype(np.float64), htp.ravel().astype(np.float64)
        return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))

    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    assert htp_vs_cpu(m) < 0.99999  # the HTP's 8-bit input 1 (if this passes, the EP was fixed)
    assert int16_matmul_rhs(m) == 1
    assert htp_vs_cpu(m) > 0.9999999
