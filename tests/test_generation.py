"""Generation features: samplers, stop strings, logprobs, cancellation, chat sessions, the
OpenAI-compatible server and the seed's qhx-generate entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import hexforge
from hexforge.errors import RequestError
from hexforge.runtime.model import StopStrings
from hexforge.runtime.sampling import make_sampler, min_p, repetition_penalty
from tests.conftest import prompt_ids


def test_min_p_and_repetition_penalty_are_small_processors():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    kept = np.isfinite(min_p(0.2)(logits))
    assert kept.tolist() == [True, True, True, False]  # 0.05 < 0.2 * 0.5
    hist = [0, 3, 3]
    out = repetition_penalty(2.0, hist, window=2)(np.array([1.0, 1.0, -1.0, -1.0], np.float32))
    assert out.tolist() == [1.0, 1.0, -1.0, -2.0]  # only id 3 is in the last 2
    with pytest.raises(RequestError, match="min_p"):
        make_sampler(min_p_=1.5)


def test_repetition_penalty_changes_greedy_output(bundle):
    model = hexforge.load(bundle("llama"))
    ids = prompt_ids(5)
    plain = model.generate(ids, max_new_tokens=24, ignore_eos=True).token_ids
    penal = model.generate(ids, max_new_tokens=24, ignore_eos=True,
                           repetition_penalty=50.0).token_ids
    assert len(set(penal)) >= len(set(plain)) and penal != plain


@pytest.mark.parametrize("pieces,stops,want", [
    (["Hel", "lo wor", "ld"], ["lo w"], "Hel"),  # spans tokens
    (["abc", "dXYZe"], ["XY"], "abcd"),  # ends inside a token
    (["ab", "c"], ["zz"], "abc"),  # never hit: all released
    (["a", "b", "c"], ["bd"], "abc"),  # a held-back prefix that does not complete
])
def test_stop_strings_cut_exactly(pieces, stops, want):
    s = StopStrings(stops)
    out = "".join(s.add(p) for p in pieces)
    out += "" if s.hit else s.flush()
    assert out == want and s.text.startswith(want)


def test_stop_string_through_the_api_and_stream_agree(bundle):
    model = hexforge.load(bundle("llama"))
    ids = prompt_ids(6)
    full = model.generate(ids, max_new_tokens=40, ignore_eos=True).text
    stop = full[10:13]
    r = model.generate(ids, max_new_tokens=40, ignore_eos=True, stop=[stop])
    assert r.finish_reason == "stop" and r.text == full[:full.index(stop)]
    assert "".join(model.stream(ids, max_new_tokens=40, ignore_eos=True, stop=[stop])) == r.text


def test_logprobs_and_cancellation(bundle):
    model = hexforge.load(bundle("llama"))
    r = model.generate(prompt_ids(4), max_new_tokens=6, ignore_eos=True, logprobs=3)
    assert len(r.logprobs) == 6
    for e, tok in zip(r.logprobs, r.token_ids, strict=True):
        assert e["token"] == tok and e["top"][0][0] == tok  # greedy = the top-1
        assert e["logprob"] <= 0 and len(e["top"]) == 3
    calls = []
    r = model.generate(prompt_ids(4), max_new_tokens=50, ignore_eos=True,
                       should_stop=lambda: calls.append(1) or len(calls) >= 3)
    assert r.finish_reason == "cancelled" and len(r.token_ids) == 3


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_chat_session_prefills_only_the_new_turn_and_matches_a_fresh_run(bundle, family):
    model = hexforge.load(bundle(family))
    s = model.session(system="Be brief.")
    s.send("Hi there!", max_new_tokens=6, ignore_eos=True)
    second = s.send("And then?", max_new_tokens=6, ignore_eos=True)
    msgs = s.messages[:-1]
    fresh = model.chat(msgs, max_new_tokens=6, ignore_eos=True)
    assert second.token_ids == fresh.token_ids
    # the second turn reused the first turn's state (unless retokenizing the reply differed)
    assert s.last_reused > 0 or s.cached[:5] != fresh.token_ids[:5]
    s.reset()
    assert s.cached == [] and [m["role"] for m in s.messages] == ["system"]


@pytest.fixture(scope="module")
def client(bundle):
    from fastapi.testclient import TestClient

    from hexforge.serve import create_app

    model = hexforge.load(bundle("llama"))
    return TestClient(create_app(model, "tiny-llama", api_key="sekret"))


AUTH = {"Authorization": "Bearer sekret"}


def test_server_models_auth_and_chat(client):
    assert client.get("/v1/models").status_code == 401
    r = client.get("/v1/models", headers=AUTH)
    assert r.json()["data"][0]["id"] == "tiny-llama"
    body = {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 5, "logprobs": True,
            "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=body, headers=AUTH).json()
    choice = r["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
    assert len(choice["logprobs"]["content"]) == r["usage"]["completion_tokens"]


def test_server_streams_sse_equal_to_the_non_stream_text(client):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    whole = client.post("/v1/completions", json=body, headers=AUTH).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True},
                       headers=AUTH) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_server_errors_are_openai_shaped(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/chat/completions", json={"messages": "nope"}, headers=AUTH)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", headers=AUTH, json={"messages": [{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "temperature": -1}, headers=AUTH)
    assert r.status_code == 400


def test_qhx_generate_takes_the_seed_argument_order(bundle):
    b = bundle("llama")
    ok = subprocess.run([sys.executable, "-m", "hexforge.qhx", str(b / "manifest.json"),
                         "libQnnCpu.so", "libQnnSystem.so", str(b), "5", "Hello"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    ref = hexforge.load(b).generate("Hello", max_new_tokens=5).text
    assert ok.stdout.rstrip("\n") == ref
    bad = subprocess.run([sys.executable, "-m", "hexforge.qhx", str(b / "manifest.json"),
                          "libFoo.so", "libQnnSystem.so", str(b), "5", "Hello"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "libQnnHtp.so" in bad.stderr
