"""Gemma-3 text decoder (model_type gemma3_text; the language model inside gemma3 checkpoints).

Per layer (HF Gemma3DecoderLayer; every RMSNorm is x * (1 + w), computed in fp32)::

    x ─ in_norm ─ attn ─ post_attn_norm ─(+)─ pre_ff_norm ─ MLP(gelu_tanh) ─ post_ff_norm ─(+)─▶

  attention: q/k norms (1 + w) per head, GQA, scores scaled by query_pre_attn_scalar^-0.5
    sliding layers: rope θ = rope_parameters.sliding_attention (1e4), window W (key visible iff
                    q - k < W), a ring of min(W, context) rows
    full layers:    rope θ = rope_parameters.full_attention (1e6; linear-scaled on the 4B+)
  embedding scaled by sqrt(hidden_size) on the host; the head is tied to it; no logit softcap on
  Gemma-3 (final_logit_softcapping is honoured where a config sets it).

Gemma-3 is Gemma-4 without per-layer inputs, KV sharing, the v norm and the layer scalar, with
(1 + w) norms and a query scale: the step graph is Gemma-4's (``gemma4.Gemma4Shard``: sliding
rings, full caches written in place on the cpu target), its layers ``Gemma3Layer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from . import blocks, gemma4
from .base import Accepts
from .form import PLAIN, ExportForm


@dataclass
class Args(gemma4.Args):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False

    @classmethod
    def from_config(cls, config: dict) -> Args:
        """From config.json (gemma3_text, or gemma3 with text_config), through the HF config
        object (it fills layer_types from the sliding-window pattern where a config has none)."""
        from transformers import Gemma3TextConfig

        text = config.get("text_config") or config
        cfg = Gemma3TextConfig.from_dict({k: v for k, v in text.items() if k != "model_type"})
        L = cfg.num_hidden_layers
        return cls(
            model_type=config.get("model_type", "gemma3_text"), hidden_size=cfg.hidden_size,
            num_hidden_layers=L, num_attention_heads=cfg.num_attention_heads,
            vocab_size=cfg.vocab_size, vocab_size_per_layer_input=0,
            hidden_size_per_layer_input=0, sliding_window=cfg.sliding_window,
            rms_norm_eps=cfg.rms_norm_eps, final_logit_softcapping=cfg.final_logit_softcapping,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", cfg.tie_word_embeddings)),
            enable_moe_block=False, hidden_activation=cfg.hidden_activation,
            layer_types=list(cfg.layer_types), head_dims=[cfg.head_dim] * L,
            kv_heads=[cfg.num_key_value_heads] * L, donors=[None] * L,
            query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
            attn_logit_softcapping=cfg.attn_logit_softcapping,
            use_bidirectional_attention=bool(getattr(cfg, "use_bidirectional_attention", False)),
        )


class Gemma3Family(gemma4.Gemma4Family):
    """Gemma-3 text: sliding + full attention with their own ropes, (1 + w) norms."""

    Args = Args
    # not Gemma-4's: its image bidirectionality and MoE fields are not Gemma-3 config fields
    ACCEPTED: ClassVar[dict[str, Accepts]] = {
        "attn_logit_softcapping": Accepts(
            (None, 0, 0.0), "the static attention has no score softcap"),
        "use_bidirectional_attention": Accepts(
            (False, None), "an encoder model such as EmbeddingGemma attends both ways; the "
                           "graphs are a causal decoder's"),
    }

    def layer_module(self, hf_layer, args: Args, i: int, form: ExportForm = PLAIN) -> nn.Module:
        return Gemma3Layer(hf_layer, args, form)

    def head_module(self, hf, args: Args, form: ExportForm = PLAIN):
        tm = self.text_model(hf)
        return blocks.Head(tm.norm, hf.lm_head, softcap=args.final_logit_softcapping,
                           hidden_size=args.hidden_size, unit_offset=True, form=form)


class Gemma3Layer(gemma4.Gemma4Layer):
    """One HF Gemma3DecoderLayer in ``Gemma4Layer``'s interface (static, shared and in-place
    forwards): its four norms, q/k norms (1 + w), no per-layer input, no layer scalar."""

    def __init__(self, hf_layer: nn.Module, args: Args, form: ExportForm = PLAIN):
        nn.Module.__init__(self)
        a = hf_layer.self_attn

        def norm(m):
            return blocks.RMSNorm.from_hf(m, unit_offset=True, form=form)

        self.shared, self.has_ple = False, False
        self.attn = blocks.StaticAttention(
            a, n_heads=args.num_attention_heads, n_kv=args.kv_heads[0], head_dim=args.head_dims[0],
            scaling=args.query_pre_attn_scalar ** -0.5, q_norm=norm(a.q_norm), k_norm=norm(a.k_norm),
            form=form)
        self._norms(hf_layer, form, unit_offset=True)
        self.mlp = blocks.GatedMLP(hf_layer.mlp, args.hidden_activation, form)
        self.register_buffer("layer_scalar", None)


FAMILY = Gemma3Family()
