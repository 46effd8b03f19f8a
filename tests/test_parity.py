"""The oracle, end to end: bundle greedy tokens == HF generate (fp32, greedy) for 64 new tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hexforge
from tests.conftest import N, prompt_ids, text_with_tokens

FAMILIES = ["llama", "qwen3"]
LENGTHS = [1, N - 1, N, N + 1, 3 * N + 5]  # prefill chunk boundaries


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("length", LENGTHS)
def test_api_greedy_equals_hf(bundle, hf_greedy, family, length):
    ids = prompt_ids(length)
    model = hexforge.load(bundle(family))
    got = model.generate(ids, max_new_tokens=64, ignore_eos=True)
    assert got.token_ids == hf_greedy(family, ids, 64)
    assert got.prompt_tokens == length and got.finish_reason == "length"


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_greedy_equals_hf(bundle, hf_greedy, family):
    b = bundle(family)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(b / "tokenizer" / "tokenizer.json"))
    for length in [2, N - 1, N, N + 1, 3 * N + 5]:
        text = text_with_tokens(b / "tokenizer", length)
        out = subprocess.run(
            [sys.executable, "-m", "hexforge", "run", str(b), text, "-n", "64", "--ignore-eos",
             "--json"], capture_output=True, text=True, check=True)
        res = json.loads(out.stdout)
        ids = tok.encode(text).ids
        assert res["prompt_tokens"] == length == len(ids)
        assert res["token_ids"] == hf_greedy(family, ids, 64), f"length {length}"
        for key in ("text", "ttft_ms", "decode_tok_s", "finish_reason"):
            assert key in res


# prompt lengths past the chunk size (and past Gemma-4's sliding window W=8)
@pytest.mark.parametrize("family,length", [("llama", 2 * N + 3), ("gemma4", 8 + N + 3),
                                           ("qwen3_5", 2 * N + 3)])
def test_first_step_logits_within_1e4(bundle, hf_model, family, length):
    import numpy as np
    import torch

    ids = prompt_ids(length)
    model = hexforge.load(bundle(family))
    model.engine.reset()
    ours = model.engine.prefill(ids)
    with torch.no_grad():
        x = torch.tensor([ids])
        ref = hf_model(family)(x, attention_mask=torch.ones_like(x)).logits[0, -1].numpy()
    assert np.abs(ours - ref).max() < 1e-4


def test_three_shards_equal_one_shard(bundle, hf_greedy):
    one = bundle("llama")
    three = bundle("llama", max_shard_bytes=300_000)  # 2 tiny llama layers = 295,936 B
    m1 = json.loads((one / "manifest.json").read_text())
    m3 = json.loads((three / "manifest.json").read_text())
    assert len(m1["targets"]["cpu"]["plan"]["shards"]) == 1
    assert [s["layers"] for s in m3["targets"]["cpu"]["plan"]["shards"]] == [[0, 2], [2, 4], [4, 6]]
    ids = prompt_ids(3 * N + 5)
    a = hexforge.load(one).generate(ids, max_new_tokens=64, ignore_eos=True).token_ids
    b = hexforge.load(three).generate(ids, max_new_tokens=64, ignore_eos=True).token_ids
    assert a == b == hf_greedy("llama", ids, 64)


def test_qwen2_through_remap(bundle, hf_greedy):
    """qwen2 (q/k/v biases, tied embeddings) is served by families/llama.py via REMAP."""
    b = bundle("qwen2")
    assert json.loads((b / "manifest.json").read_text())["family"] == "llama"
    ids = prompt_ids(N + 1)
    got = hexforge.load(b).generate(ids, max_new_tokens=32, ignore_eos=True).token_ids
    assert got == hf_greedy("qwen2", ids, 32)


def test_decode_over_prompt_equals_chunked_prefill(bundle):
    model = hexforge.load(bundle("qwen3"))
    ids = prompt_ids(2 * N + 3)
    a = model.generate(ids, max_new_tokens=16, ignore_eos=True)
    b = model.generate(ids, max_new_tokens=16, ignore_eos=True, prefill_mode="decode")
    assert a.token_ids == b.token_ids


def test_report_has_per_graph_cosine_and_greedy(bundle):
    report = json.loads((bundle("llama") / "report.json").read_text())["cpu"]
    assert report["passed"] and report["greedy"]["exact"]
    # the cpu decode graph runs the head too: its logits are judged as well
    assert set(report["graphs"]) == {"s0.prefill", "s0.decode", "s0.decode:logits", "head"}
    for g in report["graphs"].values():
        assert g["cos_min"] > 0.99999 and g["rows"] > 0
    assert report["teacher_forced"]["top1"] == 1.0


def test_the_oracles_greedy_tokens_are_read_off_teacher_forcing_until_a_miss(bundle, hf_model,
                                                                              monkeypatch):
    """While the bundle's argmax agrees with HF's greedy token, its greedy run would feed the
    teacher-forced run's tokens through the same graphs: it is not run again (half the oracle's
    decode steps, on the simulator minutes). A miss runs it, and reports the bundle's own tokens."""
    from hexforge.bundle.manifest import load_manifest
    from hexforge.families import load_family
    from hexforge.forge.oracle.backend import OracleCpuBackend
    from hexforge.forge.oracle.verify import Judge, default_eval, oracle_prompt, verify_target
    from hexforge.runtime.engine import Engine
    from hexforge.runtime.text import TextTokenizer

    b = bundle("llama")
    manifest = load_manifest(b)
    family, hf = load_family(manifest.model_type).FAMILY, hf_model("llama")
    tok = TextTokenizer(b / "tokenizer")
    runs = []
    real_generate = Engine.generate_step
    monkeypatch.setattr(Engine, "generate_step",
                        lambda self, *a, **k: runs.append(a) or real_generate(self, *a, **k))

    def oracle(bias_at=None, token=None, **kw):
        engine = Engine(b, manifest, "cpu", OracleCpuBackend())
        if bias_at is not None:  # a wrong bundle: from one position on, `token` wins
            decode = engine.decode

            def biased(t, copy=True):
                at, logits = engine.pos, decode(t, copy=True)
                logits[token] += 1e4 * (at == bias_at)
                return logits
            engine.decode = biased
        return verify_target(Judge(family, hf, tok, manifest, 16, default_eval()), engine, "cpu",
                             **kw)

    r = oracle()
    assert r["passed"] and r["greedy"]["exact"] and r["greedy"]["bundle"] == r["greedy"]["hf"]
    assert runs == []  # read off the teacher-forced logits
    hf_tokens = r["greedy"]["hf"]
    prompt = oracle_prompt(tok, N, manifest.context, 16)
    wrong = (hf_tokens[3] + 1) % manifest.vocab_size
    r = oracle(bias_at=len(prompt) + 2, token=wrong)  # the step that samples token 3
    assert len(runs) == 1 and not r["passed"]
    assert r["greedy"]["matching_prefix"] == 3 and r["greedy"]["bundle"][:4] == [
        *hf_tokens[:3], wrong] and len(r["greedy"]["bundle"]) == 16
    # the simulator's form (continue_after_miss=False): no greedy run, the same verdict and
    # matching prefix, the bundle's tokens up to the miss
    runs.clear()
    again = oracle(bias_at=len(prompt) + 2, token=wrong, continue_after_miss=False)
    assert runs == [] and again["failures"] == r["failures"]
    assert again["greedy"]["matching_prefix"] == 3
    assert again["greedy"]["bundle"] == [*hf_tokens[:3], wrong]


