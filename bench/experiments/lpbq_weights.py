"""What LPBQ's coarse block scales cost a real model (issue 76): HF's fp32 forward with the
decoder projections' weights rounded as each int4 form writes them, activations float (the
weights' share of a recipe's error alone), KL / top-1 against the unrounded model on the
held-out text.

    python bench/experiments/lpbq_weights.py smollm2 | gemma3 [--tokens 256] [--json FILE]

The forms (w [K, N], symmetric int4, blocks along K):
  w4-fp16's        blocks of 32, scale absmax / 7 in float, round to nearest (MatMulNBits' form;
                   the head int8 in blocks of 32, as w4-fp16 writes it)
  float blocks     blocks of B, float scales by the MSE clip search (``int4_blocks``: the
                   fixed-point recipes' form before LPBQ)
  LPBQ             the same search on LPBQ's grid: each block's scale a code 1..16 x its
                   channel's float scale (``lpbq_snap``), as the QDQ pass writes int4 now
The fixed-point forms' head is int8 per output channel (w4-u16's ``head_bits``). Round to
nearest throughout (the build's GPTQ can only lower each form's error). Fake quantization on the
CPU, not the HTP: the weights' rounding, nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sink_u16 import logits, real_model, score


def _rounded(w: torch.Tensor, form: str, block: int | None) -> torch.Tensor:
    """w [N, K] (torch Linear) rounded as ``form`` -> float [N, K]."""
    from hexforge.forge.oracle.quality import rtn
    from hexforge.forge.quantize.qdq import LPBQ_MIN_BLOCKS, _block
    from hexforge.forge.quantize.weightquant import dequantize, int4_blocks, lpbq_snap

    if form == "w4-fp16":
        return rtn(w.float(), 4, 32)
    if form.startswith("int8"):
        return rtn(w.float(), 8, block)
    k = w.shape[1]
    b = block or _block(k, 64, LPBQ_MIN_BLOCKS)
    if b is None or k % b:
        return rtn(w.float(), 8, None)  # no block divides K: int8 per channel, as the pass does
    wk = w.float().numpy().T.astype(np.float32)  # [K, N]: x @ w
    snap = lpbq_snap(wk, b) if form == "lpbq" else None
    return torch.from_numpy(dequantize(*int4_blocks(wk, b, snap)).T.copy())


def run(hf, layers, ref, ids, form: str, block: int | None, head: tuple[int | None, int | None]
        ) -> dict:
    mods = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    saved = []
    try:
        for m in mods:
            saved.append((m, m.weight))
            m.weight = torch.nn.Parameter(_rounded(m.weight.data, form, block))
        out = hf.get_output_embeddings()
        hbits, hblock = head
        if hbits:  # a parameter of its own: a tied head is the embedding's too
            saved.append((out, out.weight))
            out.weight = torch.nn.Parameter(_rounded(out.weight.data, "int8", hblock))
        return score(ref, logits(hf, ids), ids)
    finally:
        for m, w in saved:
            m.weight = w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["smollm2", "gemma3"])
    ap.add_argument("--tokens", type=int, default=256, help="held-out tokens")
    ap.add_argument("--json")
    a = ap.parse_args()

    hf, layers, _, ev = real_model(a.model, a.tokens)
    ref = logits(hf, ev)
    print(f"{a.model}: {len(ev) - 1} held-out positions; HF fp32, weights rounded (not the HTP)")
    rows = []
    for what, form, block, head in (
            ("w4-fp16's int4 (blocks of 32, RTN), head int8 blocks of 32", "w4-fp16", None,
             (8, 32)),
            ("int4 float block scales, blocks of 32, head int8 per channel", "float", 32, (8, None)),
            ("LPBQ, blocks of 32, head int8 per channel", "lpbq", 32, (8, None)),
            ("int4 float block scales, the pass's blocks, head int8 per channel", "float", None,
             (8, None)),
            ("LPBQ, the pass's blocks (16+ a row, at most 64), head int8 per channel", "lpbq",
             None, (8, None)),
            ("LPBQ, the pass's blocks, head float", "lpbq", None, (None, None)),
            ("int8 per channel projections (w8-u16's), head int8 per channel", "int8", None,
             (8, None))):
        r = {"what": what, **run(hf, layers, ref, ev, form, block, head)}
        rows.append(r)
        print(f"{what:72s} KL {r['kl']:.3e}  top-1 {r['top1']:.3f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
