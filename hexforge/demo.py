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
    opts = BuildOptions(targets="cpu", context=512, prefill_len=32)
    t1 = time.perf_counter()
    bundle = build(ckpt, root / f"tiny-{family}.bundle", opts, log=lambda m: print("   " + m))
    print(f"2. built {bundle} in {time.perf_counter() - t1:.1f}s (oracle gates passed)")
    model = load(bundle)
    print(f"3. generating from {prompt!r} (random weights: expect gibberish):\n   ", end="")
    for piece in model.stream(prompt, max_new_tokens=32, ignore_eos=True):
        print(piece, end="", flush=True)
    r = model.generate(prompt, max_new_tokens=64, ignore_eos=True)
    print(f"\n4. {r.prompt_tokens} prompt tokens, TTFT {r.ttft_ms:.1f} ms, decode "
          f"{r.decode_tok_s:.0f} tok/s on the cpu backend; total {time.perf_counter() - t0:.1f}s")
    print(f"   next: hexforge inspect {bundle}")
    return {"bundle": str(bundle), "result": r.to_dict()}
