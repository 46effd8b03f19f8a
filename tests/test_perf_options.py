"""The cpu backend's speed options are correct (speed itself is measured in bench/, never here):
weight-only int8 / int4 cpu graphs (MatMulNBits) pass their teacher-forced gates, and the IO-binding
session path gives exactly the plain ``session.run`` results."""

from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.mark.parametrize("weights", ["int8", "int8-b128", "int4", "int4-b128"])
def test_cpu_weight_only_builds_pass_their_teacher_forced_gate(bundle, weights):
    import onnx

    from hexforge.forge.quantize.nbits import CPU_WEIGHTS, cpu_head_format

    b = bundle("qwen3", cpu_weights=weights)
    report = json.loads((b / "report.json").read_text())["cpu"]
    assert report["passed"], report["failures"]
    assert report["quant"] == weights
    floor = {"int8": 0.9995, "int8-b128": 0.999, "int4": 0.97, "int4-b128": 0.96}[weights]
    assert report["teacher_forced"]["cos_min"] > floor
    manifest = json.loads((b / "manifest.json").read_text())
    assert manifest["targets"]["cpu"]["quant"] == weights
    # every projection became MatMulNBits; prefill, decode (which runs the head) and the head
    # share one weight file, the head's quantized weight stored once
    where = {}
    for name in ("s0.prefill", "s0.decode", "head"):
        m = onnx.load(str(b / "cpu" / f"{name}.onnx"), load_external_data=False)
        ops = [n.op_type for n in m.graph.node]
        assert "MatMulNBits" in ops
        weights_const = {t.name for t in m.graph.initializer}
        assert not [n for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in weights_const]
        inits = {t.name: {e.key: e.value for e in t.external_data} for t in m.graph.initializer}
        where[name] = [inits[n.input[1]] for n in m.graph.node if n.op_type == "MatMulNBits"]
        for n in m.graph.node:  # the recipe's bits and block (K=64 and 128 here: one block
            if n.op_type == "MatMulNBits":  # of 128 spans a whole column); the head's: its own
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                fmt = cpu_head_format(*CPU_WEIGHTS[weights]) \
                    if attrs["N"] == manifest["vocab_size"] else CPU_WEIGHTS[weights]
                assert (attrs["bits"], attrs["block_size"]) == fmt, n.name
    assert sorted(p.name for p in (b / "cpu").glob("*.weights")) == ["s0.weights"]
    assert where["head"][0] in where["s0.decode"] and where["head"][0]["location"] == "s0.weights"
    # the embedding is quantized too (the gates above held with it): in the head's bits and
    # blocks where they divide its width (64 here: not int8-b128's 128, which takes int8 in
    # blocks of 32; that head's blocks differ, so nothing is shared). int4 weights keep an int8
    # head in blocks of 32 (cpu_head_format), and so an int8 embedding, shared with it
    from hexforge.bundle.hostfile import check_safetensors_header, load_host_tensors
    from hexforge.bundle.qtables import Int4Table, Int8Table
    from hexforge.commands.inspect import inspect_bundle

    header = check_safetensors_header(b / "host.safetensors")
    embedding = inspect_bundle(b)["embedding"]
    if weights == "int8-b128":
        assert header["embed_tokens"]["dtype"] == "U8" and "embed_tokens.int8_scales" in header
        assert embedding == "int8" and manifest["host"]["embed"]["shared"] is None
        return
    bits = 8
    assert embedding == f"int{bits}, blocks of 32: the tied head's rows in cpu/s0.weights"
    # tied: the quantized table is the head's MatMulNBits weight (the same bytes by the same
    # quantizer), so host.safetensors does not hold it and the runtime reads the head's ranges
    assert not {"embed_tokens", "embed_tokens.int4_scales", "embed_tokens.int8_scales"} & set(header)
    shared = manifest["host"]["embed"]["shared"]
    assert shared["file"] == "cpu/s0.weights" and shared["shape"] == [manifest["vocab_size"], 64]
    assert shared["bits"] == bits
    head = onnx.load(str(b / "cpu" / "head.onnx"), load_external_data=False)
    node = next(n for n in head.graph.node if n.op_type == "MatMulNBits")
    for name, part in zip(node.input[1:3], ("rows", "scales"), strict=True):
        info = {e.key: int(e.value) for e in next(t for t in head.graph.initializer
                                                   if t.name == name).external_data
                if e.key in ("offset", "length")}
        assert [info["offset"], info["length"]] == shared[part]
    import hexforge

    table = hexforge.load(b).engine.host.embed_table
    assert isinstance(table, {4: Int4Table, 8: Int8Table}[bits])
    assert table.shape == (manifest["vocab_size"], 64)
    assert load_host_tensors(b / "host.safetensors").keys().isdisjoint({"embed_tokens"})


