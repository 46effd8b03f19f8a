"""Qwen3-VL text decoder (model_type qwen3_vl; qwen3_vl_text is its language model alone).

The decoder is Qwen3 (GQA with per-head q/k RMSNorm before rope) with two multimodal additions:

  * M-RoPE, interleaved: each rotary frequency j reads one of three position axes (t, h, w);
    text tokens have t = h = w, image tokens their grid (t, row, col) offset by the text before
    them (``runtime/multimodal.py mrope_positions``, as HF ``get_rope_index``). The host makes
    cos/sin from [3, T] positions (``HostInputs.rope_tables``); the graphs are plain rope graphs.
  * DeepStack: the vision tower emits one extra feature map per entry of
    ``vision_config.deepstack_visual_indexes``; feature i is added to the hidden state *after*
    text layer i at the image-token rows. The graphs of the first k layers take it as an input
    bound ``deepstack:<i>`` [1, T, H]; the engine binds zeros on text rows, which equals HF's
    masked add::

        hidden ─ layer 0 ─(+ deepstack:0)─ layer 1 ─(+ deepstack:1)─ ... ─ layer k ─ ...

The vision tower is ``families/qwen3_vl_vision.py`` (config.vision_config.model_type).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..manifest import EmbedSpec, HostRecipe, RopeSpec
from . import blocks
from .base import DenseArgs
from .graphio import GraphIO
from .qwen3 import Qwen3Family


@dataclass
class Args(DenseArgs):
    attention_bias: bool = False
    hidden_act: str = "silu"
    num_deepstack: int = 0  # len(vision_config.deepstack_visual_indexes): layers 0..k-1 take one

    @classmethod
    def from_config(cls, config: dict) -> Args:
        """From config.json (qwen3_vl with text_config + vision_config, or qwen3_vl_text), through
        the HF config classes so their defaults resolve as HF resolves them."""
        from transformers import Qwen3VLConfig, Qwen3VLTextConfig

        if "text_config" in config:
            cfg = Qwen3VLConfig.from_dict({k: v for k, v in config.items() if k != "model_type"})
            text, deepstack = cfg.text_config, len(cfg.vision_config.deepstack_visual_indexes)
            tie = bool(cfg.tie_word_embeddings)
        else:
            text = Qwen3VLTextConfig.from_dict(
                {k: v for k, v in config.items() if k != "model_type"})
            deepstack, tie = 0, bool(config.get("tie_word_embeddings", False))
        kw = {f: getattr(text, f) for f in cls.__dataclass_fields__
              if f not in ("model_type", "num_deepstack", "tie_word_embeddings")
              and hasattr(text, f)}
        return cls(model_type=config.get("model_type", "qwen3_vl"), tie_word_embeddings=tie,
                   num_deepstack=deepstack, **kw)


class Qwen3VLFamily(Qwen3Family):
    """Qwen3 attention + interleaved M-RoPE (host) + DeepStack inputs on the first layers."""

    residual_scaling = False  # the deepstack features add into the stream unscaled

    Args = Args

    def check_supported(self, args: Args) -> None:
        from ..errors import UnsupportedModelError

        if args.num_deepstack > args.num_hidden_layers:
            raise UnsupportedModelError(
                f"Qwen3-VL has {args.num_deepstack} deepstack features for "
                f"{args.num_hidden_layers} text layers")

    def host_recipe(self, hf, args: Args) -> HostRecipe:
        rot = self.text_model(hf).rotary_emb
        return HostRecipe(
            embed=EmbedSpec(table="embed_tokens", scale=1.0), positions="mrope",
            ropes=[RopeSpec(name="default", inv_freq="rope.default.inv_freq",
                            attention_scaling=float(getattr(rot, "attention_scaling", 1.0)),
                            # HF Qwen3VLTextRotaryEmbedding always interleaves its sections
                            mrope_section=[int(x) for x in rot.mrope_section],
                            mrope_interleaved=True)],
        )

    def decoder_module(self, hf, args: Args, layers: tuple[int, int], seq_len: int, context: int):
        return Qwen3VLShard(self, hf, args, layers, seq_len, context)


class Qwen3VLShard(blocks.DenseShard):
    """Dense Qwen3 layers [start, end) plus the deepstack adds of the layers below k.

    inputs : hidden [1,T,H], cos/sin [1,T,D], mask_full [1,1,T,C+T],
             deepstack_{i} [1,T,H] for each layer i < k in the shard, past.L{i}.k/v [1,KVH,C,D]
    outputs: hidden_out [1,T,H], new.L{i}.k/v [1,KVH,T,D]
    """

    def __init__(self, fam: Qwen3VLFamily, hf, args: Args, layers: tuple[int, int], seq_len: int,
                 context: int):
        super().__init__(fam, hf, args, layers, seq_len, context)
        self.deepstack = [i for i in self.layer_ids if i < args.num_deepstack]
        io = self.io
        self.io = GraphIO(
            inputs=io.inputs[:4] + [(f"deepstack_{i}", f"deepstack:{i}") for i in self.deepstack]
            + io.inputs[4:],
            outputs=io.outputs,
        )

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        base = super().example_inputs()
        feats = [torch.randn(1, self.seq_len, self.args.hidden_size) * 0.1 for _ in self.deepstack]
        return (*base[:4], *feats, *base[4:])

    def forward(self, hidden, cos, sin, mask, *rest):
        n = len(self.deepstack)
        feats = dict(zip(self.deepstack, rest[:n], strict=True))
        past = rest[n:]
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, T, D]: broadcast over heads
        new = []
        for j, (i, layer) in enumerate(zip(self.layer_ids, self.layers, strict=True)):
            hidden, k, v = layer(hidden, cos, sin, mask, past[2 * j], past[2 * j + 1])
            if i in feats:  # zero on text rows: the same as HF's add at the image rows only
                hidden = hidden + feats[i]
            new += [k, v]
        return (hidden, *new)


FAMILY = Qwen3VLFamily()
