"""``hexforge demo``: a tiny random-weight model made here, built, run — no download."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def run_demo(workdir: str | None = None, family: str = "llama",
             prompt: str = "The capital of France is") -> dict:
    from . import load
    from .build.pipeline import BuildOptions, build
    from .tiny import make_tiny_checkpoint

    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="hexforge-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = make_tiny_checkpoint(family, root / f"tiny-{family}")
    print(f"1. made a tiny random-weight {family} checkpoint: {ckpt}")
    from .runtime import qnn

    targets = "cpu,v81" if qnn.available() else "cpu"
    opts = BuildOptions(targets=targets, quant="w8a16", context=256, prefill_len=16)
    t1 = time.perf_counter()
    bundle = build(ckpt, root / f"tiny-{family}.bundle", opts, log=lambda m: print("   " + m))
    print(f"2. built {bundle} for {targets} in {time.perf_counter() - t1:.1f}s (oracle gates passed)")
    print(f"3. generating from {prompt!r} (random weights: expect gibberish)")
    results = {}
    for backend in ["cpu"] + (["qnn-sim"] if "v81" in targets else []):
        model = load(bundle, backend=backend)
        where = "cpu backend" if backend == "cpu" else "v81 HTP, x86 simulator"
        print(f"   [{where}] ", end="")
        for piece in model.stream(prompt, max_new_tokens=24, ignore_eos=True):
            print(piece, end="", flush=True)
        r = model.generate(prompt, max_new_tokens=32, ignore_eos=True)
        results[backend] = r.to_dict()
        print(f"\n      {r.prompt_tokens} prompt tokens, TTFT {r.ttft_ms:.1f} ms, decode "
              f"{r.decode_tok_s:.0f} tok/s")
    print(f"4. done in {time.perf_counter() - t0:.1f}s; next: hexforge inspect {bundle}")
    if "qnn-sim" in results:
        print("   (simulator speed says nothing about a device: see the roofline in inspect)")
    return {"bundle": str(bundle), "results": results}
