"""Python loop overhead per decode token: the engine's decode() vs raw ``session.run`` of the same
graphs (same feeds, captured from one engine step), interleaved, on a tiny model where overhead
shows. Overhead = 1 - raw / engine per token. The raw runs are the engine's own IO-bound
sessions, and their ORT sessions' plain ``InferenceSession.run``, on the captured feeds.

    python bench/experiments/loop_overhead.py [--family qwen3] [--tokens 64] [--runs 7] [--context 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--bundle", default=None, help="an existing bundle instead of a tiny build")
    a = ap.parse_args()

    import hexforge

    if a.bundle:
        bundle = Path(a.bundle)
    else:
        from hexforge.forge.pipeline import BuildOptions, build
        from hexforge.forge.source.tiny import make_tiny_checkpoint

        root = Path(tempfile.mkdtemp(prefix="hexforge-overhead-"))
        ckpt = make_tiny_checkpoint(a.family, root / "ckpt")
        bundle = build(ckpt, root / "cpu", BuildOptions(context=a.context, verify=False),
                       log=lambda m: None)
    eng = hexforge.load(bundle).engine
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, eng.vocab_size, 16)]

    # capture one decode step's feeds per graph, in call order
    captured: list[tuple[str, dict]] = []

    def record(graph, feeds, _outputs, _positions):
        captured.append((graph.name, {k: np.array(v, copy=True) for k, v in feeds.items()}))

    eng.reset()
    eng.prefill(prompt)
    for _ in range(a.tokens // 2):  # the step captured is the timed loop's middle one: the
        eng.decode(5)  # attention's cost grows with the rows held
    eng.observer = record
    eng.decode(5)
    eng.observer = None
    calls = [(eng.sessions[name].sess, feeds) for name, feeds in captured]  # plain ORT sessions
    # the engine's own IO-bound sessions on the same feeds: at real sizes the plain run copies
    # every in-place cache out (present outputs), so only this one says what the loop costs there
    bound_calls = [(eng.sessions[name], feeds) for name, feeds in captured]

    def engine_run() -> float:
        eng.reset()
        eng.prefill(prompt)
        tok = 5
        t = time.perf_counter()
        for _ in range(a.tokens):
            tok = int(np.argmax(eng.decode(tok, copy=False)))
        return (time.perf_counter() - t) / a.tokens

    def raw_run() -> float:
        t = time.perf_counter()
        for _ in range(a.tokens):
            for sess, feeds in calls:
                sess.run(None, feeds)
        return (time.perf_counter() - t) / a.tokens

    def bound_run() -> float:
        t = time.perf_counter()
        for _ in range(a.tokens):
            for sess, feeds in bound_calls:
                sess.run(None, feeds)
        return (time.perf_counter() - t) / a.tokens

    engine_run(), raw_run(), bound_run()  # warm-up
    eng_t, raw_t, bound_t = [], [], []
    for _ in range(a.runs):
        eng_t.append(engine_run())
        raw_t.append(raw_run())
        bound_t.append(bound_run())
    e, r = statistics.median(eng_t), statistics.median(raw_t)
    paired = [1 - rt / et for et, rt in zip(eng_t, raw_t, strict=True)]
    us = lambda xs: {"median_us": round(1e6 * statistics.median(xs), 1),  # noqa: E731
                     "min_us": round(1e6 * min(xs), 1), "max_us": round(1e6 * max(xs), 1)}
    print(json.dumps({"bundle": str(bundle), "graphs_per_token": len(calls),
                      "engine_per_token": us(eng_t),
                      "raw_session_run_per_token": us(raw_t),
                      "raw_bound_run_per_token": us(bound_t),
                      "overhead_fraction_vs_bound": round(1 - statistics.median(bound_t) / e, 3),
                      "overhead_fraction_vs_bound_paired": round(statistics.median(
                          [1 - bt / et for et, bt in zip(eng_t, bound_t, strict=True)]), 3),
                      "overhead_fraction": round(1 - r / e, 3),
                      # per interleaved run, then the median: less moved by load that drifts
                      # between runs (2 shared cores)
                      "overhead_fraction_paired": {
                          "median": round(statistics.median(paired), 3),
                          "min": round(min(paired), 3), "max": round(max(paired), 3)}},
                     indent=1))


if __name__ == "__main__":
    main()
