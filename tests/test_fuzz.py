"""Fuzz harness (hypothesis) for every loader of untrusted bytes: the bundle manifest, the
safetensors host-tensor reader, ONNX graph files at session creation, and the media decoders.

Each target must either succeed or raise its typed error (BundleError / MediaError): any other
exception, a hang or a crash is a finding, and every finding becomes a ``test_regression_*`` below.

CI runs a bounded number of examples per target (about a minute in all on 2 cores). A longer run:

    HEXFORGE_FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz.py -p no:cacheprovider

(examples per target; hypothesis prints a reproducer for any failure).
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hexforge.bundle.errors import BundleError, MediaError, RequestError

EXAMPLES = int(os.environ.get("HEXFORGE_FUZZ_EXAMPLES", "300"))
# CI: the same examples every run; a long run (env var set) explores new ones each time
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize="HEXFORGE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) |
                    st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) |
                    st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@st.composite
def mutated(draw, base: bytes, max_ops: int = 6) -> bytes:
    """A few byte-level edits of a valid file: flips, truncation, insertions, deletions, and
    overwriting a spot with an extreme 8-byte integer (sizes and offsets live in headers)."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "int"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif op == "int":
            v = draw(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 2**62, 2**64 - 1]))
            data[pos:pos + 8] = v.to_bytes(8, "little")
    return bytes(data)


@pytest.fixture(scope="module")
def work(bundle, tmp_path_factory) -> Path:
    """A private copy of the llama bundle the fuzz targets overwrite file by file."""
    dst = tmp_path_factory.mktemp("fuzz") / "b"
    shutil.copytree(bundle("llama"), dst)
    return dst


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- the manifest ------------------------------------------------------------------------------
def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def test_fuzz_manifest_loader(work):
    from hexforge.bundle.manifest import load_manifest

    good = (work / "manifest.json").read_bytes()
    base = json.loads(good)
    paths = [p for p in _paths(base) if p]

    @FUZZ
    @given(st.data())
    def run(data):
        if data.draw(st.booleans()):  # structural: replace values anywhere with arbitrary JSON
            m = json.loads(good)
            for _ in range(data.draw(st.integers(1, 3))):
                path = data.draw(st.sampled_from(paths))
                node = m
                try:
                    for k in path[:-1]:
                        node = node[k]
                    node[path[-1]] = data.draw(JSON)
                except (KeyError, IndexError, TypeError):
                    pass  # an earlier edit removed this path
            blob = json.dumps(m).encode()
        else:  # byte-level
            blob = data.draw(mutated(good))
        (work / "manifest.json").write_bytes(blob)
        try:
            load_manifest(work)
        except BundleError as e:
            assert "\n" not in str(e)

    try:
        run()
    finally:
        (work / "manifest.json").write_bytes(good)


# ---- safetensors host tensors ------------------------------------------------------------------
@st.composite
def safetensors_blobs(draw, good: bytes) -> bytes:
    if draw(st.booleans()):
        return draw(mutated(good))
    # a well-formed file around a fuzzed header: lies about dtypes, shapes and offsets
    entry = st.fixed_dictionaries({
        "dtype": st.sampled_from(["F32", "F16", "I64", "U8", "BOOL", "Q4", ""]) | st.text(max_size=4),
        "shape": st.lists(st.integers(-2, 2**40) | st.sampled_from([0, 1, 3]), max_size=4) | JSON,
        "data_offsets": st.lists(st.integers(-8, 2**63), min_size=0, max_size=3) | JSON,
    })
    header = draw(st.dictionaries(st.text(max_size=6), entry | JSON, max_size=3))
    raw = json.dumps(header).encode()
    n = draw(st.sampled_from([len(raw), len(raw) + 1, 0, 2**64 - 1]) | st.integers(0, 2**64 - 1))
    return n.to_bytes(8, "little") + raw + draw(st.binary(max_size=64))


def test_fuzz_safetensors_reader(work, tmp_path):
    from hexforge.bundle.hostfile import load_host_tensors

    good = (work / "host.safetensors").read_bytes()
    path = tmp_path / "host.safetensors"
    rss0 = _peak_rss_mb()

    @FUZZ
    @given(safetensors_blobs(good))
    def run(blob):
        path.write_bytes(blob)
        try:
            tensors = load_host_tensors(path)
        except BundleError as e:
            assert "\n" not in str(e)
            return
        assert sum(a.nbytes for a in tensors.values()) <= len(blob)

    run()
    assert _peak_rss_mb() - rss0 < 500  # no example made a big allocation


