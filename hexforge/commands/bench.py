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
    logits = engine.prefill(ids, prefill_mode, copy=False)
    token = int(np.argmax(logits))
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = int(np.argmax(engine.decode(token, copy=False)))
    return t1 - t0, time.perf_counter() - t1


def bench_bundle(bundle: str | Path, prompt_tokens: int = 128, new_tokens: int = 32,
                 runs: int = 3, backend: str = "cpu", arch: str | None = None,
                 prefill_mode: str = "chunked", seed: int = 0) -> dict:
    from ..runtime.model import load

    t = time.perf_counter()
    # the load opens only the graphs this mode runs (its load time is theirs)
    model = load(bundle, backend=backend, arch=arch, prefill_mode=prefill_mode)
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


def op_profile(bundle: str | Path, tokens: int = 32, prompt_tokens: int = 32,
               backend: str = "cpu", arch: str | None = None, seed: int = 0) -> dict:
    """Where a decode token's time goes, from onnxruntime's per-node profile of ``tokens`` greedy
    decode steps (after a warm-up generation)::

        wall per token ─┬─ in session runs ─┬─ kernels, by op type (MatMulNBits, ...)
                        │                   └─ between kernels (the executor: allocation,
                        │                      dispatch, thread-pool hand-offs)
                        └─ host (Python: the engine's inputs, binding, argmax)

    Profiling adds ~1 us per node, so every number is above an unprofiled run's and the shares
    are what to read. "between kernels" moves most: it doubled in a process that held other
    sessions while the unprofiled speed did not move. Per token = summed over the step's graphs
    (shards, and the head where it is a graph of its own), averaged over the timed steps."""
    import dataclasses
    import json
    import tempfile
    from collections import defaultdict

    from ..bundle.errors import RequestError
    from ..runtime.backends import Backend
    from ..runtime.model import load, parse_arch

    with tempfile.TemporaryDirectory(prefix="hexforge-profile-") as tmp:
        be = dataclasses.replace(Backend.resolve(backend, parse_arch(arch)),
                                 profile_prefix=str(Path(tmp) / "p"))
        model = load(bundle, backend=be)
        eng = model.engine
        rng = np.random.default_rng(seed)
        ids = [int(x) for x in rng.integers(0, eng.vocab_size, min(prompt_tokens, eng.prefill_len))]
        if len(ids) + tokens + 2 > eng.context:
            raise RequestError(f"{tokens} tokens after a {len(ids)}-token prompt pass the "
                               f"bundle's context ({eng.context})")
        time_generation(eng, ids, 3)  # warm-up
        _, decode_s = time_generation(eng, ids, tokens + 1)  # the last `tokens` runs of each graph
        graphs = list(eng.plan.graphs["decode"])
        if not eng.plan.head_in_step["decode"]:
            graphs.append(eng.plan.head)
        run_us = kernel_us = 0.0
        ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        files = {name: sess.end_profiling() for name, sess in eng.sessions.items()}
        for graph in graphs:
            events = json.loads(Path(files[graph.name]).read_text())
            runs = sorted((e for e in events if e.get("cat") == "Session"
                           and e["name"] == "model_run"), key=lambda e: e["ts"])[-tokens:]
            nodes = [e for e in events if e.get("cat") == "Node"
                     and e["name"].endswith("_kernel_time")]
            start, end = runs[0]["ts"], runs[-1]["ts"] + runs[-1]["dur"]
            run_us += sum(r["dur"] for r in runs)
            for e in nodes:
                if start <= e["ts"] <= end:
                    op = ops[e["args"].get("op_name", "?")]
                    op[0] += e["dur"]
                    op[1] += 1
                    kernel_us += e["dur"]
    wall_ms = 1e3 * decode_s / tokens
    per = 1e-3 / tokens  # us summed over the steps -> ms per token
    return {
        "bundle": str(bundle), "backend": model.backend.name, "target": model.target,
        "tokens": tokens, "wall_ms": round(wall_ms, 3), "run_ms": round(run_us * per, 3),
        "kernel_ms": round(kernel_us * per, 3),
        "between_kernels_ms": round((run_us - kernel_us) * per, 3),
        "host_ms": round(wall_ms - run_us * per, 3),
        "nodes_per_token": round(sum(n for _, n in ops.values()) / tokens, 1),
        "ops": {name: {"ms": round(us * per, 3), "count": round(n / tokens, 1),
                       "share": round(us * per / wall_ms, 4)}
                for name, (us, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])},
    }


def print_op_profile(r: dict, top: int = 12) -> None:
    w = r["wall_ms"]
    line = lambda name, ms, extra="": print(f"  {name:34s} {ms:8.3f} ms {100 * ms / w:6.1f} %{extra}")  # noqa: E731
    print(f"{r['bundle']}  [{r['backend']} / target {r['target']}]  decode, {r['tokens']} tokens "
          f"profiled: {w:.3f} ms a token, {r['nodes_per_token']:g} nodes")
    line("in session runs", r["run_ms"])
    line("  kernels", r["kernel_ms"])
    shown = list(r["ops"].items())[:top]
    for name, o in shown:
        line(f"    {name}", o["ms"], f"  x{o['count']:g}")
    rest = r["kernel_ms"] - sum(o["ms"] for _, o in shown)
    if len(r["ops"]) > top:
        line(f"    {len(r['ops']) - top} more op types", rest)
    line("  between kernels", r["between_kernels_ms"])
    line("outside runs (host; profiling slows it)", r["host_ms"])


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
