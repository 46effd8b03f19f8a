"""How close the HF model's own top 2 are along its greedy answer: where two dialogs of one bundle
(bench/genie_lade.py: ``lade`` and ``basic``) part, is it a tie the model makes?

    python bench/hf_margins.py CHECKPOINT_OR_GGUF --task edit [--tokens 40] [--chat]

HF in fp32 answers the task of bench/speculative.py greedily; each step prints the top 2, their
logit gap and one fp16 step at that logit (a gap under it is a coin flip for any fp16 graph);
then bf16 and fp16 forwards of the same model, teacher-forced on fp32's tokens, give their gap at
every step where fp32's is under one fp16 step (fp16 may overflow: Gemma-3's residual does).
CPU only, minutes for a 270M model. Results: docs/genie.md, "lade on the real Gemma-3".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def fp16_step(x: float) -> float:
    """The gap between fp16 neighbours at ``x``."""
    return float(np.spacing(np.float16(abs(x))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="an HF checkpoint dir or a .gguf")
    ap.add_argument("--task", default="edit")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from speculative import TASKS

    from hexforge.forge.source.gguf import gguf_checkpoint

    ck = gguf_checkpoint(a.model) if a.model.endswith(".gguf") else Path(a.model)
    tok = AutoTokenizer.from_pretrained(ck)
    text = (tok.apply_chat_template([{"role": "user", "content": TASKS[a.task]}], tokenize=False,
                                    add_generation_prompt=True) if a.chat else TASKS[a.task])
    ids = tok(text, return_tensors="pt", add_special_tokens=not a.chat).input_ids
    n0 = ids.shape[1]
    model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
    ties = []
    with torch.no_grad():
        for step in range(a.tokens):
            top = torch.topk(model(ids).logits[0, -1], 2)
            gap, step16 = float(top.values[0] - top.values[1]), fp16_step(float(top.values[0]))
            mark = "  <- under one fp16 step" if gap < step16 else ""
            if mark:
                ties.append(step)
            print(f"{step:3d} {tok.decode(top.indices[0])!r:>14} {tok.decode(top.indices[1])!r:>14}"
                  f"  gap {gap:.4f}  fp16 step {step16:.4f}{mark}")
            ids = torch.cat([ids, top.indices[:1][None]], 1)
    print(repr(tok.decode(ids[0, n0:])))
    for dtype in (torch.bfloat16, torch.float16):
        low = AutoModelForCausalLM.from_pretrained(ck, dtype=dtype).eval()
        with torch.no_grad():
            logits = low(ids).logits[0, n0 - 1:-1].float()
        agree = int((logits.argmax(-1) == ids[0, n0:]).sum())
        gaps = {s: float(torch.topk(logits[s], 2).values.diff().abs()) for s in ties}
        print(f"{dtype}: teacher-forced top-1 = fp32's {agree} of {a.tokens}; gaps at fp32's ties:",
              {s: round(g, 4) for s, g in gaps.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
