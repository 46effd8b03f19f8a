"""Seconds per graph call of a bundle's HTP target on the x86 simulator (qnn-sim): how much an
oracle run costs at this model size before committing to one.

    python bench/experiments/htp_sim_step.py BUNDLE [--target v81] [--decode-steps 2] [--prefill-chunks 1]

Loads the target's sessions (timed), runs prefill chunks of AR-N tokens and single decode steps,
prints JSON: load_s, prefill_chunk_s (mean), decode_step_s (each), peak RSS GB.
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--target", default="v81")
    ap.add_argument("--decode-steps", type=int, default=2)
    ap.add_argument("--prefill-chunks", type=int, default=1)
    a = ap.parse_args()

    from pathlib import Path

    from hexforge.bundle.manifest import load_manifest
    from hexforge.runtime.backends import Backend
    from hexforge.runtime.engine import Engine

    bundle = Path(a.bundle)
    manifest = load_manifest(bundle)
    spec = manifest.targets[a.target]
    t = time.perf_counter()
    engine = Engine(bundle, manifest, a.target, Backend.resolve("qnn-sim", spec.htp_arch))
    load_s = time.perf_counter() - t
    N = engine.prefill_len
    ids = [(7 * i + 3) % 200 + 10 for i in range(N * a.prefill_chunks)]
    engine.reset()
    t = time.perf_counter()
    engine.prefill(ids)  # chained AR-N chunks
    prefill = round((time.perf_counter() - t) / a.prefill_chunks, 2)
    decode = []
    for i in range(a.decode_steps):
        t = time.perf_counter()
        engine.decode(ids[i])
        decode.append(round(time.perf_counter() - t, 2))
    print(json.dumps({"bundle": str(bundle), "target": a.target, "load_s": round(load_s, 1),
                      "prefill_chunk_s": prefill, "decode_step_s": decode,
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))


if __name__ == "__main__":
    main()
