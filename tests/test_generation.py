"""Generation features: samplers, stop strings, logprobs, cancellation, chat sessions, the
OpenAI-compatible server and the seed's qhx-generate entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import hexforge
from hexforge.bundle.errors import RequestError
from hexforge.runtime.loop import StopStrings
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


def test_every_generating_method_takes_the_options_as_typed_keywords():
    """help() shows what a request can set: every GenerationOptions field is a keyword-only,
    annotated parameter with its default and a line of doc; an unknown keyword is a TypeError,
    as for any Python function."""
    import inspect
    from dataclasses import fields

    from hexforge.runtime import ChatSession, GenerationOptions, Model

    for fn in (Model.generate, Model.stream, Model.chat, Model.stream_chat, ChatSession.send,
               ChatSession.stream):
        params = inspect.signature(fn).parameters
        for f in fields(GenerationOptions):
            p = params[f.name]
            assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == f.default
            assert p.annotation is not inspect.Parameter.empty, (fn.__name__, f.name)
            assert f"    {f.name}: " in fn.__doc__
    with pytest.raises(TypeError, match="max_tokens"):
        Model.generate(None, "hi", max_tokens=3)


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
    # a one-token reply: the state then holds the first prompt alone, which the second turn's
    # rendering starts with (a longer random reply need not retokenize to the ids it was made
    # of, and a turn that cannot reuse the state prefills everything: the check below)
    s.send("Hi there!", max_new_tokens=1, ignore_eos=True)
    held = list(s.cached)  # the first turn's ids in the engine state
    prefilled: list[int] = []
    real_prefill = model.engine.prefill
    model.engine.prefill = lambda ids, *a, **kw: prefilled.append(len(ids)) or real_prefill(
        ids, *a, **kw)
    second = s.send("And then?", max_new_tokens=6, ignore_eos=True)
    model.engine.prefill = real_prefill
    msgs = s.messages[:-1]
    whole = model.tokenizer.encode(model.apply_chat_template(msgs), add_special_tokens=False)
    fresh = model.chat(msgs, max_new_tokens=6, ignore_eos=True)
    assert second.token_ids == fresh.token_ids
    # the second turn continued the first one's state: every id it held, and prefilled the rest
    assert whole[:len(held)] == held and s.last_reused == len(held) > 0
    assert prefilled == [len(whole) - len(held)]
    s.reset()
    assert s.cached == [] and [m["role"] for m in s.messages] == ["system"]


@pytest.fixture(scope="module")
def client(bundle):
    from fastapi.testclient import TestClient

    from hexforge.commands.serve import create_app

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
    ok = subprocess.run([sys.executable, "-m", "hexforge.commands.qhx", str(b / "manifest.json"),
                         "libQnnCpu.so", "libQnnSystem.so", str(b), "5", "Hello"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    ref = hexforge.load(b).generate("Hello", max_new_tokens=5).text
    assert ok.stdout.rstrip("\n") == ref
    bad = subprocess.run([sys.executable, "-m", "hexforge.commands.qhx", str(b / "manifest.json"),
                          "libFoo.so", "libQnnSystem.so", str(b), "5", "Hello"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "libQnnHtp.so" in bad.stderr


# ---- constrained decoding (runtime/constrain.py, llguidance) --------------------------------------
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "pos": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99,
                                                       "maximum": 99}, "ok": {"type": "boolean"}},
                "required": ["x", "ok"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "pos", "tags"],
    "additionalProperties": False,
}
PET_FORMAT = {"type": "json_schema", "json_schema": {"schema": PET}}


def parses_as_pet(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), PET)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_json_schema_output_always_validates_and_fails_without_the_constraint(bundle):
    model = hexforge.load(bundle("llama"))
    prompt = "Describe a pet as JSON:"
    for seed in range(20):
        r = model.generate(prompt, max_new_tokens=200, temperature=1.0, seed=seed,
                           response_format=PET_FORMAT)
        assert r.finish_reason == "stop" and parses_as_pet(r.text), (seed, r.text)
    # the same requests unconstrained: a random model does not write JSON by itself
    free = [model.generate(prompt, max_new_tokens=40, temperature=1.0, seed=s).text for s in range(5)]
    assert not any(parses_as_pet(t) for t in free)
    # greedy and top-k / top-p run after the mask, so they only ever pick allowed tokens
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 1}, {"temperature": 2.0,
                                                                        "top_p": 0.05}):
        r = model.generate(prompt, max_new_tokens=200, response_format=PET_FORMAT, seed=1, **kw)
        assert parses_as_pet(r.text), (kw, r.text)


def test_regex_lark_streaming_and_chat_sessions_are_constrained(bundle):
    import re

    model = hexforge.load(bundle("llama"))
    fmt = {"type": "regex", "regex": r"[0-9]{3}-[a-z]{2,6}"}
    for seed in range(5):
        r = model.generate("Code:", max_new_tokens=30, temperature=1.0, seed=seed,
                           response_format=fmt)
        assert re.fullmatch(fmt["regex"], r.text) and r.finish_reason == "stop", r.text
        streamed = "".join(model.stream("Code:", max_new_tokens=30, temperature=1.0, seed=seed,
                                        response_format=fmt))
        assert streamed == r.text
    lark = {"type": "lark", "lark": 'start: ("yes" | "no") "!"'}
    assert model.generate("?", temperature=1.0, seed=0, response_format=lark).text in ("yes!", "no!")
    small = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {
        "type": "integer", "minimum": 0, "maximum": 9}}, "required": ["kind", "n"],
        "additionalProperties": False}
    s = model.session()
    for seed in range(2):
        reply = s.send("Pet?", max_new_tokens=40, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"schema": small}})
        assert set(json.loads(reply.text)) == {"kind", "n"}, reply.text


def test_eos_follows_the_grammar_and_truncation_is_length(bundle):
    model = hexforge.load(bundle("llama"))
    eos = model.generation.eos_token_ids[0]
    c = model.grammars.constraint({"type": "regex", "regex": "ab"})
    assert not c.allowed()[eos]  # nothing written yet: EOS masked
    for t in model.tokenizer.encode("ab", add_special_tokens=False):
        c.advance(t)
    assert c.done and np.flatnonzero(c.allowed()).tolist() == [eos]  # complete: only EOS
    long = {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}}}
    r = model.generate("x", max_new_tokens=8, temperature=1.0, seed=0, response_format=long)
    assert r.finish_reason == "length" and len(r.token_ids) == 8 and r.text.startswith('{"s":"')
    with pytest.raises(RequestError, match="response_format"):
        model.generate("x", response_format={"type": "json_schema", "json_schema": {"schema": {
            "type": "strin"}}})
    with pytest.raises(RequestError, match="response_format"):
        model.generate("x", response_format={"type": "xml"})


def test_cli_run_json_schema_and_regex(bundle, tmp_path):
    from hexforge.commands.cli import main

    schema = tmp_path / "pet.json"
    schema.write_text(json.dumps(PET))
    b = str(bundle("llama"))
    out = subprocess.run([sys.executable, "-m", "hexforge", "run", b, "Pet:", "-n", "200",
                          "--temperature", "1", "--seed", "5", "--json-schema", str(schema)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and parses_as_pet(out.stdout.strip()), out.stderr
    assert main(["run", b, "x", "--regex", "(", "-n", "4"]) == 2  # a bad regex: one-line error


def test_constrained_decoding_needs_no_torch(bundle):
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
import hexforge
r = hexforge.load({str(bundle('llama'))!r}).generate(
    'x', max_new_tokens=40, seed=0, response_format={{"type": "regex", "regex": "[a-z]{{3}}"}})
print(r.text)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and len(out.stdout.strip()) == 3, out.stderr


def test_the_loop_hands_out_at_most_max_new_tokens_and_stops_its_source():
    """runtime/loop.emit, the loop every runtime shares: a source that runs on past the request's
    length (Genie's lade dialog ignores max-num-tokens) is cut on the host and closed, and the
    pieces joined are the tokens' text; an EOS ends it before the length."""
    from hexforge.runtime.loop import Stops, emit

    class Source:
        def __init__(self):
            self.read, self.closed = 0, False

        def __iter__(self):
            return self

        def __next__(self):  # 50 tokens: a loop without the cut fails, not hangs
            if self.read == 50:
                raise StopIteration
            self.read += 1
            return 100 + self.read % 7, None

        def close(self):
            self.closed = True

    class Detok:
        def add(self, token):
            return f"<{token}>"

        def flush(self):
            return ""

    def run(eos):
        src, pieces = Source(), []
        gen = emit(src, Detok(), Stops(eos, StopStrings([])), 5)
        while True:
            try:
                pieces.append(next(gen).text)
            except StopIteration as end:
                return src, pieces, end.value

    src, pieces, out = run(set())
    assert out.tokens == [101, 102, 103, 104, 105] and out.finish == "length"
    assert src.read == 5 and src.closed and "".join(pieces) == out.text
    src, pieces, out = run({103})
    assert out.tokens == [101, 102] and out.finish == "stop" and src.closed
