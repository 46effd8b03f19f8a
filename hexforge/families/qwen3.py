"""Qwen3: the llama block plus per-head RMSNorm on q and k (before rope), explicit head_dim.

    x -> q_proj -> view [T, nH, D] -> q_norm(D) -> rope ─┐
      -> k_proj -> view [T, KVH, D] -> k_norm(D) -> rope ─┴─ GQA softmax attention -> o_proj
"""

from __future__ import annotations

from dataclasses import dataclass

from . import llama
from .base import DenseArgs
from .form import PLAIN, ExportForm


@dataclass
class Args(DenseArgs):
    attention_bias: bool = False


class Qwen3Family(llama.LlamaFamily):
    """Dense GQA decoder with q/k head norms."""

    Args = Args

    def attention(self, hf_layer, args, form: ExportForm = PLAIN):
        from . import blocks

        a = hf_layer.self_attn
        return blocks.StaticAttention(
            a, n_heads=args.num_attention_heads, n_kv=args.num_key_value_heads,
            head_dim=args.head_dim, scaling=args.head_dim**-0.5,
            q_norm=blocks.RMSNorm.from_hf(a.q_norm, form=form),
            k_norm=blocks.RMSNorm.from_hf(a.k_norm, form=form), form=form,
        )


FAMILY = Qwen3Family()
