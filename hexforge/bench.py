"""``hexforge bench BUNDLE``: single-bundle speed numbers on one backend.

    TTFT          prompt in -> first token's logits (AR-N prefill chunks, or decode-over-prompt)
    prefill tok/s prompt tokens / TTFT
    decode tok/s  generated tokens after the first / their time (greedy, EOS ignored)
    peak RSS      the process's high-water mark (resource.getrusage) after all runs

Each run starts from a fresh state; a warm-up run first (session arenas, page cache). Reported as
median and min-max over ``runs``. Token ids are random in-vocabulary ids: speed does not depend on
them. Uses the engine directly (no tokenizer / detokenizer in the timed loop).
"""

from __future__ import annotations

import resource
import statistics
import time
from pathlib import Path

import numpy as np


def _stats(xs: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(xs), digits), "min": round(min(xs), digits),
            "max": round(max(xs), digits)}


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_generation(engine, ids: list[int], new_tokens: int, prefill_mode: str = "chunked"
                    ) -> tuple[float, float]:
    """One greedy run from a fresh state -> (TTFT s, decode s for new_tokens - 1 tokens)."""
    engine.reset()
    t0 = time.perf_counter()
    logits = engine.prefill(ids, prefill_mode)
    token = int(np.argmax(logits))
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = int(np.argmax(engine.decode(token)))
    return t1 - t0, time.perf_counter() - t1


def bench_bundle(bundle: str | Path, prompt_tokens: int = 128, new_tokens: int = 32,
                 runs: int = 3, backend: str = "cpu", arch: str | None = None,
                 prefill_mode: str = "chunked", seed: int = 0) -> dict:
    from .runtime.model import load

    t = time.perf_counter()
    model = load(bundle, backend=backend, arch=arch)
    load_s = time.perf_counter() - t
    eng = model.engine
    if prompt_tokens + new_tokens > eng.context:
        prompt_tokens = max(1, eng.context - new_tokens)
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(0, eng.vocab_size, prompt_tokens)]
    time_generation(eng, ids[:min(len(ids), eng.prefill_len + 1)], 2, prefill_mode)  # warm-up
    ttft, decode = [], []
    for _ in range(runs):
        a, b = time_generation(eng, ids, new_tokens, prefill_mode)
        ttft.append(a)
        decode.append(b)
    return {
        "bundle": str(bundle), "backend": model.backend.name, "target": model.target,
        "quant": model.manifest.targets[model.target].quant, "load_s": round(load_s, 2),
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "runs": runs,
        "prefill_mode": prefill_mode, "prefill_len": eng.prefill_len, "context": eng.context,
        "ttft_ms": _stats([1e3 * x for x in ttft], 1),
        "prefill_tok_s": _stats([prompt_tokens / x for x in ttft], 1),
        "decode_tok_s": _stats([(new_tokens - 1) / x for x in decode]) if new_tokens > 1 else None,
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def print_bench(r: dict) -> None:
    def fmt(s: dict | None, unit: str) -> str:
        return "-" if s is None else f"{s['median']:g} {unit} (min {s['min']:g}, max {s['max']:g})"

    print(f"{r['bundle']}  [{r['backend']} / target {r['target']} / {r['quant']}]  "
          f"prompt {r['prompt_tokens']} tokens ({r['prefill_mode']}, AR-{r['prefill_len']}), "
          f"{r['new_tokens']} new, {r['runs']} runs, load {r['load_s']} s")
    print(f"  TTFT          {fmt(r['ttft_ms'], 'ms')}")
    print(f"  prefill       {fmt(r['prefill_tok_s'], 'tok/s')}")
    print(f"  decode        {fmt(r['decode_tok_s'], 'tok/s')}")
    print(f"  peak RSS      {r['peak_rss_mb']:.0f} MB")