def test_unknown_cpu_weights_fail_before_any_work(ckpt, tmp_path):
    from hexforge.bundle.errors import BuildError
    from hexforge.forge.pipeline import BuildOptions, build

    with pytest.raises(BuildError, match="--cpu-weights"):
        build(ckpt("qwen3"), tmp_path / "b", BuildOptions(cpu_weights="int3"), log=lambda m: None)


class _PlainRun:
    """The reference for IO binding: onnxruntime's plain ``InferenceSession.run`` on a bound
    session's own ORT session, each in-place cache output (``alias:<input>``) copied back into its
    input as the graph's contract says."""

    writes_in_place = True

    def __init__(self, bound, graph):
        self.sess = bound.sess
        self.aliases = [(k, o.bind[6:]) for k, o in enumerate(graph.outputs)
                        if o.bind.startswith("alias:")]

    def run(self, output_names, feeds, run_options=None):
        values = self.sess.run(None, feeds)
        for k, name in self.aliases:
            feeds[name][...] = values[k]
        return values


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma4"])
def test_io_binding_matches_plain_session_run(bundle, family):
    """Same logits, bit for bit, through prefill chunks (incl. a padded last one) and decode.
    gemma4: a full cache written in place by two ops of one graph (a donor and its sharer: two
    outputs bound to one cache), beside rings the engine writes."""
    import hexforge
    from hexforge.runtime.bound import BoundSession

    b = bundle(family)
    plain = hexforge.load(b).engine
    plain.sessions = {n: _PlainRun(s, plain.target.graph(n)) for n, s in plain.sessions.items()}
    bound = hexforge.load(b).engine
    assert all(isinstance(s, BoundSession) for s in bound.sessions.values())
    prompt = [int(x) for x in np.random.default_rng(1).integers(3, plain.vocab_size, 21)]
    for _ in range(2):  # twice: the second run reuses every binding from the first
        got = [e.prefill(prompt) for e in (plain, bound)]
        np.testing.assert_array_equal(got[0], got[1])
        kept = []
        for _ in range(12):
            tok = int(np.argmax(got[0]))
            got = [e.decode(tok) for e in (plain, bound)]
            np.testing.assert_array_equal(got[0], got[1])
            kept.append(got[1])
        # returned logits are the caller's: a later step must not overwrite an earlier one
        assert not any(np.shares_memory(kept[0], k) for k in kept[1:])
        for e in (plain, bound):
            e.reset()
    # generate_step hands out the graph's own buffer (no 600 KB copy a token at a real vocab),
    # valid until the next step: the same tokens and logits as the plain run's
    steps = [e.generate_step(prompt, lambda x: int(np.argmax(x)), 8) for e in (plain, bound)]
    views = []
    for (tok_p, logits_p), (tok_b, logits_b) in zip(*steps, strict=True):
        assert tok_p == tok_b
        np.testing.assert_array_equal(logits_p, logits_b)
        views.append(logits_b)
    assert np.shares_memory(views[1], views[-1])


