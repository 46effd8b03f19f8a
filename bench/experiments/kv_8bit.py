"""Which part of the KV cache survives 8 bits, and with which scales, on real trained models: HF
itself with its attention's keys (after the rope) and / or values rounded to int8, judged
against HF fp32 on the held-out text (KL mean / p99, top-1) — the floor an 8-bit cache of that
form reaches, before any HTP graph.

    python bench/experiments/kv_8bit.py [--work W]

Forms: one symmetric scale a cache, from the calibration text's peak x 1.25 (what a static
encoding of the cache buffer can do; forge/quantize/calibtext.py's text); or a scale per row (per head and
position) from the row's own peak (what ``--kv-values u8`` computes in the graph). Results and
the form they chose: docs/notes/htp-speed.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMS = {  # name -> (keys, values): None = fp32, "cache" = one scale a cache, "row" = per row
    "keys + values, a scale per cache": ("cache", "cache"),
    "keys, a scale per cache": ("cache", None),
    "values, a scale per cache": (None, "cache"),
    "keys + values, a scale per row": ("row", "row"),
    "keys, a scale per row": ("row", None),
    "values, a scale per row (--kv-values u8)": (None, "row"),
}
MODULES = {"llama": "transformers.models.llama.modeling_llama",
           "gemma3_text": "transformers.models.gemma3.modeling_gemma3"}
MARGIN = 1.25  # a static scale covers the calibration peak x this


class FakeQuantKV:
    """Hooks that round an HF model's keys (after the rope: what the cache holds) and values
    (v_proj's output) to int8 per ``form``, per layer; ``calibrate`` records each cache's peak."""

    def __init__(self, hf, model_type: str):
        import torch

        self.torch = torch
        self.form: tuple = (None, None)
        self.calibrating = False
        self.peak: dict[tuple[int, str], float] = {}
        self.layer = 0
        mod = importlib.import_module(MODULES[model_type])
        rope = mod.apply_rotary_pos_emb

        def rope_then_round(q, k, *a, **kw):
            q, k = rope(q, k, *a, **kw)
            return q, self.round(k, "k")

        mod.apply_rotary_pos_emb = rope_then_round
        heads = hf.config.num_key_value_heads
        for i, layer in enumerate(hf.model.layers):
            layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "layer", i))

            def values(m, inp, out, i=i):  # [B, T, KVH * D] -> per head rows, rounded, back
                B, T, HD = out.shape
                x = out.view(B, T, heads, HD // heads)
                return self.round(x, "v").reshape(B, T, HD)

            layer.self_attn.v_proj.register_forward_hook(values)

    def round(self, x, kind: str):
        key = (self.layer, kind)
        if self.calibrating:
            self.peak[key] = max(self.peak.get(key, 0.0), float(x.abs().max()))
            return x
        how = self.form[0 if kind == "k" else 1]
        if how is None:
            return x
        if how == "cache":
            s = max(self.peak[key], 1e-3) * MARGIN / 127
            return self.torch.clamp(self.torch.round(x / s), -127, 127) * s
        s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / 127  # each row its own peak
        return self.torch.round(x / s) * s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="kv-8bit-work", help="where Gemma-3's GGUF is assembled")
    a = ap.parse_args()

    from quality_table import references

    from hexforge.forge.oracle.quality import compare, hf_logits
    from hexforge.forge.quantize.calibtext import CALIB_TEXT

    print("| model | 8-bit cache | KL mean | KL p99 | top-1 |\n|---|---|---|---|---|")
    for name, m in references(Path(a.work), 512):
        hf, ids, ref = m.hf, m.ids, m.ref
        fq = FakeQuantKV(hf, m.model_type)
        fq.calibrating = True
        hf_logits(hf, m.tok.encode(CALIB_TEXT)[:1024])
        fq.calibrating = False
        for form, how in FORMS.items():
            fq.form = how
            r = compare(ref, hf_logits(hf, ids), ids)
            print(f"| {name} | {form} | {r['kl_mean']:.3g} | {r['kl_p99']:.3g} | {r['top1']:.3f} |",
                  flush=True)
        fq.form = (None, None)


if __name__ == "__main__":
    main()
