"""Llama (and, through families.REMAP, qwen2 / mistral): the plain dense GQA decoder.

    embed (host) -> [ RMSNorm -> GQA attention (rope) -> + -> RMSNorm -> SwiGLU MLP -> + ] x L
                 -> final RMSNorm -> lm_head (tied or not)

Everything llama-specific is the default of ``DecoderFamily``; what differs per architecture twin
(q/k/v biases in qwen2, llama3 / yarn rope scaling) is carried by the reused HF modules (the Linear
layers keep their biases) and by the HF rotary module's own ``inv_freq`` / ``attention_scaling``,
which the build copies into the bundle — so every HF rope type that precomputes ``inv_freq`` works.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import DecoderFamily, DenseArgs


@dataclass
class Args(DenseArgs):
    attention_bias: bool = False
    mlp_bias: bool = False


class LlamaFamily(DecoderFamily):
    """Dense GQA decoder with full causal attention."""

    Args = Args

    def check_supported(self, args: Args) -> None:
        """Refuse configs whose math these export modules do not reproduce."""
        from ..bundle.errors import UnsupportedModelError

        if args.use_sliding_window and args.sliding_window:
            raise UnsupportedModelError(
                f"{args.model_type} with sliding_window={args.sliding_window} is not supported by "
                "the llama family yet (full-attention caches only)"
            )


FAMILY = LlamaFamily()
