"""The reliability + security suite: one test (or parametrized group) per numbered check in
RELIABILITY.md, named ``test_check_NN_...``. Where an older test already pins part of a check, the
docstring names it and the test here covers the rest (the server, the next request, the sizes)."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import hexforge
from hexforge.bundle.errors import (
    BackendError,
    BundleError,
    CheckpointError,
    ContextOverflowError,
    MediaError,
    RequestError,
)
from hexforge.bundle.manifest import load_manifest
from tests.conftest import CONTEXT, prompt_ids


def hexforge_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "hexforge", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def one_line_exit_2(r, native_noise: bool = False) -> str:
    """Exit code 2, no traceback, exactly one 'hexforge: error:' line (native QNN / ORT libraries
    may print their own log lines before it; ``native_noise`` allows those)."""
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert "Traceback" not in r.stderr and lines and lines[-1].startswith("hexforge: error: ")
    assert len(lines) == 1 or native_noise, r.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def model(bundle):
    return hexforge.load(bundle("llama"))


@pytest.fixture(scope="module")
def client(model):
    from fastapi.testclient import TestClient

    from hexforge.commands.serve import create_app

    return TestClient(create_app(model, "tiny"))


@pytest.fixture(scope="module")
def live(model):
    """A real uvicorn server in a thread (disconnects and concurrency need a real socket)."""
    import uvicorn

    from hexforge.commands.serve import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(model, "tiny"), host="127.0.0.1", port=port,
                                           log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(timeout=10)


@pytest.fixture
def copy_of(tmp_path):
    def make(src: Path) -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(src, dst, symlinks=True)
        return dst

    return make


# ---- 1 ---------------------------------------------------------------------------------------
def test_check_01_context_overflow_names_both_numbers_and_the_next_request_works(model, client):
    """Also: test_cli.test_prompt_longer_than_context_names_both_numbers (CLI exit 2)."""
    ids = prompt_ids(CONTEXT - 10)
    with pytest.raises(ContextOverflowError) as e:
        model.generate(ids, max_new_tokens=11)
    msg = str(e.value)
    assert f"{CONTEXT - 10} tokens" in msg and "max_new_tokens 11" in msg and str(CONTEXT) in msg
    # exactly at the limit is not silently truncated, it runs whole
    r = model.generate(ids, max_new_tokens=10, ignore_eos=True)
    assert len(r.token_ids) == 10 and r.finish_reason == "length"
    body = {"prompt": ids, "max_tokens": 11}
    r = client.post("/v1/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert f"{CONTEXT - 10} tokens" in err["message"] and "max_new_tokens 11" in err["message"]
    ok = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


# ---- 2 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": [-1, 5]}),
    ("/v1/completions", {"prompt": [10**6]}),
    ("/v1/completions", {"prompt": [1.5, 2]}),
    ("/v1/completions", {"prompt": 3.5}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "x", "max_tokens": -4}),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}),
    ("/v1/completions", {"prompt": "x", "stop": 5}),
    ("/v1/completions", {"prompt": "x", "stop": [""]}),
    ("/v1/completions", {"prompt": "x", "seed": "s"}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"messages": ["not an object"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "video"}]}]}),
    ("/v1/chat/completions", None),  # not JSON at all
])
def test_check_02_bad_requests_are_400_with_an_openai_error_body(client, path, body):
    """Also: test_runtime.test_bad_requests_are_typed_errors (Python API: typed RequestError)."""
    if body is None:
        r = client.post(path, content=b"{not json", headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and "\n" not in err["message"]
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_check_02_bad_requests_via_the_api_and_cli(model, bundle):
    for kw in ({"max_new_tokens": 0}, {"max_new_tokens": -1}, {"max_new_tokens": "4"},
               {"max_new_tokens": 2.5}, {"top_p": 0.0}, {"stop": [""]}):
        with pytest.raises(RequestError):
            model.generate("hi", **kw)
    for bad in (None, 3, [1, "2"], {"a": 1}):
        with pytest.raises(RequestError):
            model.generate(bad, max_new_tokens=2)
    for msgs in ([], [{"role": "user"}], [{"content": "x"}], "hi", [{"role": 1, "content": "x"}]):
        with pytest.raises(RequestError):
            model.chat(msgs, max_new_tokens=2)
    assert "max_new_tokens must be >= 1" in one_line_exit_2(
        hexforge_cli("run", bundle("llama"), "hi", "-n", "0"))


# ---- 3 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_check_03_streamed_utf8_chunks_join_to_the_non_streamed_text(client, path):
    """Also: test_runtime.test_streamed_chunks_are_valid_utf8_and_join_to_the_full_text (API)."""
    text = "東京は日本の首都です。🚀🔥 Ünïcödé 서울 北京"
    body = {"max_tokens": 40, "temperature": 0.9, "seed": 11}
    body |= ({"prompt": text} if path == "/v1/completions"
             else {"messages": [{"role": "user", "content": text}]})
    whole = client.post(path, json=body).json()["choices"][0]
    whole = whole.get("text", whole.get("message", {}).get("content"))
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        raw = b"".join(r.iter_bytes())
    lines = [x for x in raw.decode("utf-8", errors="strict").split("\n") if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    pieces = []
    for x in lines[:-1]:
        c = json.loads(x[6:])["choices"][0]
        piece = c.get("text", c.get("delta", {}).get("content")) or ""
        piece.encode("utf-8", errors="strict")  # no lone surrogates: valid UTF-8 on its own
        pieces.append(piece)
    assert "".join(pieces) == whole


# ---- 4 ---------------------------------------------------------------------------------------
def test_check_04_stop_strings_cut_exactly_and_finish_reasons(model, client):
    """Also: test_generation.test_stop_strings_cut_exactly (spanning / mid-token, unit) and
    test_stop_string_through_the_api_and_stream_agree (API)."""
    ids = prompt_ids(6)
    full = model.generate(ids, max_new_tokens=40, ignore_eos=True).text
    detok = model.tokenizer
    toks = model.generate(ids, max_new_tokens=40, ignore_eos=True).token_ids
    # a stop string that starts inside one token and ends inside a later one
    first = detok.decode(toks[:3])
    start = max(1, len(first) - 1)
    stop = full[start:start + 3]
    assert stop and len(stop) == 3
    want = full[:full.index(stop)]
    body = {"prompt": ids, "max_tokens": 40, "stop": [stop], "temperature": 0}
    model.generation.eos_token_ids, saved = [], model.generation.eos_token_ids
    try:
        r = client.post("/v1/completions", json=body).json()["choices"][0]
        assert r["text"] == want and r["finish_reason"] == "stop"
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            chunks = [json.loads(x[6:]) for x in s.iter_lines()
                      if x.startswith("data: ") and x != "data: [DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5}).json()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5
    finally:
        model.generation.eos_token_ids = saved


# ---- 5 ---------------------------------------------------------------------------------------
def test_check_05_same_seed_same_output_alone_and_among_concurrent_requests(live):
    """Also: test_runtime.test_same_seed_same_output_and_top_k_1_is_greedy (alone, API)."""
    import httpx

    a = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 1.0, "top_p": 0.9,
         "seed": 7}
    b = {"prompt": "東京は", "max_tokens": 24, "temperature": 1.3, "seed": 8}
    c = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0.8}
    with httpx.Client(base_url=live, timeout=60) as h:
        alone = h.post("/v1/completions", json=a).json()["choices"][0]["text"]
        jobs = [("/v1/completions", a), ("/v1/completions", b), ("/v1/chat/completions", c),
                ("/v1/completions", {**a, "stream": True}), ("/v1/completions", a),
                ("/v1/completions", b)]

        def send(job):
            path, body = job
            if body.get("stream"):
                with h.stream("POST", path, json=body) as r:
                    lines = [x for x in r.iter_lines() if x.startswith("data: {")]
                return "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines)
            return h.post(path, json=body).json()["choices"][0]

        with ThreadPoolExecutor(len(jobs)) as pool:
            out = list(pool.map(send, jobs))
    assert out[0]["text"] == out[4]["text"] == out[3] == alone
    assert out[1]["text"] == out[5]["text"] != alone


# ---- 6 ---------------------------------------------------------------------------------------
def test_check_06_client_disconnect_stops_generation_and_frees_the_engine(live, model, monkeypatch):
    import httpx

    real_decode = model.engine.decode

    def slow_decode(token, **kw):  # 25 ms per token: 200 tokens would take 5 s
        time.sleep(0.025)
        return real_decode(token, **kw)

    ended: list[tuple[float, int, str]] = []
    real_iterate = model.iterate

    def watched(*a, **kw):
        from hexforge.runtime.options import Done, Piece

        n, reason = 0, "?"
        try:
            for item in real_iterate(*a, **kw):
                n += isinstance(item, Piece) and item.token is not None
                if isinstance(item, Done):
                    reason = item.result.finish_reason
                yield item
        finally:
            ended.append((time.monotonic(), n, reason))

    monkeypatch.setattr(model.engine, "decode", slow_decode)
    monkeypatch.setattr(model, "iterate", watched)
    body = {"prompt": "Hello", "max_tokens": 200, "stream": True, "temperature": 0}
    with httpx.Client(base_url=live, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 4:
                    break
        closed = time.monotonic()  # leaving the block closes the connection mid-stream
    deadline = closed + 5
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ended, "generation kept running after the client left"
    _, n, reason = ended[0]
    # cancelled, not run out: 200 tokens would have ended it with "length"
    assert n < 100 and reason == "cancelled", (n, reason)
    # the engine is free: the next request is served
    monkeypatch.setattr(model.engine, "decode", real_decode)
    with httpx.Client(base_url=live, timeout=30) as h:
        assert h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


# ---- 7 ---------------------------------------------------------------------------------------
class _Evil:
    def __reduce__(self):  # unpickling this runs `touch PWNED`
        return (os.system, ("touch PWNED",))


_EVIL_PICKLE = pickle.dumps(_Evil())


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_check_07_pickle_checkpoint_refused(ckpt, tmp_path, weights):
    """Also: test_build.test_pickle_only_checkpoint_is_refused, test_cli.test_pickle_checkpoint_via_cli."""
    from hexforge.forge.pipeline import BuildOptions, build

    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt("llama"), dst)
    (dst / "model.safetensors").unlink()
    (dst / weights).write_bytes(_EVIL_PICKLE)
    with pytest.raises(CheckpointError, match=f"only pickle weights.*{weights}.*safetensors only"):
        build(dst, tmp_path / "out", BuildOptions(), log=lambda m: None)
    assert not (tmp_path / "out").exists()


def test_check_07_nothing_from_a_checkpoint_is_executed(ckpt, tmp_path, monkeypatch):
    """A pickle next to the safetensors and remote code named in config.json are never run."""
    from hexforge.families import load_family
    from hexforge.forge.source.checkpoint import read_checkpoint

    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt("llama"), dst)
    (dst / "pytorch_model.bin").write_bytes(_EVIL_PICKLE)
    (dst / "evil.py").write_text("import pathlib; pathlib.Path('PWNED').touch()\n")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.Evil", "AutoConfig": "evil.Evil"}
    (dst / "config.json").write_text(json.dumps(cfg))
    monkeypatch.chdir(tmp_path)
    c = read_checkpoint(dst)
    hf = load_family(c.model_type).FAMILY.load_hf(c.dir)
    assert hf is not None and not (tmp_path / "PWNED").exists()


# ---- 8 ---------------------------------------------------------------------------------------
def _st_header(n: int | None = None, header: bytes | None = None, data: bytes = b"") -> bytes:
    header = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}' if header is None else header
    return (len(header) if n is None else n).to_bytes(8, "little") + header + data


@pytest.mark.parametrize("name,blob", [
    ("huge_header_length", _st_header(n=2**62, data=b"\0" * 8)),
    ("header_longer_than_file", _st_header(n=10_000, data=b"\0" * 8)),
    ("shorter_than_8_bytes", b"\x10\0\0"),
    ("offsets_past_the_end", _st_header(header=b'{"w":{"dtype":"F32","shape":[2],'
                                               b'"data_offsets":[0,800000000000]}}', data=b"\0" * 8)),
    ("shape_not_matching_offsets", _st_header(header=b'{"w":{"dtype":"F32","shape":[1000000,1000000],'
                                                     b'"data_offsets":[0,8]}}', data=b"\0" * 8)),
    ("negative_offset", _st_header(header=b'{"w":{"dtype":"F32","shape":[2],'
                                           b'"data_offsets":[-8,0]}}', data=b"\0" * 8)),
    ("unknown_dtype", _st_header(header=b'{"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}}',
                                 data=b"\0" * 8)),
    ("not_json", _st_header(header=b"\xff\xfe{", data=b"")),
    ("truncated_data", _st_header(data=b"\0" * 3)),
])
def test_check_08_corrupted_safetensors_refused_before_any_allocation(tmp_path, monkeypatch, name,
                                                                      blob):
    import safetensors.numpy

    from hexforge.bundle.hostfile import load_host_tensors

    reached = []
    monkeypatch.setattr(safetensors.numpy, "load_file", lambda *a, **k: reached.append(a))
    p = tmp_path / "host.safetensors"
    p.write_bytes(blob)
    with pytest.raises(BundleError, match=r"host tensors host\.safetensors are corrupted") as e:
        load_host_tensors(p)
    assert "\n" not in str(e.value)
    assert not reached  # refused by our header check, before the library maps or allocates


@pytest.mark.parametrize("listed", [False, True])
@pytest.mark.parametrize("damage", ["manifest_deep_json", "manifest_bad_bind", "graph_truncated",
                                    "graph_garbage", "weights_truncated", "host_header_lies"])
def test_check_08_corrupted_bundle_files_are_clean_errors(bundle, copy_of, damage, listed):
    """Also: test_bundle_contract.test_not_json_and_wrong_types_are_refused; the fuzz harness
    (tests/test_fuzz.py) runs the same loaders on mutated inputs. listed: the manifest's file
    list (check 16) names a damaged file first; without one (a schema-1 bundle) the loaders'
    own checks do, as here."""
    b = copy_of(bundle("llama"))
    m = json.loads((b / "manifest.json").read_text())
    if not listed:
        del m["file_records"]
        m["schema_version"] = 1
        (b / "manifest.json").write_text(json.dumps(m))
    if damage == "manifest_deep_json":  # found by the fuzzer: RecursionError escaped
        (b / "manifest.json").write_text("[" * 100_000)
        match = "nests JSON too deeply"
    elif damage == "manifest_bad_bind":
        m["targets"]["cpu"]["graphs"][0]["inputs"][1]["bind"] = "rope_cos:nonesuch"
        (b / "manifest.json").write_text(json.dumps(m))
        match = "bind 'rope_cos:nonesuch' names rope 'nonesuch'"
    elif damage.startswith("graph"):
        g = b / "cpu" / "s0.decode.onnx"
        data = g.read_bytes()
        g.write_bytes(data[:len(data) // 2] if damage == "graph_truncated" else os.urandom(len(data)))
        match = "s0.decode"
    elif damage == "weights_truncated":
        w = b / "cpu" / "s0.weights"
        w.write_bytes(w.read_bytes()[:1000])
        match = "truncated or corrupted"
    else:
        h = b / "host.safetensors"
        data = bytearray(h.read_bytes())
        data[:8] = (2**40).to_bytes(8, "little")
        h.write_bytes(bytes(data))
        match = "header claims"
    if listed and damage not in ("manifest_deep_json", "manifest_bad_bind"):
        match = r"bundle file \S+ is (truncated or )?corrupted .*verify .* --files"
    with pytest.raises(BundleError, match=match) as e:
        hexforge.load(b)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bind,why", [
    ("hiddenz", "not a known source"),
    ("tail:x", "integer"),
    ("tail:0", "integer"),
    ("state:L99.k", "names state 'L99.k'"),
    ("new:nope", "names state 'nope'"),
    ("mask:sliding", "names mask 'sliding'"),
    ("host:ple", "names host 'ple'"),
    ("media:pixel_values", "only encoder inputs"),
    ("eval:__import__('os')", "unknown kind 'eval'"),
])
def test_check_08_manifest_binds_are_validated_on_load(bundle, copy_of, bind, why):
    b = copy_of(bundle("llama"))
    m = json.loads((b / "manifest.json").read_text())
    m["targets"]["cpu"]["graphs"][0]["inputs"][-1]["bind"] = bind
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=f"invalid manifest.*bind {re.escape(repr(bind))}.*{why}"):
        load_manifest(b)


def test_check_08_every_bind_of_every_family_bundle_is_known(bundle):
    """The validator accepts what a family really emits (every other family's bundle is loaded,
    so validated, by its own test file: gemma4 host:/new:, qwen3_5 valid/tail:)."""
    from hexforge.bundle.manifest import bind_problem

    for fam in ("llama",):
        m = load_manifest(bundle(fam))
        names = {"host": {e.name for e in m.host.extra_embeds}, "rope": {r.name for r in m.host.ropes},
                 "mask": {g.name for g in m.mask_groups}, "state": {s.name for s in m.state}}
        for t in m.targets.values():
            for g in t.graphs:
                for spec, out in [(i, False) for i in g.inputs] + [(o, True) for o in g.outputs]:
                    assert bind_problem(spec.bind, names, False, out) is None, (fam, spec.bind)
    encoder = {"host": set(), "rope": set(), "mask": set(), "state": set()}
    for bind in ("media:pixel_values", "soft", "deepstack:0"):
        assert bind_problem(bind, encoder, True, bind == "soft") is None
    assert bind_problem("deepstack:2", encoder, True, True) is None


# ---- 9 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["chat_template", "tokenizer_config", "manifest", "host_tensors",
                                  "external_weights", "tokenizer_dir"])
def test_check_09_symlinks_out_of_the_bundle_are_refused(bundle, copy_of, tmp_path, what):
    """Also: test_bundle_contract (absolute, '..', symlinked graph, external data outside)."""
    b = copy_of(bundle("llama"))
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("{{ 'leaked' }}")
    target = {"chat_template": b / "tokenizer" / "chat_template.jinja",
              "tokenizer_config": b / "tokenizer" / "tokenizer_config.json",
              "manifest": b / "manifest.json", "host_tensors": b / "host.safetensors",
              "external_weights": b / "cpu" / "s0.weights", "tokenizer_dir": b / "tokenizer"}[what]
    if target.is_dir():
        shutil.copytree(target, outside / "tok")
        shutil.rmtree(target)
        os.symlink(outside / "tok", target)
    else:
        shutil.copy(target, outside / target.name) if target.exists() else None
        target.unlink(missing_ok=True)
        os.symlink(outside / target.name if (outside / target.name).exists() else secret, target)
    with pytest.raises(BundleError, match="outside the bundle"):
        hexforge.load(b)


def test_check_09_symlinks_inside_the_bundle_still_load(bundle, copy_of):
    b = copy_of(bundle("llama"))
    (b / "cpu" / "head.onnx").rename(b / "cpu" / "head.real.onnx")
    os.symlink("head.real.onnx", b / "cpu" / "head.onnx")
    assert hexforge.load(b).generate("Hi", max_new_tokens=2).token_ids


# ---- 10 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [
    "{{ cycler.__init__.__globals__.os.popen('touch PWNED').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ messages.append(1) }}{{ messages[0].update({'role': 'x'}) }}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os.system('touch PWNED') }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'a' * 10**10 }}",
    "{{ 10 ** (10 ** 10) }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ raise_exception('no system role allowed') }}",
])
def test_check_10_hostile_chat_template_raises_in_the_sandbox(model, client, tmp_path, monkeypatch,
                                                              template):
    from hexforge.runtime.text import ChatTemplate

    monkeypatch.chdir(tmp_path)
    saved = model.chat_template
    model.chat_template = ChatTemplate(template, None, None)
    try:
        with pytest.raises(RequestError, match="chat template"):  # refused, not ground through
            model.chat([{"role": "user", "content": "hi"}], max_new_tokens=2)
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    finally:
        model.chat_template = saved
    assert not (tmp_path / "PWNED").exists()
    assert model.chat([{"role": "user", "content": "hi"}], max_new_tokens=2).token_ids is not None


# ---- 11 --------------------------------------------------------------------------------------
def _png(size=(8, 6), mode="RGB", color=(10, 20, 30)) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new(mode, size, color).save(b, "PNG")
    return b.getvalue()


def _empty_file(p: Path) -> Path:
    p.write_bytes(b"")
    return p


def _png_claiming(w: int, h: int) -> bytes:
    """A real 1x1 PNG whose IHDR (CRC fixed up) claims w x h: a decompression bomb's header."""
    import struct
    import zlib

    data = bytearray(_png((1, 1)))
    data[16:24] = struct.pack(">II", w, h)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _wav(seconds: float, rate: int = 16000, channels: int = 1, fmt: str = "WAV") -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    x = np.stack([0.5 * np.sin(2 * np.pi * 440 * t + c) for c in range(channels)], 1)
    b = io.BytesIO()
    sf.write(b, x.astype(np.float32), rate, format=fmt)
    return b.getvalue()