# ---- ONNX graphs at session creation -----------------------------------------------------------
def external_weights(graph_path: Path) -> Path:
    """The weight file a graph's external initializers live in (a cpu head shares the last
    shard's)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    m = onnx.load(str(graph_path), load_external_data=False)
    ext = next(t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    return graph_path.parent / ExternalDataInfo(ext).location


def test_fuzz_truncated_and_corrupted_graphs(work):
    from hexforge.bundle.manifest import load_manifest
    from hexforge.runtime.backends import Backend

    m = load_manifest(work)
    target = m.targets["cpu"]
    graph = target.graph(target.plan.head)
    gpath = work / graph.file
    wpath = external_weights(gpath)
    good_g, good_w = gpath.read_bytes(), wpath.read_bytes()
    cpu = Backend.resolve("cpu")

    @FUZZ
    @given(st.data())
    def run(data):
        which = data.draw(st.sampled_from(["graph", "graph", "weights"]))
        gpath.write_bytes(data.draw(mutated(good_g)) if which == "graph" else good_g)
        if which == "weights":  # external data: truncated or shortened
            wpath.write_bytes(good_w[:data.draw(st.integers(0, len(good_w)))])
        else:
            wpath.write_bytes(good_w)
        try:
            cpu.session(work, target, graph)
        except BundleError as e:
            assert "\n" not in str(e) or "cannot be loaded by onnxruntime" in str(e)

    try:
        run()
    finally:
        gpath.write_bytes(good_g)
        wpath.write_bytes(good_w)


# ---- media decoders ----------------------------------------------------------------------------
def _images() -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (12, 16, 4), dtype=np.uint8), "RGBA")
    out = []
    for fmt, mode in [("PNG", "RGBA"), ("JPEG", "RGB"), ("GIF", "P"), ("BMP", "RGB"),
                      ("WEBP", "RGBA"), ("TIFF", "RGB")]:
        b = io.BytesIO()
        (img.convert(mode) if mode != "RGBA" else img).save(b, fmt)
        out.append(b.getvalue())
    return out


def _sounds() -> list[bytes]:
    import soundfile as sf

    x = (0.3 * np.sin(np.arange(4000) / 7)).astype(np.float32)
    out = []
    for fmt, subtype, rate in [("WAV", "PCM_16", 16000), ("WAV", "FLOAT", 8000),
                               ("FLAC", "PCM_16", 22050), ("OGG", "VORBIS", 16000)]:
        b = io.BytesIO()
        sf.write(b, np.stack([x, -x], 1), rate, format=fmt, subtype=subtype)
        out.append(b.getvalue())
    return out


def test_fuzz_image_decoder():
    from hexforge.runtime.media import load_image

    bases = _images()

    @FUZZ
    @given(st.sampled_from(bases).flatmap(lambda b: mutated(b)))
    def run(blob):
        try:
            img = load_image(blob, max_pixels=1_000_000)
        except MediaError as e:
            assert "\n" not in str(e)
            return
        assert img.mode == "RGB" and img.size[0] * img.size[1] <= 1_000_000

    run()


def test_fuzz_audio_decoder():
    from hexforge.runtime.media import load_audio

    bases = _sounds()

    @FUZZ
    @given(st.sampled_from(bases).flatmap(lambda b: mutated(b)))
    def run(blob):
        try:
            x = load_audio(blob, sampling_rate=16000, max_seconds=2.0)
        except MediaError as e:
            assert "\n" not in str(e)
            return
        assert x.dtype == np.float32 and x.ndim == 1 and x.shape[0] <= 2 * 16000 + 16000
        assert np.isfinite(x).all()  # not clipped: HF's loader keeps float files' own scale

    run()


# ---- regressions: each a crash the fuzzer (or the checks) found, named after the bug ------------
def test_regression_deeply_nested_manifest_json_escaped_as_recursionerror(work):
    from hexforge.bundle.manifest import load_manifest

    good = (work / "manifest.json").read_bytes()
    try:
        (work / "manifest.json").write_text("[" * 100_000)
        with pytest.raises(BundleError, match="nests JSON too deeply"):
            load_manifest(work)
    finally:
        (work / "manifest.json").write_bytes(good)


def test_regression_deeply_nested_checkpoint_config_escaped_as_recursionerror(tmp_path):
    from hexforge.bundle.errors import CheckpointError
    from hexforge.forge.source.checkpoint import read_checkpoint

    (tmp_path / "config.json").write_text('{"a":' + "[" * 100_000)
    with pytest.raises(CheckpointError, match="too deeply"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("template,why", [
    ("{% include 'x.jinja' %}", "TypeError"),  # no loader: TypeError escaped as a 500
    ("{% from 'os' import system %}", "TypeError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
])
def test_regression_chat_template_non_template_errors_escaped_untyped(template, why):
    from hexforge.runtime.text import ChatTemplate

    with pytest.raises(RequestError, match=why):
        ChatTemplate(template, None, None).render([{"role": "user", "content": "x"}])


def test_regression_safetensors_header_length_past_the_end_reached_the_library(tmp_path):
    from hexforge.bundle.hostfile import load_host_tensors

    p = tmp_path / "h.safetensors"
    p.write_bytes((2**63).to_bytes(8, "little") + b"{}")
    with pytest.raises(BundleError, match="header claims"):
        load_host_tensors(p)


def test_regression_truncated_external_weights_were_not_named(work):
    from hexforge.bundle.manifest import load_manifest
    from hexforge.runtime.backends import Backend

    m = load_manifest(work)
    t = m.targets["cpu"]
    w = external_weights(work / t.graph(t.plan.head).file)
    good = w.read_bytes()
    try:
        w.write_bytes(good[:100])
        with pytest.raises(BundleError, match=re.escape(w.name) + ".*truncated"):
            Backend.resolve("cpu").session(work, t, t.graph(t.plan.head))
    finally:
        w.write_bytes(good)


def test_regression_chat_message_without_a_role_was_rendered_as_role_none(bundle):
    from fastapi.testclient import TestClient

    import hexforge
    from hexforge.commands.serve import create_app

    client = TestClient(create_app(hexforge.load(bundle("llama")), "tiny"))
    r = client.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_regression_float_wav_near_float32_max_mixed_to_nan():
    """Found by the fuzzer: stereo float samples of ~3e38 are finite, but their mean overflowed
    (HF's loader mixes them to inf too): refused in one line, never handed on as inf / NaN."""
    import soundfile as sf

    from hexforge.runtime.media import load_audio

    b = io.BytesIO()
    big = np.full((100, 2), 3e38, np.float32)
    big[::2] *= -1
    sf.write(b, big, 16000, format="WAV", subtype="FLOAT")
    with pytest.raises(MediaError, match="too large to mix") as e:
        load_audio(b.getvalue(), sampling_rate=16000, max_seconds=1.0)
    assert "\n" not in str(e.value)
