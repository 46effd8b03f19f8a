"""The KV cache's I/O rewrites (forge/compile/kvcast.py) on a tiny graph, run by onnxruntime's CPU EP:
what the rewritten graph computes with is the cache the float graph saw, to the format's step."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hexforge.bundle.manifest import GraphSpec, StateSpec, TensorSpec
from hexforge.forge.compile.kvcast import V8_STEPS, V8_ZERO, fp16_kv_graph, u8_value_state, u8_values_graph

BINDS = {"state:L0.k", "new:L0.k", "state:L0.v", "new:L0.v"}


def _graph(path, kv: str = "k"):
    """score = ReduceSum(past * q) (a stand-in for attention over the cache); new = q * 3."""
    import onnx
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    past, new = f"past.L0.{kv}", f"new.L0.{kv}"
    nodes = [helper.make_node("Mul", [past, "q"], ["prod"]),
             helper.make_node("ReduceSum", ["prod"], ["score"], keepdims=0),
             helper.make_node("Mul", ["q", "three"], [new])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(past, f, [1, 2, 8, 4]),
                                       helper.make_tensor_value_info("q", f, [1, 2, 8, 4])],
                          [helper.make_tensor_value_info("score", f, []),
                           helper.make_tensor_value_info(new, f, [1, 2, 8, 4])],
                          [helper.make_tensor("three", f, [], [3.0])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    t = dict(shape=[1, 2, 8, 4], dtype="float32")
    return GraphSpec(name="s0.decode", role="decode", file=path.name, seq_len=1,
                     inputs=[TensorSpec(name=past, bind=f"state:L0.{kv}", **t),
                             TensorSpec(name="q", bind="input:q", **t)],
                     outputs=[TensorSpec(name="score", shape=[], dtype="float32", bind="output:s"),
                              TensorSpec(name=new, bind=f"state:L0.{kv}", **t)])  # as exported


def _run(path, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_fp16_cache_io_computes_what_the_float_graph_did(tmp_path):
    rng = np.random.default_rng(0)
    past = rng.uniform(-2, 2, (1, 2, 8, 4)).astype(np.float32)
    q = rng.uniform(-0.5, 0.5, (1, 2, 8, 4)).astype(np.float32)
    path = tmp_path / "g.onnx"
    spec = _graph(path)
    want_score, want_new = _run(path, {"past.L0.k": past, "q": q})
    out, step = fp16_kv_graph(path, spec, BINDS), 2e-3
    assert [t.dtype for t in out.inputs] == ["float16", "float32"]
    assert [t.dtype for t in out.outputs] == ["float32", "float16"]
    score, new = _run(path, {"past.L0.k": past.astype(np.float16), "q": q})
    assert new.dtype == np.float16
    assert np.abs(new.astype(np.float32) - want_new).max() <= step * 2  # one rounding
    assert abs(float(score) - float(want_score)) <= step * np.abs(q).sum()
    assert fp16_kv_graph(path, out, BINDS) == out  # idempotent: not float32 now


def test_u8_value_rows_carry_a_scale_each_and_compute_what_the_float_graph_did(tmp_path):
    """Rows of very different size (a first token's values dwarf the rest): each keeps 8 bits
    of its own peak, which one scale a cache would not."""
    rng = np.random.default_rng(1)
    rows = rng.uniform(-1, 1, (1, 2, 8, 4)).astype(np.float32)
    rows *= np.array([40.0, 1, 0.02, 1, 1, 0.5, 3, 1], np.float32)[None, None, :, None]
    q = rng.uniform(-0.5, 0.5, (1, 2, 8, 4)).astype(np.float32)
    path = tmp_path / "g.onnx"
    spec = _graph(path, "v")
    _, want_new = _run(path, {"past.L0.v": rows, "q": q})
    out = u8_values_graph(path, spec)
    assert [(t.name, t.bind, t.dtype, t.shape) for t in out.inputs] == [
        ("past.L0.v", "state:L0.v", "uint8", [1, 2, 8, 4]), ("q", "input:q", "float32", [1, 2, 8, 4]),
        ("past.L0.vs", "state:L0.vs", "float16", [1, 2, 8, 1])]
    assert [(t.name, t.dtype) for t in out.outputs] == [
        ("score", "float32"), ("new.L0.v", "uint8"), ("new.L0.vs", "float16")]
    # the buffers the runtime keeps: what a graph wrote for these rows
    scale = (np.abs(rows).max(-1, keepdims=True) / V8_STEPS).astype(np.float16)
    held = np.clip(np.round(rows / scale.astype(np.float32)) + V8_ZERO, 0, 255).astype(np.uint8)
    score, new, new_scale = _run(path, {"past.L0.v": held, "past.L0.vs": scale, "q": q})
    assert new.dtype == np.uint8 and new_scale.dtype == np.float16
    back = (new.astype(np.float32) - V8_ZERO) * new_scale.astype(np.float32)
    step = np.abs(want_new).max(-1, keepdims=True) / V8_STEPS
    assert (np.abs(back - want_new) <= step * 0.51 + 1e-6).all()  # half a step of each row's own
    got_rows = (held.astype(np.float32) - V8_ZERO) * scale.astype(np.float32)
    assert np.abs(got_rows - rows).max(-1).max() <= np.abs(rows).max() / V8_STEPS
    small = np.abs(got_rows - rows)[0, :, 2]  # the 0.02 row: its own steps, not the 40 row's
    assert small.max() <= 0.02 / V8_STEPS
    assert abs(float(score) - float(np.sum(got_rows * q))) < 1e-3
    assert u8_values_graph(path, out) == out  # idempotent: not float32 now


def test_u8_value_state_adds_a_row_scale_cache_per_value_cache_with_its_group_and_donor():
    state = [StateSpec(name="L0.k", layer=0, kind="kv_full", shape=[2, 8, 4], group="full"),
             StateSpec(name="L0.v", layer=0, kind="kv_full", shape=[2, 8, 4], group="full"),
             StateSpec(name="L1.v", layer=1, kind="kv_sliding", shape=[2, 6, 4], group="win"),
             StateSpec(name="L2.v", layer=2, kind="kv_shared", source="L0.v")]
    out = {s.name: s for s in u8_value_state(state)}
    assert set(out) == {"L0.k", "L0.v", "L1.v", "L2.v", "L0.vs", "L1.vs", "L2.vs"}
    assert (out["L0.vs"].kind, out["L0.vs"].shape, out["L0.vs"].group) == ("kv_full", [2, 8, 1], "full")
    assert (out["L1.vs"].kind, out["L1.vs"].shape, out["L1.vs"].group) == ("kv_sliding", [2, 6, 1], "win")
    assert (out["L2.vs"].kind, out["L2.vs"].source) == ("kv_shared", "L0.vs")
    assert u8_value_state(list(out.values())) == list(out.values())  # once


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_u8_value_cache_on_the_simulator_follows_hf_as_closely_as_the_graphs_do(htp_bundle, ckpt,
                                                                                family):
    """--kv-values u8 end to end (plumbing, tiny random models): the bundle's states, the
    graphs' I/O, and the oracle's numbers on the simulator without its gate (a random model's
    near-ties flip top-1; KL does not). gemma4: sliding and full groups, KV-shared layers.
    Regression: the graphs' value rows out are bound "state:", which a rewrite that looked for
    "new:" missed (prefill cos 0.43, KL 1e-2)."""
    from hexforge.bundle.manifest import load_manifest
    from hexforge.families import load_family
    from hexforge.forge.oracle.verify import Judge, verify_bundle
    from hexforge.forge.source.checkpoint import read_checkpoint

    bundle = htp_bundle(family, "fp16", verify=False, device_only=True, kv_values="u8")
    m = load_manifest(bundle)
    states = {s.name: s for s in m.state}
    values = [s for s in states.values() if s.name.endswith(".v")]
    assert values and all(states[s.name + "s"].kind == s.kind for s in values)
    for g in m.targets["v81"].graphs:
        if g.role not in ("prefill", "decode"):
            continue
        io = {t.name: t for t in [*g.inputs, *g.outputs]}
        assert {t.dtype for n, t in io.items() if n.endswith(".v")} == {"uint8"}
        assert {t.dtype for n, t in io.items() if n.endswith(".vs")} == {"float16"}
    c = read_checkpoint(ckpt(family))
    fam = load_family(c.model_type).FAMILY
    r = verify_bundle(bundle, Judge.of(bundle, m, fam, fam.load_hf(c.dir), 8))["v81"]
    assert min(g["cos_min"] for g in r["graphs"].values()) > 0.9999, r["graphs"]
    assert r["text"]["kl_mean"] < 1e-5 and r["teacher_forced"]["kl_mean"] < 1e-5


def test_u8_values_need_an_htp_target_and_fp16(ckpt, tmp_path):
    for target, quant in (("cpu", "fp16"), ("v81", "w8-fp16"), ("v81", "w8-u16")):
        r = subprocess.run([sys.executable, "-m", "hexforge", "build", str(ckpt("llama")), "-o",
                            str(tmp_path / "out"), "--target", target, "--quant", quant,
                            "--kv-values", "u8"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "--kv-values u8 needs an HTP --target and --quant fp16" in r.stderr
        assert r.stderr.count("\n") == 1 and not any(tmp_path.iterdir())
