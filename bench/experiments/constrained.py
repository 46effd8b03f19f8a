"""Constrained decoding libraries side by side: llguidance, xgrammar, outlines-core.

    pip install xgrammar outlines-core jsonschema      # llguidance is a runtime dependency
    python bench/experiments/constrained.py [--bundle DIR] [--seeds 20] [--max-new 240] [--vocab 32000]

Per library: one-time setup (vocabulary index), first compile of the schema, per-token overhead
(mask + apply + advance, median and p90 µs/token) and validity (every output json-parses and
validates against the schema with ``jsonschema``), on

  * ``tiny``: a tiny random-weight bundle (V=384), end to end through ``Model.generate`` at
    temperature 1.0 (random weights write garbage: only the mask keeps the output valid);
  * ``bpe-32k``: a byte-level BPE trained here on the Python stdlib (V≈32k, closer to a real
    vocabulary), random logits as the "model" (the mask's cost does not depend on the model).

Runs are interleaved (for each seed, every library in turn) so machine noise hits all alike.
Every library is driven through one interface (``__call__(logits)`` masks, ``advance(token)``), with
the same numpy mask application, so only the library differs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "pos": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -1000,
                                                       "maximum": 1000}, "ok": {"type": "boolean"}},
                "required": ["x", "ok"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "pos", "tags"],
    "additionalProperties": False,
}


def bits_to_bool(bits: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].view(bool)


class Masked:
    """The shared half of every adapter: a 32-bit-word bitmask filled by the library, applied to
    the logits the same way for all."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.bits = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
        self.done = False  # the loop ends at the forced EOS for every library alike

    def fill(self) -> None:
        raise NotImplementedError

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        self.fill()
        return np.where(bits_to_bool(self.bits, self.vocab), logits, np.float32(-np.inf))


# ---- the libraries --------------------------------------------------------------------------------
def llguidance_lib(tok_json: str, vocab: int, eos: int):
    from hexforge.runtime.constrain import Grammars

    grammars = Grammars(tok_json, vocab, [eos])
    _ = grammars.tokenizer  # the one-time index

    def compile_(schema: dict):
        rf = {"type": "json_schema", "json_schema": {"schema": schema}}
        grammars.constraint(rf)  # compiles and caches

        return lambda: LLGuidanceBench(grammars.constraint(rf), vocab)
    return compile_


class LLGuidanceBench(Masked):
    def __init__(self, c, vocab: int):
        super().__init__(vocab)
        self.c = c

    def __call__(self, logits):
        return self.c(logits)

    def advance(self, token: int) -> None:
        self.c.advance(token)


def xgrammar_lib(tok_json: str, vocab: int, eos: int):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(tok_json)
    hf = PreTrainedTokenizerFast(tokenizer_file=f.name)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile_(schema: dict):
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(",", ":"))

        class XGrammarBench(Masked):
            def __init__(self):
                super().__init__(vocab)
                self.m = xgr.GrammarMatcher(compiled)

            def fill(self):
                self.m.fill_next_token_bitmask(self.bits)

            def advance(self, token: int) -> None:
                assert self.m.accept_token(token), "xgrammar refused a token from its own mask"
        return XGrammarBench
    return compile_


def byte_level_vocab(tok_json: str, eos: int) -> dict[bytes, list[int]]:
    """token bytes -> ids for a byte-level BPE (GPT-2's byte <-> printable char table)."""
    table = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = table[:], 0
    for b in range(256):
        if b not in table:
            table.append(b)
            chars.append(256 + n)
            n += 1
    unbyte = {chr(c): b for b, c in zip(table, chars, strict=True)}
    data = json.loads(tok_json)
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    out: dict[bytes, list[int]] = {}
    for s, i in data["model"]["vocab"].items():
        if i != eos and i not in special:
            out.setdefault(bytes(unbyte[c] for c in s), []).append(i)
    return out


def outlines_lib(tok_json: str, vocab: int, eos: int):
    import outlines_core as oc

    voc = oc.Vocabulary(eos, byte_level_vocab(tok_json, eos))

    def compile_(schema: dict):
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        index = oc.Index(regex, voc)

        class OutlinesBench(Masked):
            def __init__(self):
                super().__init__(vocab)
                self.g = oc.Guide(index)

            def fill(self):
                self.g.write_mask_into(self.bits.ctypes.data, self.bits.size, 4)

            def advance(self, token: int) -> None:
                self.g.advance(token, return_tokens=False)
        return OutlinesBench
    return compile_


LIBS: dict[str, tuple[str, Callable]] = {
    "llguidance": ("llguidance", llguidance_lib),
    "xgrammar": ("xgrammar", xgrammar_lib),
    "outlines-core": ("outlines_core", outlines_lib),
}


class Timed:
    """Wraps an adapter: the time of mask + advance, per token."""

    def __init__(self, inner):
        self.inner, self.ns = inner, []

    @property
    def done(self) -> bool:
        return self.inner.done

    def __call__(self, logits):
        t = time.perf_counter_ns()
        out = self.inner(logits)
        self.ns.append(time.perf_counter_ns() - t)
        return out

    def advance(self, token: int) -> None:
        t = time.perf_counter_ns()
        self.inner.advance(token)
        self.ns[-1] += time.perf_counter_ns() - t