def test_bound_session_rebinds_what_changed_between_calls(tmp_path):
    """A call whose feeds are the very arrays of the last skips binding (one tuple compare): an
    array changed in place is seen, a new array is bound, and a strided view (bound as a copy,
    never kept) is bound again every call, though it is the same object."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from hexforge.bundle.manifest import GraphSpec, TensorSpec
    from hexforge.runtime.bound import BoundSession

    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "xyz"]
    g = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "g", io[:2], io[2:])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    specs = [TensorSpec(name=n, shape=[2, 3], dtype="float32", bind=b)
             for n, b in (("x", "hidden"), ("y", "embed"), ("z", "logits"))]
    spec = GraphSpec(name="g", role="decode", file="g.onnx", seq_len=1, inputs=specs[:2],
                     outputs=specs[2:])
    sess = BoundSession(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), spec)
    x, y = np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32)
    feeds = {"x": x, "y": y}
    np.testing.assert_array_equal(sess.run(None, feeds)[0], x)
    y += 2  # in place: the binding is kept and sees it
    np.testing.assert_array_equal(sess.run(None, feeds)[0], x + 2)
    feeds["y"] = np.full((2, 3), 5, np.float32)  # a new array
    np.testing.assert_array_equal(sess.run(None, feeds)[0], x + 5)
    base = np.arange(12, dtype=np.float32).reshape(2, 6)
    feeds = {"x": x, "y": base[:, ::2]}
    for _ in range(3):  # the same strided view each call, its base changed in place between
        np.testing.assert_array_equal(sess.run(None, feeds)[0], base[:, ::2] + x)
        base += 1


@pytest.mark.parametrize("family", ["qwen3", "gemma4", "qwen3_5"])
def test_decode_fast_path_gives_the_general_paths_logits_bit_for_bit(bundle, family, monkeypatch):
    """A decode step writes its host inputs into the last step's arrays (StepInputs._decode);
    forced through the general path (StepInputs._general) every step, the logits are the same
    bits.
    gemma4: per-layer host embeddings, two ropes, sliding-window masks; qwen3_5: recurrent state.
    Two prompts, the second after a reset: the kept dict outlives reset()."""
    import hexforge
    from hexforge.runtime.stepinputs import StepInputs

    b = bundle(family)
    fast, general = hexforge.load(b).engine, hexforge.load(b).engine
    general.inputs._decode = lambda token, pos: None  # every step through _general
    taken = []
    real = StepInputs._decode
    monkeypatch.setattr(StepInputs, "_decode",
                        lambda self, token, pos: taken.append(real(self, token, pos)) or taken[-1])
    rng = np.random.default_rng(2)
    for n in (21, 5):
        prompt = [int(x) for x in rng.integers(3, fast.vocab_size, n)]
        got = [e.prefill(prompt) for e in (fast, general)]
        for _ in range(40):  # past a sliding window of the tiny gemma4
            tok = int(np.argmax(got[0]))
            got = [e.decode(tok) for e in (fast, general)]
            np.testing.assert_array_equal(got[0], got[1])
        for e in (fast, general):
            e.reset()
    assert taken[0] is None and all(t is not None for t in taken[1:40])  # the first builds


@pytest.mark.parametrize("family", ["qwen3", "gemma4", "qwen3_5", "llama-w8a16"])
def test_reset_leaves_the_kv_rows_and_no_step_reads_a_stale_one(bundle, htp_bundle, family):
    """reset() no longer zeroes the KV caches (a pass over all of them every request, and the
    first request's faults on every page): after a long sequence, a short one gives a fresh
    engine's logits bit for bit while the long one's rows are still in the caches. qwen3: the cpu
    step reads the rows held; gemma4: rings, KV sharing, held-row slices; qwen3_5: its recurrent
    states are still zeroed; llama-w8a16 on the HTP simulator: static steps under a mask of
    -100, not -1e9."""
    import hexforge

    if family == "llama-w8a16":
        b, kw = htp_bundle("llama", "w8-fp16"), {"backend": "qnn-sim"}
    else:
        b, kw = bundle(family), {}
    used, fresh = hexforge.load(b, **kw).engine, hexforge.load(b, **kw).engine
    rng = np.random.default_rng(3)
    tok = int(np.argmax(used.prefill([int(x) for x in rng.integers(3, used.vocab_size, 50)])))
    for _ in range(40):
        tok = int(np.argmax(used.decode(tok)))
    used.reset()
    assert all(np.any(buf) for buf, *_ in used.state.kv.values())  # the long sequence's rows
    prompt = [int(x) for x in rng.integers(3, used.vocab_size, 5)]
    got = [e.prefill(prompt) for e in (used, fresh)]
    for _ in range(12):
        np.testing.assert_array_equal(got[0], got[1])
        tok = int(np.argmax(got[0]))
        got = [e.decode(tok) for e in (used, fresh)]
    np.testing.assert_array_equal(got[0], got[1])


def test_op_profile_splits_a_decode_token_by_op_type(bundle, capsys):
    """hexforge bench --op-profile: onnxruntime's per-node profile of the timed decode steps,
    summed by op type. What is asserted is the profile's reading, not a speed: every op type
    ran a whole number of times a token (a window that cut a step, or took the warm-up's, reads
    a fraction), attention once a layer, the head inside the decode graph."""
    from hexforge.bundle.errors import RequestError
    from hexforge.bundle.manifest import load_manifest
    from hexforge.commands.bench import op_profile
    from hexforge.commands.cli import main

    b = bundle("qwen3")
    r = op_profile(b, tokens=6)
    ops = r["ops"]
    # one in-place GroupQueryAttention per layer
    assert ops["GroupQueryAttention"]["count"] == load_manifest(b).num_layers
    assert "MatMul" in ops and ops["MatMul"]["ms"] > 0
    assert all(o["count"] == int(o["count"]) and o["count"] >= 1 for o in ops.values()), ops
    assert r["tokens"] == 6 and r["kernel_ms"] > 0
    assert load_manifest(b).targets["cpu"].decode_runs_head  # one graph a step: the head in it
    with pytest.raises(RequestError, match="context"):
        op_profile(b, tokens=10_000)
    assert main(["bench", str(b), "--op-profile", "-n", "4"]) == 0
    out = capsys.readouterr().out
    assert "GroupQueryAttention" in out and "between kernels" in out


def test_bench_cli_reports_every_number(bundle, capsys):
    from hexforge.commands.cli import main

    b = bundle("qwen3")
    assert main(["bench", str(b), "--prompt-tokens", "12", "-n", "4", "--runs", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("ttft_ms", "prefill_tok_s", "decode_tok_s"):  # measured, so not compared
        assert set(r[key]) >= {"min", "median", "max"} and r[key]["min"] > 0, key
    assert r["peak_rss_mb"] > 0 and r["prompt_tokens"] == 12 and r["runs"] == 2


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_cpu_graphs_update_the_cache_in_place(bundle, family):
    """The cpu decode and prefill graphs attend with onnxruntime's GroupQueryAttention
    over the rows held (a prefill chunk: causally), writing the state buffers themselves (their
    present outputs are bound to them, not copies), with fused norms, the rope inside the op
    where it can take it (from constant tables under 1-D positions), and no mask input."""
    import onnx

    import hexforge

    b = bundle(family)
    model = hexforge.load(b)
    eng = model.engine
    target = eng.target
    caches = {s.name for s in model.manifest.state if s.kind == "kv_full"}
    for shard in target.plan.shards:
        for graph in (target.graph(shard.decode), target.graph(shard.prefill)):
            nodes = onnx.load(str(b / graph.file), load_external_data=False).graph.node
            ops = [n.op_type for n in nodes]
            # the rope inside GroupQueryAttention where its kernel takes the width (R/2 a
            # multiple of 8: qwen3's 16), else RotaryEmbedding nodes (tiny qwen3_5: 8 of 32 dims)
            inside = [any(a.name == "do_rotary" and a.i == 1 for a in n.attribute)
                      for n in nodes if n.op_type == "GroupQueryAttention"]
            fused = family == "qwen3"
            assert all(inside) == fused and any(inside) == fused
            assert ("RotaryEmbedding" in ops) != fused
            # 1-D positions (both here): the rope comes from constant tables, not rope inputs;
            # where the op takes it (qwen3), no per-step Concat pads the step's rows and no
            # position_ids (M-RoPE: the next test)
            assert not [i for i in graph.inputs if i.bind.startswith("rope_")]
            if fused:
                assert "Concat" not in ops
                assert "Cast" not in ops  # the head's .float() of fp32 logits was one: a copy
                assert all(len(n.input) < 10 or not n.input[9]  # position_ids
                           for n in nodes if n.op_type == "GroupQueryAttention")
            aliases = [o for o in graph.outputs if o.bind.startswith("alias:")]
            kv = [o for o in aliases if o.bind.removeprefix("alias:past.") in caches]
            assert ops.count("GroupQueryAttention") == len(kv) // 2 > 0
            # qwen3_5: LinearAttention's ssm state and the conv fifo are written in place too
            assert len(aliases) - len(kv) == 2 * ops.count("LinearAttention")
            # the rows GQA writes are not outputs as well (a Transpose + an engine write per cache)
            assert not [o for o in graph.outputs
                        if o.bind.startswith("state:") and o.bind[6:] in caches]
            assert "Transpose" not in ops or family == "qwen3_5"
            assert "SimplifiedLayerNormalization" in ops
            assert not any(i.bind.startswith("mask:") for i in graph.inputs)
            assert {i.bind for i in graph.inputs} >= {"kv_seqlens:full", "kv_total:full"}
    assert eng.plan.prefill_in_place
    seen = {}

    def observe(graph, feeds, outputs, positions):
        for o in graph.outputs:
            if o.bind.startswith("alias:"):
                seen.setdefault(graph.role, []).append(outputs[o.bind] is feeds[o.bind[6:]])

    prompt = [int(x) for x in np.random.default_rng(2).integers(3, eng.vocab_size, 9)]
    eng.observer = observe
    eng.prefill(prompt)
    eng.decode(5)
    # every present output is its cache input's own array
    assert set(seen) == {"prefill", "decode"} and all(seen["prefill"] + seen["decode"])


@pytest.mark.parametrize("weights", ["fp32", "int4"])
@pytest.mark.parametrize("ram", [10_000, 1 << 40])
def test_fp32_prefill_and_head_sessions_read_the_weight_file_unpacked_on_a_small_machine(
        bundle, weights, ram, monkeypatch):
    """An fp32 prefill session prepacks its weights only when that second packed copy (the
    decode session of the shard holds one) is at most 1/6 of the machine's RAM; a MatMulNBits
    prefill always does (unpacked it loses its int8 kernels). The head, which only prefill runs
    once the last decode graph carries its own, follows the prefill rule (regression: an
    unpacked int4 head nearly tripled the TTFT)."""
    import hexforge
    from hexforge.runtime import backends

    monkeypatch.setattr(backends, "physical_memory_bytes", lambda: ram)
    eng = hexforge.load(bundle("qwen3", cpu_weights=weights)).engine
    assert eng.target.decode_runs_head
    unpacked = weights == "fp32" and ram == 10_000  # the tiny bundle's weights: ~0.3 MB
    for shard in eng.target.plan.shards:
        for name, want in ((shard.prefill, unpacked), (shard.decode, False),
                           (eng.target.plan.head, unpacked)):
            sess = getattr(eng.sessions[name], "sess", eng.sessions[name])
            entry = sess.get_session_options().get_session_config_entry
            try:
                value = entry("session.disable_prepacking")
            except Exception:  # onnxruntime raises for an entry never set
                value = "0"
            assert (value == "1") == want, name


def test_prefill_runs_the_head_on_its_last_chunk_only(bundle):
    """The logits of a prefill chunk before the last are never read, so its head run is
    skipped (it was one head GEMV per 64 prompt tokens); an observer still sees every chunk's."""
    import hexforge

    eng = hexforge.load(bundle("qwen3")).engine
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, eng.vocab_size,
                                                                 2 * eng.prefill_len + 5)]
    calls: list[str] = []
    head = eng.sessions[eng.plan.head.name]
    run = head.run
    head.run = lambda *a, **kw: (calls.append("head"), run(*a, **kw))[1]
    try:
        logits = eng.prefill(prompt)
        assert calls == ["head"]
        eng.reset()
        eng.observer = lambda *a: None
        observed = eng.prefill(prompt)
        assert calls == ["head"] * 4  # 3 chunks
    finally:
        eng.observer = None
        del head.run
    np.testing.assert_array_equal(logits, observed)


