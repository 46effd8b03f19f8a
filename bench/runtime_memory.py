"""Memory of a loaded cpu bundle: resident anonymous memory after load and after a prompt +
decode, peak RSS, TTFT of a prompt (AR-N prefill) and decode tok/s, each run in a fresh process.

onnxruntime prepacks every MatMul weight into its kernel's layout when a session is made, so what
a bundle holds depends on which sessions prepack (``runtime/backends.py`` ``prepack_prefill``):
anonymous memory is the packed copies, the weight file itself is mapped (page cache).

    python bench/runtime_memory.py BUNDLE [--prompt 512] [--tokens 32] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def rss_mb() -> dict[str, float]:
    from build_profile import status_kb

    return {key: round(status_kb(key) / 1024, 1) for key in ("RssAnon", "RssFile", "VmHWM")}


def child(bundle: str, prompt: int, tokens: int) -> dict:
    import numpy as np

    import hexforge

    t = time.perf_counter()
    model = hexforge.load(bundle)
    load_s = time.perf_counter() - t
    after_load = rss_mb()
    eng = model.engine
    ids = [int(x) for x in np.random.default_rng(0).integers(3, eng.vocab_size, prompt)]
    eng.prefill(ids[:8])  # first-call costs
    eng.reset()
    t = time.perf_counter()
    logits = eng.prefill(ids)
    ttft = time.perf_counter() - t
    token = int(np.argmax(logits))
    t = time.perf_counter()
    for _ in range(tokens):
        token = int(np.argmax(eng.decode(token, copy=False)))
    decode = tokens / (time.perf_counter() - t)
    return {"load_s": round(load_s, 2), "after_load": after_load, "after_run": rss_mb(),
            "ttft_s": round(ttft, 3), "decode_tok_s": round(decode, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.bundle, a.prompt, a.tokens)))
        return
    runs = []
    for _ in range(a.runs):
        out = subprocess.run([sys.executable, __file__, a.bundle, "--child", "--prompt",
                              str(a.prompt), "--tokens", str(a.tokens)],
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    print(json.dumps({"bundle": a.bundle, "prompt": a.prompt, "tokens": a.tokens,
                      "anon_after_load_mb": med([r["after_load"]["RssAnon"] for r in runs]),
                      "anon_after_run_mb": med([r["after_run"]["RssAnon"] for r in runs]),
                      "peak_rss_mb": med([r["after_run"]["VmHWM"] for r in runs]),
                      "ttft_s": med([r["ttft_s"] for r in runs]),
                      "decode_tok_s": med([r["decode_tok_s"] for r in runs]),
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
