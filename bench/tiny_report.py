"""Tiny-model numbers for the closing notes: build time, CPU decode tok/s vs HF eager (same
checkpoint, same prompt, interleaved runs), HTP compile time / binary bytes / oracle per quant.

    python bench/tiny_report.py [--family llama] [--quants fp16,w8a16,w4a16] [--runs 5]

Tiny random-weight models only say how much overhead the loop has, nothing about device speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def hf_decode_tok_s(hf, ids: list[int], n: int) -> float:
    import torch

    x = torch.tensor([ids])
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        t = time.perf_counter()
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                    pad_token_id=0)
        return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="llama")
    ap.add_argument("--quants", default="fp16,w8a16,w4a16")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()

    import hexforge
    from hexforge.families import load_family
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.inspect import inspect_bundle
    from hexforge.tiny import make_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="hexforge-bench-"))
    ckpt = make_tiny_checkpoint(a.family, root / "ckpt")
    out: dict = {"family": a.family}

    opts = BuildOptions(context=512, prefill_len=64)
    cpu = build(ckpt, root / "cpu", opts, log=lambda m: None)
    out["cpu_build_s"] = round(opts.timings["total_s"], 2)

    model = hexforge.load(cpu)
    hf = load_family(model.manifest.model_type).FAMILY.load_hf(ckpt)
    ids = model.tokenizer.encode("The capital of France is")
    ours, theirs = [], []
    for _ in range(a.runs):  # interleaved: both see the same machine state
        ours.append(model.generate(ids, max_new_tokens=a.tokens, ignore_eos=True).decode_tok_s)
        theirs.append(hf_decode_tok_s(hf, ids, a.tokens))
    med_o, med_t = statistics.median(ours), statistics.median(theirs)
    out["cpu_decode_tok_s"] = {"hexforge": round(med_o), "hexforge_min_max": [round(min(ours)),
                               round(max(ours))], "hf_eager": round(med_t),
                               "ratio_vs_hf": round(med_o / med_t, 2)}

    out["htp"] = {}
    for q in a.quants.split(","):
        lines: list[str] = []
        opts = BuildOptions(targets="v81", quant=q, context=128, prefill_len=16)
        b = build(ckpt, root / q, opts, log=lines.append)
        info = inspect_bundle(b)["targets"]["v81"]
        rep = json.loads((b / "report.json").read_text())["v81"]
        sim = hexforge.load(b, backend="qnn-sim")
        r = sim.generate(ids, max_new_tokens=16, ignore_eos=True)
        out["htp"][q] = {
            "build_s": round(opts.timings["total_s"], 1),
            "compile_lines": [ln for ln in lines if "compiled" in ln],
            "binary_bytes": {g["name"]: g["bytes"] for g in info["graphs"]},
            "decode_weight_bytes_per_token": info["decode_weight_bytes_per_token"],
            "roofline_tok_s_estimate": info["roofline_tok_s"],
            "teacher_forced": {k: round(v, 6) for k, v in rep["teacher_forced"].items()},
            "greedy_match": f"{rep['greedy']['matching_prefix']}/{rep['greedy']['new_tokens']}",
            "qnn_sim_decode_tok_s": round(r.decode_tok_s, 1),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