@pytest.mark.parametrize("positions", ["1d", "mrope"])
def test_rope_inside_group_query_attention_keeps_mrope_and_partial_rotary_exact(tmp_path,
                                                                               positions):
    """GroupQueryAttention(do_rotary) takes the rope, and Qwen3.5's partial rotary (16 of 64
    dims here: R/2 = 8, which the op takes) stays greedy-exact against HF with no RotaryEmbedding
    node left; the new k rows the op rotates itself are not computed twice.
    - 1-D positions (text-only Qwen3.5): the op reads constant tables at the rows it writes, and
      the graph has no rope inputs and no position_ids;
    - M-RoPE (Qwen3.5 with its vision tower, the hub's layout): the step's own host tables,
      padded to the cache's rows, read at position_ids 0..T-1."""
    import json

    import onnx

    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.source.tiny import TINY_CONFIGS, make_tiny_checkpoint

    if positions == "1d":
        ck = make_tiny_checkpoint("qwen3_5", tmp_path / "ck", head_dim=64)
    else:
        text = TINY_CONFIGS["qwen3_5_vl"]["text_config"]
        rope = dict(text["rope_parameters"], mrope_section=[4, 2, 2])  # sums to R/2 = 8
        ck = make_tiny_checkpoint("qwen3_5_vl", tmp_path / "ck",
                                  text_config=dict(text, head_dim=64, rope_parameters=rope))
    out = build(ck, tmp_path / "b", BuildOptions(context=96, prefill_len=8, verify_tokens=12),
                log=lambda s: None)
    report = json.loads((out / "report.json").read_text())["cpu"]
    assert report["passed"] and report["greedy"]["exact"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["host"]["positions"] == positions
    graphs = {g["file"]: g for g in manifest["targets"]["cpu"]["graphs"]}
    for name in ("s0.prefill", "s0.decode"):
        nodes = onnx.load(str(out / "cpu" / f"{name}.onnx"), load_external_data=False).graph.node
        ops = [n.op_type for n in nodes]
        assert "RotaryEmbedding" not in ops and ops.count("GroupQueryAttention") == 2
        position_ids = {n.input[9] if len(n.input) > 9 else "" for n in nodes
                        if n.op_type == "GroupQueryAttention"}
        rope_inputs = [i for i in graphs[f"cpu/{name}.onnx"]["inputs"]
                       if i["bind"].startswith("rope_")]
        assert (position_ids == {""}) == (not rope_inputs) == (positions == "1d")


def _external_spans(path, op_type: str | None = None) -> set[tuple[str, str, str]]:
    """(file, offset, length) of the external weights a graph reads (only ``op_type``'s)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    used = {x for n in m.graph.node if op_type in (None, n.op_type) for x in n.input}
    return {tuple(e.value for e in t.external_data if e.key in ("location", "offset", "length"))
            for t in m.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL and t.name in used}


def test_regression_int4_quantized_the_chunked_delta_rules_cumsum_triangle(bundle):
    """Qwen3.5's prefill takes the cumsum of its log decays as ``g @ upper`` (a triangle of ones).
    --cpu-weights int4 made that a MatMulNBits too (18 per Qwen3.5-0.8B prefill), which reads the
    decays at int8 (accuracy level 4: 0.14% error). A 0/1 operator stays a MatMul."""
    import onnx

    b = bundle("qwen3_5", cpu_weights="int4")
    report = json.loads((b / "report.json").read_text())["cpu"]
    assert report["passed"], report["failures"]
    m = onnx.load(str(b / "cpu" / "s0.prefill.onnx"), load_external_data=False)
    inits = {t.name for t in m.graph.initializer}
    triangles = [n for n in m.graph.node if any(x in inits and x.endswith(".upper")
                                                for x in n.input)]
    assert triangles and {n.op_type for n in triangles} == {"MatMul"}
    assert not [n for n in m.graph.node if n.op_type == "MatMulNBits"
                and any(x.startswith("shard.") and ".upper" in x for x in n.input)]
    assert "MatMulNBits" in {n.op_type for n in m.graph.node}  # the weights still are


def test_regression_qwen3_5_int4_in_projections_were_stored_twice(bundle):
    """The packed in-projection came out b, a in the prefill graph and a, b in the decode graph:
    different bytes, both kept (96 MB of Qwen3.5-0.8B's int4 weight file), and ``hexforge
    inspect`` counted the whole file as what a decode token reads (568 MB for 472). Packing now
    orders by the weights; the decode graph reads no projection the prefill does not."""
    from hexforge.commands.inspect import inspect_bundle

    b = bundle("qwen3_5", cpu_weights="int4")
    cpu = b / "cpu"
    decode = _external_spans(cpu / "s0.decode.onnx", "MatMulNBits")
    shared = (_external_spans(cpu / "s0.prefill.onnx", "MatMulNBits")
              | _external_spans(cpu / "head.onnx", "MatMulNBits"))
    assert decode and decode <= shared
    # the ranges the decode graph (which runs the head) names, each once: here the whole file,
    # as nothing in it is the prefill's own any more
    per_token = inspect_bundle(b)["targets"]["cpu"]["decode_weight_bytes_per_token"]
    assert per_token == sum(int(n) for _, _, n in _external_spans(cpu / "s0.decode.onnx"))


def test_host_tables_take_the_heads_format_where_every_target_can():
    """The embedding follows the head's format (``cpu_head_format``: int8 in blocks of 32 under
    int4 weights); int8 blocks of 32 where the blocks do not divide its width or where HTP targets
    (8/16-bit weights) read it too; other tables int8."""
    import numpy as np

    from hexforge.forge.quantize.nbits import host_table_formats

    tensors = {"e": np.zeros((10, 256), np.float32), "odd": np.zeros((10, 64), np.float32)}
    assert host_table_formats("fp32", "e", ["x"], tensors) == {}
    assert host_table_formats("int8", "e", ["x"], tensors) == {"e": (8, 32), "x": (8, 32)}
    assert host_table_formats("int4", "e", ["x"], tensors) == {"e": (8, 32), "x": (8, 32)}
    assert host_table_formats("int4-b128", "e", [], tensors) == {"e": (8, 32)}
    assert host_table_formats("int4-b128", "odd", [], tensors) == {"odd": (8, 32)}
    assert host_table_formats("int8-b128", "e", ["x"], tensors) == {"e": (8, 128), "x": (8, 32)}
    assert host_table_formats("int8-b128", "e", [], tensors, int8_embedding=True) == {"e": (8, 32)}
    assert host_table_formats("int8-b128", "odd", [], tensors) == {"odd": (8, 32)}
    # --int4-per-layer-tables: the other tables take the int4 blocks where those divide them
    assert host_table_formats("int4-b128", "e", ["e", "odd"], tensors, int4_extras=True) == {
        "e": (8, 32), "odd": (8, 32)}
    assert host_table_formats("int4", "e", ["odd"], tensors, int4_extras=True) == {
        "e": (8, 32), "odd": (4, 32)}
    assert host_table_formats("int8", "e", ["odd"], tensors, int4_extras=True)["odd"] == (8, 32)


def test_int4_head_at_int4_regression_int4_weights_keep_an_int8_head_shared_with_the_embedding(
        ckpt, tmp_path):
    """An int4 head cost real models most of their int4 error (SmolLM2: KL 0.14 of the head alone
    at blocks of 32): under --cpu-weights int4 the head's MatMulNBits is int8 in blocks of 32,
    every other MatMul int4, and the tied embedding is the head's int8 rows, stored once."""
    import onnx

    from hexforge.commands.cli import main
    from hexforge.commands.inspect import inspect_bundle

    out = tmp_path / "b"
    assert main(["build", str(ckpt("qwen3")), "-o", str(out), "--cpu-weights", "int4",
                 "--no-verify", "--context", "32", "--prefill-len", "8"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["targets"]["cpu"]["quant"] == "int4"
    assert manifest["host"]["embed"]["shared"]["bits"] == 8
    assert inspect_bundle(out)["embedding"].startswith("int8")
    vocab = manifest["vocab_size"]
    for name in ("head", "s0.decode", "s0.prefill"):
        g = onnx.load(str(out / "cpu" / f"{name}.onnx"), load_external_data=False).graph
        bits = {dict((a.name, a.i) for a in n.attribute)["N"] == vocab:
                {dict((a.name, a.i) for a in n.attribute)["bits"]}
                for n in g.node if n.op_type == "MatMulNBits"}
        assert all(b == {4} for head, b in bits.items() if not head) and bits
        if name != "s0.prefill":  # the head graph and the decode graph that runs the head
            assert bits[True] == {8}


def test_int4_per_layer_tables_put_gemma4s_per_layer_table_in_int4(tmp_path):
    """`--cpu-weights int4 --int4-per-layer-tables`: Gemma-4's per-layer embedding table is int4
    in the weights' blocks (a per-layer width of 16 x 10 layers: blocks of 32 divide it), the
    bundle passes its int4 gate and the runtime reads an Int4Table; the flag is refused where it
    cannot apply (int8 weights, an HTP target, a checkpoint without per-layer tables)."""
    from hexforge.bundle.errors import BuildError
    from hexforge.bundle.hostfile import check_safetensors_header
    from hexforge.bundle.qtables import Int4Table
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    ck = make_tiny_checkpoint("gemma4", tmp_path / "ck", hidden_size_per_layer_input=16)
    opts = BuildOptions(context=48, prefill_len=8, cpu_weights="int4", int4_per_layer_tables=True)
    b = build(ck, tmp_path / "b", opts, log=lambda m: None)
    report = json.loads((b / "report.json").read_text())["cpu"]
    assert report["passed"], report["failures"]
    header = check_safetensors_header(b / "host.safetensors")
    table = "embed_tokens_per_layer"
    assert header[table]["dtype"] == "U8" and header[table + ".int4_scales"]["shape"][1] == 5
    import hexforge

    model = hexforge.load(b)
    assert isinstance(model.engine.host.extra["ple"], Int4Table)
    assert model.generate("hello", max_new_tokens=4).text is not None
    for weights, targets in (("int8", "cpu"), ("int4", "cpu,v81")):
        with pytest.raises(BuildError, match="--int4-per-layer-tables needs"):
            build(ck, tmp_path / "x", BuildOptions(targets=targets, cpu_weights=weights,
                                                   int4_per_layer_tables=True), log=lambda m: None)
    with pytest.raises(BuildError, match="no per-layer tables"):
        build(make_tiny_checkpoint("qwen3", tmp_path / "q"), tmp_path / "x", BuildOptions(
            cpu_weights="int4", int4_per_layer_tables=True), log=lambda m: None)
    assert not (tmp_path / "x").exists()


def test_b128_weights_share_an_embedding_their_block_divides(tmp_path):
    """A hidden size 128 divides (the tiny family's 64 does not): int8-b128 keeps the embedding
    in the head's blocks of 128 and stores it once (int4-b128's head is int8 in blocks of 32,
    and so is its shared embedding), and the bundle still matches its float rows within the
    gate."""
    from hexforge.bundle.hostfile import check_safetensors_header
    from hexforge.commands.inspect import inspect_bundle
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    ck = make_tiny_checkpoint("qwen3", tmp_path / "ck", hidden_size=128)
    for weights, bits, block in (("int8-b128", 8, 128), ("int4-b128", 8, 32)):
        b = build(ck, tmp_path / weights, BuildOptions(context=48, prefill_len=8,
                                                       cpu_weights=weights), log=lambda m: None)
        report = json.loads((b / "report.json").read_text())["cpu"]
        assert report["passed"], report["failures"]
        shared = json.loads((b / "manifest.json").read_text())["host"]["embed"]["shared"]
        assert (shared["bits"], shared["block"], shared["shape"][1]) == (bits, block, 128)
        assert "embed_tokens" not in check_safetensors_header(b / "host.safetensors")
        assert inspect_bundle(b)["embedding"].startswith(f"int{bits}, blocks of {block}: the tied")


def test_regression_faster_int8_prefill_kernel_spreads_one_outlier_channel_over_the_chunk(
        tmp_path):
    """Why the cpu prefill keeps MatMulNBits, though onnxruntime's DynamicQuantizeMatMul ran the
    same int8 product 2.0-2.2x faster at 64-256 rows (bench/experiments/cpu_kernels.py): it quantizes the
    activations per tensor, so one outlier channel (real LLM activations have them; random
    weights do not make them, so no oracle here would see the loss) costs every row of the chunk
    its precision, where MatMulNBits' per-block scales keep the outlier in its block. Should
    onnxruntime's kernel stop doing that, this fails and the choice is open again."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "experiments" / "cpu_kernels.py"
    spec = importlib.util.spec_from_file_location("cpu_kernels", path)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    rng = np.random.default_rng(0)
    K, N = 1024, 256  # Qwen3-0.6B's hidden size: 8 blocks of 128 along K
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    x = rng.standard_normal((64, K)).astype(np.float32)  # one AR-64 prefill chunk
    error = {c: kernels.product_errors(kernels.session(kernels.matmul_model(w, c, tmp_path)), w, x)
             for c in ("int8-b128", "dqmm-int8")}
    (nbits, nbits_outlier), (dqmm, dqmm_outlier) = (
        (error[c]["gaussian"], error[c]["outlier_channel"]) for c in ("int8-b128", "dqmm-int8"))
    assert nbits < 0.02 and dqmm < 0.02, error  # alike without an outlier
    assert nbits_outlier < 0.05, error
    assert dqmm_outlier > 3 * nbits_outlier, error
