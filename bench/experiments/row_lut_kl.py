"""What an 8-bit embedding row costs a trained model: HF's own forward of SmolLM2-135M-Instruct and
Gemma-3-270M with each input embedding row rounded to 8 bits with a scale of its own (the form
a Genie LUT past 4 GiB gets, forge/genie/folder.row_quantize), against the same forward
unrounded, on the oracle's held-out text: mean KL and top-1 agreement of the next-token logits.

    python bench/experiments/row_lut_kl.py [--tokens 256] [--work W]

Only the rows entering the model are rounded (a tied head keeps its weights). Rounding a row
scaled by a constant is the row rounded, then scaled, so the embedding's scale (Gemma's
sqrt(H)) does not matter. Gemma-4-E2B's LUT rows also carry the per-layer inputs beside the
embedding under the same scale; no trained Gemma-4 is here to measure that part.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/row_lut_kl"))
    a = ap.parse_args()

    import numpy as np
    import torch
    from genie_real import gguf

    from hexforge.families import load_family
    from hexforge.forge.genie.folder import row_quantize
    from hexforge.forge.oracle.quality import eval_text
    from hexforge.forge.source.checkpoint import read_checkpoint
    from hexforge.runtime.text import TextTokenizer

    a.work.mkdir(parents=True, exist_ok=True)
    for name in ("smollm2", "gemma3"):
        ckpt = read_checkpoint(gguf(name, a.work), lambda m: None)
        hf = load_family(ckpt.model_type).FAMILY.load_hf(ckpt.dir).float().eval()
        ids = TextTokenizer(ckpt.dir).encode(eval_text(None) * 4)[:a.tokens]
        x = torch.tensor([ids])
        emb = hf.get_input_embeddings()

        def rounded(_module, _inputs, out):
            q, s = row_quantize(out[0].double().numpy())
            return torch.from_numpy((q.astype(np.float32) - 128) * s[:, None])[None]

        with torch.no_grad():
            ref = torch.log_softmax(hf(x).logits[0].float(), -1)
            hook = emb.register_forward_hook(rounded)
            got = torch.log_softmax(hf(x).logits[0].float(), -1)
            hook.remove()
        kl = (ref.exp() * (ref - got)).sum(-1)
        print(json.dumps({"model": name, "tokens": len(ids), "kl_mean": float(kl.mean()),
                          "kl_max": float(kl.max()),
                          "top1": float((ref.argmax(-1) == got.argmax(-1)).float().mean())}),
              flush=True)


if __name__ == "__main__":
    main()