@pytest.mark.parametrize("case,match", [
    ("bomb", "pixels, over the cap|decompression bomb"),
    ("huge_bomb", "decompression bomb|over the cap"),
    ("over_cap", r"100x100 = 10,000 pixels, over the cap of 5,000"),
    ("eps", "not an image in a supported format"),
    ("svg", "not an image in a supported format"),
    ("text", "not an image in a supported format"),
    ("empty_bytes", "empty"),
    ("empty_file", "empty"),
    ("directory", "not a regular file"),
    ("truncated", "cannot be decoded|malformed"),
    ("bad_data_url", "not valid base64"),
])
def test_check_11_bad_images_refused_before_decoding(tmp_path, monkeypatch, case, match):
    from PIL import ImageFile

    from hexforge.runtime.media import load_image

    decoded = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load",
                        lambda self: decoded.append(1) or real_load(self))
    src: object = {
        "bomb": lambda: _png_claiming(20_000, 20_000),
        "huge_bomb": lambda: _png_claiming(2**30, 2**30),
        "over_cap": lambda: _png((100, 100)),
        "eps": lambda: b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",
        "svg": lambda: b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
        "text": lambda: b"hello, this is not an image",
        "empty_bytes": lambda: b"",
        "empty_file": lambda: _empty_file(tmp_path / "e.png"),
        "directory": lambda: str(tmp_path),
        "truncated": lambda: _png((64, 64), color=(1, 2, 3))[:60],
        "bad_data_url": lambda: "data:image/png;base64,@@@",
    }[case]()
    with pytest.raises(MediaError, match=match) as e:
        load_image(src, max_pixels=5_000 if case == "over_cap" else 50_000_000)
    assert "\n" not in str(e.value)
    if case != "truncated":
        assert not decoded  # refused from the header


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P_transparent", "L", "CMYK", "RGB"])
def test_check_11_images_convert_to_rgb_like_hf(tmp_path, mode):
    """RGB conversion matches transformers' convert_to_rgb (alpha composited onto white)."""
    import base64

    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    from hexforge.runtime.media import load_image

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (5, 7, 4), dtype=np.uint8)
    img = Image.fromarray(arr, "RGBA")
    if mode == "P_transparent":
        img = img.convert("RGB").quantize(8)
        img.info["transparency"] = 3
    elif mode != "RGBA":
        img = img.convert(mode)
    fmt = "TIFF" if mode == "CMYK" else "PNG"
    buf = io.BytesIO()
    img.save(buf, fmt, **({"transparency": 3} if mode == "P_transparent" else {}))
    data = buf.getvalue()
    got = load_image(data)
    want = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    assert got.mode == "RGB" and got.size == (7, 5)
    assert np.array_equal(np.asarray(got), want)
    # the same from a path and from a data URL
    (tmp_path / "i").write_bytes(data)
    assert np.array_equal(np.asarray(load_image(tmp_path / "i")), want)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert np.array_equal(np.asarray(load_image(url)), want)