def test_the_oracles_held_out_text_runs_the_cpu_head_on_many_rows_at_once(bundle):
    """The head graph is [1, 1, H]: the held-out text went through it a row at a time, each call
    reading the whole head (Gemma-3's 671 MB, 600 times). The oracle opens the same graph with
    its row axis symbolic: the same logits as the engine's one-row calls."""
    import numpy as np

    from hexforge.forge.oracle.quality import HEAD_ROWS, bundle_logits, rows_head

    model = hexforge.load(bundle("llama"))
    engine = model.engine
    batched = rows_head(engine)
    assert batched is not None
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, HEAD_ROWS + 3, model.manifest.hidden_size)).astype(np.float32)
    engine.pos = 1
    one = np.stack([engine.head_logits(hidden[:, i:i + 1]) for i in range(hidden.shape[1])])
    np.testing.assert_allclose(batched(hidden)[0], one, rtol=1e-5, atol=1e-5)
    ids = prompt_ids(HEAD_ROWS + 9)  # more rows than one call takes
    assert bundle_logits(engine, ids).shape == (len(ids), model.manifest.vocab_size)


def test_regression_a_qdq_twins_head_is_not_batched(htp_bundle):
    """The batched head reached the CPU twin of a w8-u16 target (its QDQ graphs on the CPU EP),
    whose norm reshapes to [1, 1, H]: onnxruntime failed the build ("cannot be reshaped";
    test_htp's failed-gate test). Only a head of row-wise ops is batched; others run a row a
    call, as before."""
    from types import SimpleNamespace

    import numpy as np
    import onnx

    from hexforge.forge.oracle.quality import ROW_WISE_OPS, rows_head

    b = htp_bundle("llama", "w8-u16", keep_work=True, verify=False)
    qdq = [p for p in sorted((b / "_work").rglob("head*.onnx")) if any(
        n.op_type == "QuantizeLinear" for n in onnx.load(str(p), load_external_data=False).graph.node)]
    assert qdq

    def engine(path):
        return SimpleNamespace(target=SimpleNamespace(htp_arch=None), bundle=b,
                               plan=SimpleNamespace(head=SimpleNamespace(
                                   file=str(path.relative_to(b)))), hidden_dtype=np.float32)

    assert rows_head(engine(qdq[0])) is None
    ops = {n.op_type for n in onnx.load(str(b / "cpu" / "head.onnx"),
                                        load_external_data=False).graph.node}
    assert ops <= ROW_WISE_OPS and rows_head(engine(b / "cpu" / "head.onnx")) is not None


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_the_fp16_form_carries_the_stream_at_one_over_s_and_nothing_else_moves(
        ckpt, hf_model, family):
    """The form a module is made in (families/form.py) changes how it is written, not what it
    computes: in eager fp32 the fp16 form with s = 4 gives the first shard's hidden at 1/4 of the
    plain form's and the same new cache rows, and its head reads that 1/4 stream back to the
    same logits. A form flipped on after construction (the old setters) would leave one side
    unscaled and fail here."""
    import torch

    from hexforge.families import load_family
    from hexforge.families.form import PLAIN, fp16

    hf = hf_model(family)
    fam = load_family(hf.config.model_type).FAMILY
    args = fam.Args.from_config(json.loads((ckpt(family) / "config.json").read_text()))
    layers = (0, 2)
    plain = fam.decoder_module(hf, args, layers, 4, 16, PLAIN)
    scaled = fam.decoder_module(hf, args, layers, 4, 16, fp16(4.0))
    torch.manual_seed(0)
    example = plain.example_inputs()
    with torch.no_grad():
        want, got = plain(*example), scaled(*example)
        assert torch.allclose(got[0] * 4.0, want[0], rtol=1e-4, atol=1e-4)
        for g, w in zip(got[1:], want[1:], strict=True):
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-5)
        hidden = want[0][:, -1:]
        logits = fam.head_module(hf, args, PLAIN)(hidden)
        assert torch.allclose(fam.head_module(hf, args, fp16(4.0))(hidden / 4.0), logits,
                              rtol=1e-4, atol=1e-4)
