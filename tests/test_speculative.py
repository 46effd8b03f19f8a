"""Speculative decoding with prompt-lookup drafts (runtime/speculative.py): the same greedy tokens
as plain decoding on every family with KV caches (cpu and the HTP simulator, shards, rings, shared
caches, M-RoPE), the same distribution under sampling, recurrent families refused."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import hexforge
from hexforge.bundle.errors import RequestError
from hexforge.runtime.speculative import EXPLORE, PromptLookup
from tests.conftest import CONTEXT, prompt_ids


def prompts() -> list[list[int]]:
    """Prompts whose continuations the drafter finds often (a repeated span; a span cut short
    after another), and rarely (random ids)."""
    span = prompt_ids(16, seed=1)
    return [prompt_ids(12) * 3, span + prompt_ids(5, seed=2) + span[:8], prompt_ids(27)]


def assert_same_greedy_tokens(model, ids: list[int], n: int, ks=(2, 7), **kw) -> list[dict]:
    plain = model.generate(ids, max_new_tokens=n, ignore_eos=True, **kw).token_ids
    stats = []
    for k in ks:
        r = model.generate(ids, max_new_tokens=n, ignore_eos=True, prompt_lookup=k, **kw)
        assert r.token_ids == plain, f"prompt_lookup={k} changed the tokens"
        stats.append(r.speculation)
    return stats


def assert_drafts_were_accepted_and_rejected(stats: list[dict]) -> None:
    """The comparison above means something only if verify steps kept rows and dropped rows."""
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    assert sum(s["verify_calls"] for s in stats) > 0 and 0 < accepted < drafted


def test_drafts_continue_the_latest_earlier_match_of_the_longest_suffix():
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert PromptLookup(3, ctx).draft(10) == [4, 5, 9]  # "1 2 3" beats the later "2 3"
    ctx = [2, 3, 7, 5, 2, 3, 8, 6, 2, 3]
    assert PromptLookup(3, ctx).draft(10) == [8, 6, 2]  # of two "2 3", the latest
    ctx[-1] = 4  # suffix "2 4" never occurred, "4" neither
    assert PromptLookup(3, ctx).draft(10) == []
    loop = [5, 6, 5, 6]  # the match runs into the end: the period goes on
    assert PromptLookup(5, loop).draft(5) == [5, 6, 5, 6, 5]
    assert PromptLookup(5, loop).draft(2) == [5, 6]
    live = [1, 2, 3, 1]  # the context is read live, the index kept up to date
    d = PromptLookup(4, live)
    assert d.draft(4) == [2, 3, 1, 2]
    live += [2, 3, 9, 1, 2]
    assert d.draft(4) == [3, 9, 1, 2]
    with pytest.raises(RequestError, match="prompt_lookup"):
        PromptLookup(0, [])


def test_drafts_stop_where_verify_steps_have_not_paid_and_are_retried_now_and_then():
    d = PromptLookup(4, [1, 2, 3, 1, 2, 3, 1])
    assert d.draft(4, cost_ratio=1.5) == [2, 3, 1, 2]  # the prior: one accepted draft a step
    for _ in range(4):
        d.draft(4, cost_ratio=1.5)
        d.record(0)
    sent = [bool(d.draft(4, cost_ratio=1.5)) for _ in range(2 * EXPLORE)]
    assert sum(sent) == 2  # every EXPLORE-th time only
    assert d.draft(4, cost_ratio=1.0)  # a verify step that costs a decode step always pays
    d.record(4)
    assert d.draft(4, cost_ratio=1.5)  # it paid: drafts go on


@pytest.mark.parametrize("family,opts", [
    ("llama", {}), ("qwen3", {}), ("gemma4", {}),
    # three shards across Gemma-4's KV-sharing boundary, and a llama split in two
    ("gemma4", {"max_shard_bytes": 900_000}), ("llama", {"max_shard_bytes": 200_000}),
])
def test_greedy_tokens_are_identical_with_prompt_lookup_on_cpu(bundle, family, opts):
    b = bundle(family, **opts)
    m = json.loads((b / "manifest.json").read_text())
    assert len(m["targets"]["cpu"]["plan"]["shards"]) > (1 if opts else 0)
    model = always_draft(hexforge.load(b))
    assert model.engine.plan.graphs["verify"][0].role == "verify"  # the AR-k graphs
    stats = []
    for ids in prompts():
        stats += assert_same_greedy_tokens(model, ids, 64)
    assert_drafts_were_accepted_and_rejected(stats)


def test_qwen3_vl_image_prompt_gives_the_same_greedy_tokens(htp_bundle, tmp_path):
    """M-RoPE (rope positions = slot + delta after the image) and deepstack rows, on cpu."""
    from tests.test_qwen3_vl import photo

    b = htp_bundle("qwen3_vl", "fp16", "cpu,v79,v81", verify_tokens=8)
    photo(70, 150, seed=1).save(tmp_path / "p.png")
    model = always_draft(hexforge.load(b))
    stats = []
    for ids in prompts():
        stats += assert_same_greedy_tokens(model, ids, 48, images=[str(tmp_path / "p.png")])
    assert_drafts_were_accepted_and_rejected(stats)


@pytest.mark.parametrize("family,build", [
    ("llama", ("w8-fp16", "v81", {})), ("qwen3", ("w8-fp16", "v81", {})),
    ("gemma4", ("fp16", "v81", {})),
    ("qwen3_vl", ("fp16", "cpu,v79,v81", {"verify_tokens": 8})),
])
def test_greedy_tokens_are_identical_with_prompt_lookup_on_qnn_sim(htp_bundle, family, build):
    """HTP targets verify through their AR-N prefill graphs, the head run per row read."""
    quant, targets, kw = build
    model = always_draft(hexforge.load(htp_bundle(family, quant, targets, **kw),
                                       backend="qnn-sim", arch="v81"))
    assert model.engine.plan.graphs["verify"][0].role == "prefill"
    stats = []
    for ids in prompts()[:2]:
        stats += assert_same_greedy_tokens(model, ids, 24, ks=(4,))
    assert_drafts_were_accepted_and_rejected(stats)


@pytest.mark.parametrize("quant", ["w8-fp16", "w8-u16"])
def test_greedy_tokens_are_identical_through_htp_verify_graphs(htp_bundle, quant):
    """--htp-verify: AR-k verify graphs per shard and the head on k rows, compiled for v81 (the
    QDQ recipe calibrated by teacher-forced verify steps): the same tokens as plain decoding,
    the verify head called once a verify step, not once per row read."""
    model = always_draft(hexforge.load(htp_bundle("llama", quant, "v81", htp_verify=True,
                                                  verify_len=4), backend="qnn-sim", arch="v81"))
    plan = model.engine.plan
    assert [g.role for g in plan.graphs["verify"]] == ["verify"] and plan.verify_head is not None
    assert plan.verify_head.seq_len == 4 == model.engine.verify_len
    calls = Counter()
    model.engine.observer = lambda g, *_: calls.update([g.name])
    stats = []
    for ids in prompts()[:2]:
        stats += assert_same_greedy_tokens(model, ids, 24, ks=(3,))
    assert_drafts_were_accepted_and_rejected(stats)
    assert calls["head.verify"] == calls["s0.verify"] == sum(s["verify_calls"] for s in stats) > 0


def test_verify_steps_stop_before_the_end_of_the_cache(bundle):
    """A verify step's rows (pad rows included) must end inside the cache: near the end the
    loop decodes one token a step instead, with the same tokens up to the last row."""
    model = always_draft(hexforge.load(bundle("llama")))
    ids = prompt_ids(60) * 4  # 240 of 256 rows
    n = CONTEXT - len(ids)
    [stats] = assert_same_greedy_tokens(model, ids, n, ks=(7,))
    assert stats["decode_calls"] > 0 and stats["verify_calls"] > 0


def test_a_stopped_speculative_run_leaves_the_state_of_the_tokens_handed_out(bundle):
    """Every token handed out but the last is in the state afterwards, also when the consumer
    stops inside a verify step's accepted rows: continuing from it gives plain decoding's tokens."""
    from hexforge.runtime.sampling import greedy

    eng = always_draft(hexforge.load(bundle("llama"))).engine
    ids, n = prompt_ids(12) * 3, 30
    plain = [t for t, _ in eng.generate_step(ids, greedy, n)]
    for stop_at in (3, 6, 11):
        context = list(ids)
        drafter = PromptLookup(7, context)
        got = []
        for t, _ in eng.generate_step(ids, greedy, n, drafter=drafter):
            got.append(t)
            context.append(t)
            if len(got) == stop_at:
                break
        assert drafter.stats.verify_calls > 0 and eng.pos == len(ids) + stop_at - 1
        more = [t for t, _ in eng.generate_step([got[-1]], greedy, n - stop_at, fresh=False)]
        assert got + more == plain


def test_chat_sessions_and_stop_strings_give_the_same_text_with_prompt_lookup(bundle):
    model = always_draft(hexforge.load(bundle("llama")))
    plain, spec = model.session(system="Be brief."), model.session(system="Be brief.")
    for text in ["repeat: a b c a b c a b c", "again: a b c a b c", "once more"]:
        a = plain.send(text, max_new_tokens=20, ignore_eos=True)
        b = spec.send(text, max_new_tokens=20, ignore_eos=True, prompt_lookup=5)
        assert a.token_ids == b.token_ids and spec.cached == plain.cached
    full = model.generate(prompt_ids(12) * 3, max_new_tokens=40, ignore_eos=True).text
    stop = full[25:28]
    r = model.generate(prompt_ids(12) * 3, max_new_tokens=40, ignore_eos=True, stop=[stop],
                       prompt_lookup=7)
    assert r.finish_reason == "stop" and r.text == full[:full.index(stop)]


def test_recurrent_families_refuse_prompt_lookup_in_one_line(bundle):
    model = hexforge.load(bundle("qwen3_5"))
    with pytest.raises(RequestError, match="recurrent state") as e:
        model.generate(prompt_ids(8), max_new_tokens=4, prompt_lookup=4)
    assert "\n" not in str(e.value)


def test_cli_run_json_reports_drafted_and_accepted_tokens(bundle, capsys):
    from hexforge.commands.cli import main

    prompt = " ".join(["the cat sat on the mat"] * 4)
    assert main(["run", str(bundle("llama")), prompt, "-n", "24", "--ignore-eos", "--json",
                 "--prompt-lookup", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["speculation"]
    assert s["verify_calls"] > 0 and s["drafted"] >= s["accepted"] >= 0
    assert s["tokens_per_verify"] >= 1.0 and len(out["token_ids"]) == 24


def test_regression_prompt_lookup_opened_its_verify_graphs_before_the_first_token(bundle):
    """The verify graphs' sessions were opened before the prefill: with prompt lookup the first
    token of a fresh model came ~2x later (SmolLM2: TTFT 574-635 -> 1191-1242 ms). They open at
    the first verify step now, after the first token; the tokens are the same."""
    model = hexforge.load(bundle("llama"))
    events: list[str] = []
    session = model.engine.backend.session

    def opening(bundle_dir, target, graph):
        events.append(f"open {graph.role}")
        return session(bundle_dir, target, graph)

    model.engine.backend.session = opening
    ids = prompt_ids(12) * 3
    plain = model.generate(ids, max_new_tokens=12, ignore_eos=True).token_ids
    tokens = []
    for token, _ in model.engine.generate_step(ids, lambda logits: int(np.argmax(logits)), 12,
                                               drafter=PromptLookup(4, list(ids))):
        events.append("token")
        tokens.append(token)
    assert tokens == plain
    assert events[0] == "token" and "open verify" in events, events


def test_prompt_lookup_above_the_bundles_verify_rows_is_said(bundle, capsys):
    """--prompt-lookup 16 on a bundle of AR-8 verify graphs drafts at most 7 tokens a step: said
    in a note, and in the result (max_draft), not silently cut."""
    from hexforge.commands.cli import main

    prompt = " ".join(["the cat sat on the mat"] * 4)
    assert main(["run", str(bundle("llama")), prompt, "-n", "8", "--ignore-eos", "--json",
                 "--prompt-lookup", "16"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["speculation"]["max_draft"] == 7
    assert ("--prompt-lookup 16: this bundle's AR-k verify graphs take 8 rows, so a step drafts "
            "at most 7 tokens (a bundle built with --verify-len 17 drafts 16)") in out.err
    assert main(["run", str(bundle("llama")), prompt, "-n", "8", "--json",
                 "--prompt-lookup", "7"]) == 0
    out = capsys.readouterr()
    assert "note" not in out.err and json.loads(out.out)["speculation"]["max_draft"] == 7


def always_draft(model):
    """Send every draft found: the step-time policy (a cpu verify step costs more than a decode
    step) would otherwise skip drafts the test needs verified."""
    model.engine.step_costs.add = lambda kind, seconds: None
    return model


def samples(model, ids, n, count, seed, **kw) -> list[tuple[int, ...]]:
    return [tuple(model.generate(ids, max_new_tokens=n, ignore_eos=True, seed=seed + i,
                                 **kw).token_ids) for i in range(count)]


def homogeneity_p(a: list[tuple], b: list[tuple]) -> float:
    """Chi-square test that two samples of outcomes come from one distribution: the smallest
    p-value over the joint of the first two tokens and the marginals of the later ones."""
    from scipy.stats import chi2_contingency

    def p(ca: Counter, cb: Counter) -> float:
        keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
        rows = [[ca[k], cb[k]] for k in keys if ca[k] + cb[k] >= 10]
        rest = [[ca[k], cb[k]] for k in keys if ca[k] + cb[k] < 10]
        if rest:
            rows.append(np.sum(rest, axis=0).tolist())
        return float(chi2_contingency(np.array(rows)).pvalue) if len(rows) > 1 else 1.0

    ps = [p(Counter(x[:2] for x in a), Counter(x[:2] for x in b))]
    ps += [p(Counter(x[j] for x in a), Counter(x[j] for x in b)) for j in range(2, len(a[0]))]
    return min(ps)


def test_speculative_sampling_keeps_the_output_distribution(bundle, monkeypatch):
    """Seeded, so deterministic; it can fail: the same test, at the same sample size, rejects a
    verify step whose logits lean towards the drafts by 0.5 (the control at the end)."""
    from hexforge.runtime.engine import Engine

    model = always_draft(hexforge.load(bundle("llama")))
    # a prompt whose greedy continuation follows an earlier copy of its last tokens: drafts
    # are found at every step, and both kept and replaced often
    head = prompt_ids(6, seed=5)
    cont = model.generate(head, max_new_tokens=6, ignore_eos=True).token_ids
    ids = head + cont + head
    kw, n, count = dict(temperature=1.0, top_k=3), 4, 600
    plain = samples(model, ids, n, count, 0, **kw)
    stats = [model.generate(ids, max_new_tokens=n, ignore_eos=True, seed=10_000 + i,
                            prompt_lookup=4, **kw) for i in range(count)]
    spec = [tuple(r.token_ids) for r in stats]
    drafted = sum(r.speculation["drafted"] for r in stats)
    accepted = sum(r.speculation["accepted"] for r in stats)
    assert 100 < accepted < drafted - 100  # many drafts kept, many replaced
    assert homogeneity_p(plain, spec) > 1e-3

    verify = Engine.verify

    def leaning(self, ids):
        step = verify(self, ids)
        rows = step.logits

        def logits(i):
            out = rows(i).copy()
            if i + 1 < len(ids):
                out[ids[i + 1]] += 0.5
            return out

        step.logits = logits
        return step

    monkeypatch.setattr(Engine, "verify", leaning)
    biased = samples(model, ids, n, count, 10_000, prompt_lookup=4, **kw)
    assert homogeneity_p(plain, biased) < 1e-3


def test_server_takes_prompt_lookup_as_a_request_option(bundle):
    from fastapi.testclient import TestClient

    from hexforge.commands.serve import create_app

    client = TestClient(create_app(hexforge.load(bundle("llama")), "tiny", api_key=None))
    body = {"prompt": prompt_ids(12) * 3, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=body).json()
    spec = client.post("/v1/completions", json={**body, "prompt_lookup": 4}).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert "speculation" not in plain["usage"] and spec["usage"]["speculation"]["verify_calls"] > 0
    bad = client.post("/v1/completions", json={**body, "prompt_lookup": 0})
    assert bad.status_code == 400