@pytest.mark.parametrize("case,match", [
    ("not_audio", "not an audio file"),
    ("png", "not an audio file"),
    ("empty_bytes", "empty"),
    ("zero_frames", "holds no audio"),
    ("too_long", r"2\.00 s long, longer than the 1 s"),
    ("absurd_rate", "sample rate of 5 Hz"),
    ("nan_samples", "NaN or infinite"),
])
def test_check_11_bad_audio_refused_before_decoding(monkeypatch, case, match):
    import soundfile as sf

    from hexforge.runtime.media import load_audio

    reads = []
    real_read = sf.SoundFile.read
    monkeypatch.setattr(sf.SoundFile, "read", lambda self, *a, **k: reads.append(1) or
                        real_read(self, *a, **k))
    if case == "absurd_rate":
        data = bytearray(_wav(0.1))
        data[24:28] = (5).to_bytes(4, "little")  # the fmt chunk's sample rate
        data = bytes(data)
    elif case == "nan_samples":
        b = io.BytesIO()
        sf.write(b, np.array([0.1, np.nan, 0.2], np.float32), 16000, format="WAV", subtype="FLOAT")
        data = b.getvalue()
    else:
        data = {"not_audio": b"RIFF\x10\0\0\0WAVEjunkjunkjunk", "png": _png(), "empty_bytes": b"",
                "zero_frames": _wav(0.0), "too_long": _wav(2.0)}[case]
    with pytest.raises(MediaError, match=match) as e:
        load_audio(data, sampling_rate=16000, max_seconds=1.0)
    assert "\n" not in str(e.value)
    if case != "nan_samples":
        assert not reads  # refused from the header, no frame read