def invalid(text: str, schema: dict) -> str | None:
    """Why ``text`` is not a valid instance of ``schema`` (None: it is)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return None
    except ValueError as e:
        return f"json: {str(e).split(':')[0]}"
    except jsonschema.ValidationError as e:
        return f"schema: {e.validator} {e.validator_value}"


# ---- the two scenarios ------------------------------------------------------------------------------
def random_logits_run(c: Timed, vocab: int, eos: int, seed: int, max_new: int,
                      decode: Callable[[list[int]], str]) -> tuple[str, str]:
    from hexforge.runtime.sampling import make_sampler

    rng = np.random.default_rng(seed + 10_000)
    sample = make_sampler(1.0, seed=seed, constraint=c)
    ids: list[int] = []
    for _ in range(max_new):
        token = sample((rng.standard_normal(vocab) * 3).astype(np.float32))
        if token == eos:
            return decode(ids), "stop"
        ids.append(token)
        c.advance(token)
    return decode(ids), "length"


def big_tokenizer(vocab: int) -> str:
    """A byte-level BPE of ``vocab`` ids trained on stdlib sources (no hub here)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    corpus = [p.read_text(errors="ignore") for p in files[:400]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def heavy_imports(module: str) -> list[str]:
    """Which of torch / transformers a fresh interpreter has loaded after ``import module``."""
    import subprocess

    code = (f"import sys, {module}; print(' '.join(m for m in ('torch', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout.split()


def tiny_bundle(path: str | None) -> Path:
    if path:
        return Path(path)
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="hexforge-constrained-"))
    ckpt = make_tiny_checkpoint("llama", tmp / "ckpt")
    return build(ckpt, tmp / "bundle", BuildOptions(context=512, prefill_len=8), log=lambda m: None)


def measure(name: str, tok_json: str, vocab: int, eos: int, libs: list[str], seeds: int,
            run_one: Callable[[Timed, int], tuple[str, str]]) -> list[dict]:
    rows = {}
    for lib in libs:
        t = time.perf_counter()
        compile_for = LIBS[lib][1](tok_json, vocab, eos)
        setup = time.perf_counter() - t
        t = time.perf_counter()
        new = compile_for(SCHEMA)
        rows[lib] = {"scenario": name, "library": lib, "vocab": vocab, "setup_ms": setup * 1e3,
                     "compile_ms": (time.perf_counter() - t) * 1e3, "new": new, "ns": [],
                     "valid": 0, "runs": 0, "length": 0, "why": {}}
    for seed in range(seeds):  # interleaved
        for lib in libs:
            r = rows[lib]
            c = Timed(r["new"]())
            text, finish = run_one(c, seed)
            r["ns"] += c.ns
            r["runs"] += 1
            why = invalid(text, SCHEMA) if finish != "length" else "truncated at max_new"
            r["valid"] += why is None
            if why:
                r["why"][why] = r["why"].get(why, 0) + 1
            r["length"] += finish == "length"
    for r in rows.values():
        ns = sorted(r.pop("ns"))
        r.pop("new")
        r["tokens"] = len(ns)
        r["us_median"] = statistics.median(ns) / 1e3
        r["us_p90"] = ns[int(0.9 * (len(ns) - 1))] / 1e3
    return list(rows.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", help="a bundle dir (default: build a tiny llama one)")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--max-new", type=int, default=240)
    ap.add_argument("--vocab", type=int, default=32000, help="0 skips the bpe scenario")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()

    import hexforge

    libs = [n for n, (mod, _) in LIBS.items() if importlib.util.find_spec(mod)]
    missing = sorted(set(LIBS) - set(libs))
    model = hexforge.load(tiny_bundle(a.bundle))
    tok_json = (model.bundle / model.manifest.tokenizer.dir / "tokenizer.json").read_text()
    eos = model.generation.eos_token_ids[0]

    def tiny_run(c: Timed, seed: int):
        r = model.generate("Answer in JSON:", max_new_tokens=a.max_new, temperature=1.0, seed=seed,
                           constraint=c)
        return r.text, r.finish_reason

    rows = measure("tiny", tok_json, model.manifest.vocab_size, eos, libs, a.seeds, tiny_run)
    if a.vocab:
        from tokenizers import Tokenizer

        big = big_tokenizer(a.vocab)
        btok = Tokenizer.from_str(big)
        V = btok.get_vocab_size(with_added_tokens=True)
        rows += measure(f"bpe-{V // 1000}k", big, V, 2, libs, a.seeds,
                        lambda c, seed: random_logits_run(c, V, 2, seed, a.max_new, btok.decode))

    print(f"\n{'scenario':9} {'library':14} {'setup ms':>9} {'compile ms':>10} {'µs/tok med':>10} "
          f"{'p90':>8} {'tokens':>7} {'valid':>7} {'length':>6}")
    for r in rows:
        print(f"{r['scenario']:9} {r['library']:14} {r['setup_ms']:9.1f} {r['compile_ms']:10.1f} "
              f"{r['us_median']:10.1f} {r['us_p90']:8.1f} {r['tokens']:7d} "
              f"{r['valid']:>3}/{r['runs']:<3} {r['length']:6d}")
    for r in rows:
        for why, n in r["why"].items():
            print(f"  {r['scenario']} {r['library']}: {n} x {why}")
    if missing:
        print("not installed:", ", ".join(missing))
    for lib in libs:  # the runtime must stay torch-free: what does importing each one pull in?
        print(f"import {LIBS[lib][0]}: loads {', '.join(heavy_imports(LIBS[lib][0])) or 'no torch'}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
