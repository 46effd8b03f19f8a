"""``hexforge serve`` over a real socket: the official ``openai`` client, concurrency, disconnects,
constrained output and multi-byte streaming, against a tiny llama bundle served by uvicorn in a
thread (the same app ``hexforge serve`` runs)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

import hexforge
from tests.test_generation import PET

KEY = "sekret"
MSGS = [{"role": "user", "content": "Tell me a story."}]
SCHEMA = PET  # the nested schema the generation tests constrain to


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(bundle):
    """(base url, the served Model) for a uvicorn server on 127.0.0.1 in a thread."""
    import uvicorn

    from hexforge.commands.serve import create_app

    model = hexforge.load(bundle("llama"))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(model, "tiny", api_key=KEY), host="127.0.0.1",
                                        port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", model
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(client, seed: int, stream: bool = False, **kw):
    """-> (text, finish_reason); streamed pieces joined when stream."""
    args = dict(model="tiny", messages=MSGS, max_tokens=kw.pop("max_tokens", 24),
                temperature=kw.pop("temperature", 1.0), seed=seed, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **args):
        c = chunk.choices[0]
        pieces.append(c.delta.content or "")
        finish = c.finish_reason or finish
    return "".join(pieces), finish


def test_openai_client_stream_equals_non_stream_and_models(client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    text, finish = chat(client, seed=7)
    assert text and finish in ("stop", "length")
    assert chat(client, seed=7, stream=True) == (text, finish)
    assert chat(client, seed=8)[0] != text  # the seed matters: not a constant answer


def test_openai_client_needs_the_api_key(server):
    bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    assert e.value.status_code == 401


def test_openai_client_json_schema_response_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for seed in range(4):
        for stream in (False, True):
            text, finish = chat(client, seed, stream, max_tokens=200, response_format=fmt)
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)
    # an unbounded object: a random model may still be writing at max_tokens; that is "length"
    finishes = set()
    for seed in range(4):
        text, finish = chat(client, seed, max_tokens=100, response_format={"type": "json_object"})
        finishes.add(finish)
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert finish == "length" and text.startswith("{")
    assert finishes == {"stop", "length"}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        chat(client, 0, response_format={"type": "json_schema", "json_schema": {"schema": {
            "type": "strin"}}})


def test_16_concurrent_streams_each_equal_their_solo_output(client):
    seeds = range(100, 116)
    solo = {s: chat(client, s, max_tokens=16) for s in seeds}
    with ThreadPoolExecutor(16) as pool:
        together = dict(zip(seeds, pool.map(lambda s: chat(client, s, stream=True, max_tokens=16),
                                            seeds), strict=True))
    assert together == solo
    assert len({t for t, _ in solo.values()}) > 8  # distinct requests, not one answer 16 times


def test_disconnected_streams_free_the_engine_for_the_next_request(server, client):
    url, model = server
    decodes = []
    engine_decode = model.engine.decode
    # 2 ms a token, as a small real model (the tiny one decodes ~4600 tok/s: its 229 tokens took
    # less than noticing the closed socket, so the count below failed about half the runs)
    model.engine.decode = lambda token, **kw: (decodes.append(1) or time.sleep(0.002)
                                               or engine_decode(token, **kw))
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 230, "ignore_eos": True,
            "stream": True, "temperature": 1.0}

    def read_then_leave(seed: int) -> None:
        with httpx.Client(timeout=30) as h, h.stream(
                "POST", url + "/v1/chat/completions", json={**body, "seed": seed},
                headers={"Authorization": f"Bearer {KEY}"}) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    n += 1
                    if n == 3:
                        break  # leaving the with-blocks closes the socket mid-stream

    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(read_then_leave, range(4)))
        stream = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, seed=3,
                                                temperature=1.0, stream=True)
        for chunk in stream:
            if chunk.choices[0].delta.content:
                break
        text = chunk.choices[0].delta.content + "".join(c.choices[0].delta.content or ""
                                                         for c in stream)
    finally:
        model.engine.decode = engine_decode
    # without cancellation each of the 4 would decode 229 tokens before the next request ran
    assert len(decodes) < 2 * 229, len(decodes)
    assert text == chat(client, seed=3, max_tokens=8)[0]  # and it still serves correctly


def test_multibyte_stream_chunks_are_whole_characters(server, client):
    # a regex of CJK and emoji makes the random model write them; byte-level BPE splits them
    # across tokens, so the stream must hold partial characters back
    fmt = {"type": "regex", "regex": "[東京北中国日本首都🚀🔥は의]{12}"}
    outputs, split = [], False
    for seed in range(3):
        whole, _ = chat(client, seed, max_tokens=60, response_format=fmt)
        outputs.append(whole)
        pieces = []
        for chunk in client.chat.completions.create(
                model="tiny", messages=MSGS, max_tokens=60, seed=seed, temperature=1.0,
                stream=True, response_format=fmt):
            if chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        for p in pieces:
            p.encode("utf-8")  # strict: a lone surrogate or half a character raises
            assert "\ufffd" not in p
        assert "".join(pieces) == whole and len(whole) == 12
        ids = server[1].chat(MSGS, max_new_tokens=60, seed=seed, temperature=1.0,
                             response_format=fmt).token_ids  # the same tokens, in-process
        split |= any("\ufffd" in server[1].tokenizer.decode([t]) for t in ids)
    assert split, "no token split a character: the test would not test the detokenizer"
    assert any(ord(c) > 0xFFFF for c in "".join(outputs))  # emoji (4 bytes) came out


def test_an_unknown_model_is_refused_as_openais_api_refuses_it(client):
    """``model="gpt-4"`` was served silently by the bundle: now OpenAI's 404 model_not_found,
    naming the model that is served; the served name and no name at all are answered."""
    for call in (lambda m: client.chat.completions.create(model=m, messages=MSGS, max_tokens=2),
                 lambda m: client.completions.create(model=m, prompt="Hi", max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as e:
            call("gpt-4")
        assert e.value.status_code == 404 and e.value.code == "model_not_found"
        assert "`gpt-4` does not exist" in e.value.message and "`tiny`" in e.value.message
        assert call("tiny").choices
    r = httpx.post(f"{client.base_url}chat/completions", json={"messages": MSGS, "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_hexforge_serve_says_where_it_listens_and_serves_the_openai_client(bundle, tmp_path):
    """``hexforge serve`` printed nothing: now one line with the address (``--port 0``: the one
    the system gave), the model name to send and the backend; the official client then talks
    to it by that line alone. A port in use is one line and exit code 2, not uvicorn's log."""
    import re
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "hexforge", "serve", str(bundle("llama")),
                             "--port", "0", "--model-name", "tiny-llama"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        m = re.search(r"^hexforge serve: tiny-llama \(llama, backend cpu, target cpu\) at "
                      r"(http://127\.0\.0\.1:(\d+)/v1) .*model='tiny-llama'", line)
        assert m, line
        url, port = m[1], int(m[2])
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 30
        while True:  # the line comes as the socket is bound; uvicorn's loop starts after it
            try:
                assert [x.id for x in c.models.list()] == ["tiny-llama"]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        r = c.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=4, seed=0)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 4
        busy = subprocess.run([sys.executable, "-m", "hexforge", "serve", str(bundle("llama")),
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
        assert busy.returncode == 2 and busy.stderr.count("\n") == 1, busy.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in busy.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