def test_check_11_audio_is_mono_float_resampled(tmp_path):
    from transformers.audio_utils import load_audio as hf_load_audio

    from hexforge.runtime.media import load_audio

    data = _wav(0.5, rate=8000, channels=2)
    x = load_audio(data, sampling_rate=16000, max_seconds=1.0)
    assert x.dtype == np.float32 and x.ndim == 1 and x.shape[0] == 8000
    (tmp_path / "a.wav").write_bytes(data)
    np.testing.assert_array_equal(x, hf_load_audio(str(tmp_path / "a.wav"), 16000,
                                                   backend="soundfile"))
    (tmp_path / "a.flac").write_bytes(_wav(0.25, rate=16000, fmt="FLAC"))
    y = load_audio(tmp_path / "a.flac", sampling_rate=16000, max_seconds=1.0)
    assert y.shape == (4000,)


# ---- 12 ------------------------------------------------------------------------------------------
@pytest.fixture
def htp_copy(htp_bundle, copy_of):
    return copy_of(htp_bundle("llama", "w8-fp16"))


@pytest.fixture
def no_session(monkeypatch):
    """Fails the test if ORT is asked to create a session: a check must fire before loading."""
    import onnxruntime as ort

    made = []

    def refuse(*a, **k):
        made.append(a)
        raise AssertionError("a session was created before the mismatch was named")

    monkeypatch.setattr(ort, "InferenceSession", refuse)
    return made


