"""Session fixtures: tiny random-weight HF checkpoints per family, built once, and their bundles."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

N = 8  # prefill AR-N of the test bundles: small, so chunk-boundary prompts stay cheap
CONTEXT = 256


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """ckpt("llama") -> path of a tiny checkpoint, made once per session."""
    from hexforge.tiny import make_tiny_checkpoint

    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_tiny_checkpoint(family, tmp_path_factory.mktemp(f"ckpt-{family}"))
        return made[family]

    return get


@pytest.fixture(scope="session")
def bundle(ckpt, tmp_path_factory):
    """bundle("llama", max_shard_bytes=...) -> a built cpu bundle, built once per option set."""
    from hexforge.build.pipeline import BuildOptions, build

    built: dict[tuple, Path] = {}

    def get(family: str, **kw) -> Path:
        key = (family, tuple(sorted(kw.items())))
        if key not in built:
            opts = BuildOptions(context=CONTEXT, prefill_len=N, **kw)
            out = tmp_path_factory.mktemp(f"bundle-{family}") / "b"
            built[key] = build(ckpt(family), out, opts, log=lambda m: None)
        return built[key]

    return get


@pytest.fixture(scope="session")
def hf_model(ckpt):
    """hf_model(family) -> the HF reference model (fp32, eager), loaded once."""
    import json

    from hexforge.families import load_family

    models = {}

    def get(family: str):
        if family not in models:
            path = ckpt(family)
            mt = json.loads((path / "config.json").read_text())["model_type"]
            models[family] = load_family(mt).FAMILY.load_hf(path)
        return models[family]

    return get


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """hf_greedy(family, prompt_ids, n) -> HF generate greedy tokens (fp32, EOS off), cached."""
    from hexforge.build.verify import hf_greedy_tokens

    cache = {}

    def get(family: str, ids: list[int], n: int = 64) -> list[int]:
        key = (family, tuple(ids), n)
        if key not in cache:
            cache[key] = hf_greedy_tokens(hf_model(family), ids, n)
        return cache[key]

    return get


def prompt_ids(length: int, vocab: int = 384, seed: int = 0) -> list[int]:
    """Deterministic token ids (skipping the 3 special ids) of a given length."""
    import numpy as np

    rng = np.random.default_rng(seed + length)
    return [int(t) for t in rng.integers(3, vocab, size=length)]


def text_with_tokens(tokenizer_dir: Path, n: int) -> str:
    """A prefix of a fixed text whose encoding (with special tokens) is exactly n tokens."""
    from tokenizers import Tokenizer

    from hexforge.build.verify import VERIFY_TEXT

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text = VERIFY_TEXT * 8
    for end in range(1, len(text)):
        if len(tok.encode(text[:end]).ids) == n:
            return text[:end]
    raise AssertionError(f"no prefix encodes to {n} tokens")


@pytest.fixture(scope="session")
def htp_bundle(ckpt, tmp_path_factory):
    """htp_bundle("llama", "w8a16", "v81", **opts) -> a bundle with HTP targets, built once."""
    from hexforge.build.pipeline import BuildOptions, build

    built: dict[tuple, Path] = {}

    def get(family: str, quant: str, targets: str = "v81", **kw) -> Path:
        key = (family, quant, targets, repr(sorted(kw.items())))
        if key not in built:
            opts = BuildOptions(targets=targets, quant=quant, context=HTP_CONTEXT,
                                prefill_len=HTP_N, **kw)
            out = tmp_path_factory.mktemp(f"htp-{family}-{quant}") / "b"
            built[key] = build(ckpt(family), out, opts, log=lambda m: None)
        return built[key]

    return get


HTP_N = 16
HTP_CONTEXT = 128
