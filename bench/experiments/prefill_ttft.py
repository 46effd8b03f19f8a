"""TTFT of a long prompt: AR-N prefill vs decode-over-prompt (the seed bundles' runtime's only
mode: docs/notes/realsize.md), on the CPU backend, interleaved runs of one bundle.

    python bench/experiments/prefill_ttft.py [--family qwen3_5] [--prompt 256] [--prefill-len 64] [--runs 5]
                                 [--hidden 256]

A random-weight checkpoint of the family at a chosen width (the tiny fixture's layer pattern);
random weights change nothing about speed. Prints medians, min-max and the ratio as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def ttft(model, ids: list[int], mode: str) -> float:
    eng = model.engine
    eng.reset()
    t = time.perf_counter()
    eng.prefill(ids, mode=mode)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_5")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()

    import numpy as np

    import hexforge
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="hexforge-ttft-"))
    ckpt = make_tiny_checkpoint(a.family, root / "ckpt", hidden_size=a.hidden,
                                intermediate_size=3 * a.hidden)
    opts = BuildOptions(context=a.prompt + 64, prefill_len=a.prefill_len, verify=False)
    model = hexforge.load(build(ckpt, root / "cpu", opts, log=lambda m: None))
    ids = [int(t) for t in np.random.default_rng(0).integers(3, model.engine.vocab_size, a.prompt)]
    ttft(model, ids, "chunked"), ttft(model, ids, "decode")  # warm-up
    ar_n, ar_1 = [], []
    for _ in range(a.runs):
        ar_n.append(ttft(model, ids, "chunked"))
        ar_1.append(ttft(model, ids, "decode"))
    ms = lambda xs: {"median_ms": round(1e3 * statistics.median(xs), 2),  # noqa: E731
                     "min_ms": round(1e3 * min(xs), 2), "max_ms": round(1e3 * max(xs), 2)}
    print(json.dumps({"family": a.family, "hidden": a.hidden, "prompt": a.prompt,
                      "prefill_len": a.prefill_len, "ar_n_prefill": ms(ar_n),
                      "decode_over_prompt": ms(ar_1),
                      "speedup": round(statistics.median(ar_1) / statistics.median(ar_n), 2)},
                     indent=1))


if __name__ == "__main__":
    main()