def _as_built(b: Path) -> None:
    """Files changed here recorded in the manifest's file list as they are, as a build that
    wrote them so would have (else check 16 names them as damaged before the check tested)."""
    from hexforge.bundle.bundlefiles import record

    m = json.loads((b / "manifest.json").read_text())
    m["file_records"] = [r.model_dump() for r in record(b)]
    (b / "manifest.json").write_text(json.dumps(m))


def _patch_bins(b: Path, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)
    for f in (b / "v81").glob("*.bin"):
        data = f.read_bytes()
        assert old in data
        f.write_bytes(data.replace(old, new))
    _as_built(b)


@pytest.mark.parametrize("mismatch,error,match", [
    ("binary_arch", BundleError, r"compiled for v79 \(SM8750\) but the bundle says v81 \(SM8850\)"),
    ("manifest_soc", BundleError, r"soc_model 69, which is not a v81 SoC \(SM8850"),
    ("binary_sdk", BackendError, r"QNN SDK 9\.99\.0, newer than the installed 2\.\d+"),
    ("manifest_sdk", BackendError, r"built with QNN SDK 9\.0\.0, newer than the installed"),
    ("device_arch", BackendError, r"built for v81 but the device is v79"),
])
def test_check_12_context_binary_mismatch_is_named_before_loading(htp_copy, no_session, mismatch,
                                                                 error, match):
    """Also: test_htp.test_arch_mismatch_fails_before_loading_naming_both and friends."""
    b = htp_copy
    kw = {"backend": "qnn-sim"}
    if mismatch == "binary_arch":
        _patch_bins(b, b"soc_type=SM8850;arch=81", b"soc_type=SM8750;arch=79")
    elif mismatch == "binary_sdk":
        _patch_bins(b, b"v2.51.0.", b"v9.99.0.")
    elif mismatch == "device_arch":
        kw["arch"] = "v79"
    else:
        m = json.loads((b / "manifest.json").read_text())
        if mismatch == "manifest_soc":
            m["targets"]["v81"]["soc_model"] = 69
        else:
            m["targets"]["v81"]["qnn_sdk"] = "9.0.0"
        (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(error, match=match) as e:
        hexforge.load(b, **kw)
    assert "\n" not in str(e.value) and not no_session


# ---- 13 ------------------------------------------------------------------------------------------
def test_check_13_context_oom_is_reported_with_sizes_and_the_process_lives(htp_copy, monkeypatch):
    """The simulator does not run out of HTP memory on tiny graphs, so the error QNN gives on a
    device (seen in the seeds: 3.6 GB contexts on v81) is injected at session creation."""
    import onnxruntime as ort

    real = ort.InferenceSession
    calls = []

    def oom(*a, **k):
        calls.append(a)
        raise RuntimeError(
            "[ONNXRuntimeError] : 1 : FAIL : QNN EP: Failed to create context from binary.\n"
            "QnnContext_createFromBinary failed, error QNN_COMMON_ERROR_MEM_ALLOC (1002 / 0x3ea)")

    monkeypatch.setattr(ort, "InferenceSession", oom)
    with pytest.raises(BackendError) as e:
        hexforge.load(htp_copy, backend="qnn-sim")
    msg = str(e.value)
    m = json.loads((htp_copy / "manifest.json").read_text())["targets"]["v81"]
    g = m["graphs"][0]
    bin_size = next((htp_copy / "v81").glob(f"{g['name']}.ctx_qnn.bin")).stat().st_size
    assert "out of memory" in msg and "1002" in msg and "\n" not in msg
    assert f"context binary {bin_size:,} B" in msg and f"{g['bytes']:,} B" in msg
    assert "ceiling" in msg and "--max-shard-bytes" in msg
    monkeypatch.setattr(ort, "InferenceSession", real)
    r = hexforge.load(htp_copy, backend="qnn-sim").generate(prompt_ids(5), max_new_tokens=2,
                                                             ignore_eos=True)
    assert len(r.token_ids) == 2  # the same process goes on



def test_regression_a_target_over_the_simulators_room_is_not_told_to_shrink_its_shards(
        htp_copy, monkeypatch):
    """Gemma-4-E2B w8-fp16 (v81: 4 contexts of 1.0-1.4 GB, 4.9 GB in all) failed on qnn-sim at
    its fourth context with QNN 1002 and was told to rebuild with a smaller --max-shard-bytes:
    each context fit, their sum did not (the x86 simulator holds a process's contexts in one
    HTP process domain). The error now says that. (The failure is replayed: a tiny bundle fits.)"""
    import onnxruntime as ort

    from hexforge.runtime import backends
    from hexforge.runtime.genie import libgenie as genie

    def oom(*a, **k):
        raise RuntimeError("contextCreateFromBinary failed. Error: QNN_COMMON_ERROR_MEM_ALLOC")

    monkeypatch.setattr(ort, "InferenceSession", oom)
    monkeypatch.setattr(backends, "X86_PD_LOADED_BYTES", 1)  # this tiny target is over "the room"
    with pytest.raises(BackendError) as e:
        hexforge.load(htp_copy, backend="qnn-sim")
    msg = str(e.value)
    assert "\n" not in msg and "one HTP process domain" in msg and "--max-shard-bytes" not in msg
    assert f"{genie.X86_PD_REFUSED_BYTES / 1e9:.2f} GB did not" in msg

# ---- 14 ------------------------------------------------------------------------------------------
def _add_cpu_only_node(ctx: Path) -> None:
    """Append a Trilu (not claimed by the HTP) after the EPContext node of a compiled graph."""
    import onnx
    from onnx import helper

    m = onnx.load(str(ctx))
    out = m.graph.output[0]
    ep = next(n for n in m.graph.node if n.op_type == "EPContext")
    i = list(ep.output).index(out.name)
    ep.output[i] = out.name + "_pre"
    vi = onnx.ValueInfoProto()
    vi.CopyFrom(out)
    vi.name = out.name + "_pre"
    m.graph.value_info.append(vi)
    m.graph.node.append(helper.make_node("Trilu", [vi.name], [out.name], upper=0))
    onnx.save(m, str(ctx))


def test_check_14_graph_that_would_split_onto_cpu_is_refused_naming_the_split(htp_copy):
    """Also: test_htp.test_graph_with_a_node_the_htp_rejects_fails_to_compile (build side)."""
    _add_cpu_only_node(htp_copy / "v81" / "head.ctx.onnx")
    _as_built(htp_copy)
    with pytest.raises(BackendError) as e:
        hexforge.load(htp_copy, backend="qnn-sim")
    msg = str(e.value)
    assert "v81/head.ctx.onnx" in msg and "1 of 2 nodes on the CPU (Trilu x1), 1 on the HTP" in msg
    assert "--allow-cpu-fallback" in msg and "\n" not in msg
    r = hexforge_cli("run", htp_copy, "Hi", "-n", "2", "--backend", "qnn-sim")
    assert "1 of 2 nodes on the CPU" in one_line_exit_2(r, native_noise=True)
    with pytest.warns(UserWarning, match=r"head.ctx.onnx.*1 of 2 nodes on the CPU \(Trilu x1\)"):
        model = hexforge.load(htp_copy, backend="qnn-sim", allow_cpu_fallback=True)
    assert len(model.generate(prompt_ids(5), max_new_tokens=2, ignore_eos=True).token_ids) == 2


# ---- 15 ------------------------------------------------------------------------------------------
def test_check_15_interrupted_build_leaves_no_bundle_and_a_rerun_works(ckpt, tmp_path, monkeypatch):
    from hexforge.forge import pipeline
    from hexforge.forge.pipeline import BuildOptions, build

    opts = BuildOptions(context=64, prefill_len=8, verify=False)
    out = tmp_path / "b"

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:  # Ctrl-C in the middle: after tokenizer + host tensors
        mp.setattr(pipeline, "export_float", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            build(ckpt("llama"), out, opts, log=lambda m: None)
    assert not out.exists() and not list(tmp_path.glob(".b.*"))
    with monkeypatch.context() as mp:  # disk full while writing the manifest
        def full(*a, **k):
            raise OSError(28, "No space left on device")

        mp.setattr(pipeline, "save_manifest", full)
        with pytest.raises(OSError, match="No space left"):
            build(ckpt("llama"), out, opts, log=lambda m: None)
    assert not out.exists() and not list(tmp_path.glob(".b.*"))

    # an interrupted *re*build keeps the old bundle whole (the swap happens only at the end)
    build(ckpt("llama"), out, opts, log=lambda m: None)
    before = load_manifest(out)
    with monkeypatch.context() as mp:
        mp.setattr(pipeline, "export_float", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            build(ckpt("llama"), out, opts, log=lambda m: None)
    assert load_manifest(out) == before and hexforge.load(out).generate("Hi", max_new_tokens=2)


def test_check_15_kill_9_mid_build_leaves_no_loadable_bundle(ckpt, tmp_path):
    from hexforge.forge.pipeline import BuildOptions, build

    out = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "-m", "hexforge", "build", str(ckpt("llama")), "-o",
                             str(out), "--context", "64", "--prefill-len", "8", "--no-verify"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        # mid-way: the temp dir has host tensors and some graphs, but not the manifest yet
        while not list(tmp_path.glob(".b.partial-*/cpu/*.onnx")):
            assert proc.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    partial = list(tmp_path.glob(".b.partial-*"))
    assert partial and not out.exists()  # the half-written dir is not at the output path
    with pytest.raises(BundleError):
        load_manifest(out)
    assert one_line_exit_2(hexforge_cli("run", out, "hi"))
    built = build(ckpt("llama"), out, BuildOptions(context=64, prefill_len=8, verify=False),
                  log=lambda m: None)
    assert hexforge.load(built).generate("Hi", max_new_tokens=2).token_ids
    assert not any(p.exists() for p in partial)  # the killed build's temp dir was cleaned up
