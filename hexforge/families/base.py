"""The family contract and the pieces every decoder family shares.

A family module (``families/<model_type>.py``) provides::

    Args                      dataclass of HF config field names; Args.from_config(dict)
    FAMILY = DecoderFamily subclass instance with:
      load_hf(ckpt_dir)       -> the HF model, fp32, eval (build time only)
      state_spec(args, ctx)   -> [StateSpec]     per layer: kind, shape, dtype (manifest "state")
      mask_groups(args, ctx)  -> [MaskGroup]     full / sliding cache groups
      host_tensors(hf, args)  -> {name: ndarray} embedding table, rope inv_freq, PLE tables ...
      host_recipe(hf, args)   -> HostRecipe      how the host makes graph inputs
      layer_weight_bytes(hf)  -> [int]           per-layer weight bytes, for the shard planner
      decoder_module(hf, args, layers, seq_len, ctx) -> torch module with .io (GraphIO)  [export]
      head_module(hf, args)   -> torch module with .io                                 [export]
      reference_layers(hf)    -> the HF decoder layers (hooked by the oracle for per-shard cosine)

This module itself is torch-free; ``families/blocks.py`` holds the torch export building blocks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..manifest import EmbedSpec, HostRecipe, MaskGroup, RopeSpec, StateSpec, TensorSpec


def from_config(cls, config: dict):
    """Build dataclass ``cls`` from an HF config dict: HF field names, unknown keys ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in config.items() if k in names})


@dataclass
class GraphIO:
    """Names + binds of an export module's inputs/outputs, in forward-argument order.

    Attached to the export module (ExecuTorch-style export metadata); build turns it into the
    manifest's TensorSpecs after export, reading shapes/dtypes from the example inputs.
    """

    inputs: list[tuple[str, str]] = field(default_factory=list)  # (onnx name, bind)
    outputs: list[tuple[str, str]] = field(default_factory=list)

    def specs(self, arrays: list[Any], which: str) -> list[TensorSpec]:
        pairs = self.inputs if which == "inputs" else self.outputs
        return [
            TensorSpec(name=n, bind=b, shape=list(a.shape), dtype=str(a.dtype).replace("torch.", ""))
            for (n, b), a in zip(pairs, arrays, strict=True)
        ]


@dataclass
class DenseArgs:
    """HF field names shared by the llama-like dense decoders (llama, qwen2, mistral, qwen3)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 0
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    use_sliding_window: bool = False

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict):
        return from_config(cls, config)


class DecoderFamily:
    """Default implementation of the contract for llama-like dense decoders (one rope, full KV).

    Families override the pieces that differ; the export modules live in ``blocks``.
    """

    Args = DenseArgs

    def check_supported(self, args) -> None:
        """Raise UnsupportedModelError for configs these export modules do not reproduce."""

    # ---- build-time: the HF model ----
    def load_hf(self, ckpt_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        config = json.loads((Path(ckpt_dir) / "config.json").read_text())
        if any(isinstance(config.get(k), dict) for k in ("vision_config", "audio_config")):
            # the encoders too: the full image/audio-text-to-text model
            from transformers import AutoModelForImageTextToText as AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(
            str(ckpt_dir), dtype=torch.float32, use_safetensors=True, attn_implementation="eager"
        )
        return model.eval()

    def text_model(self, hf):
        """The decoder stack: ``hf.model``, or its ``language_model`` in multimodal wrappers."""
        inner = hf.model
        return inner if hasattr(inner, "layers") else inner.language_model

    def reference_layers(self, hf):
        return list(self.text_model(hf).layers)

    # ---- the state, masks, host recipe ----
    def mask_groups(self, args, context: int) -> list[MaskGroup]:
        return [MaskGroup(name="full", capacity=context, window=None)]

    def state_spec(self, args, context: int) -> list[StateSpec]:
        shape = [args.num_key_value_heads, context, args.head_dim]
        return [
            StateSpec(name=f"L{i}.{kv}", layer=i, kind="kv_full", shape=shape, group="full")
            for i in range(args.num_hidden_layers)
            for kv in ("k", "v")
        ]

    def host_recipe(self, hf, args) -> HostRecipe:
        rot = self.text_model(hf).rotary_emb
        return HostRecipe(
            embed=EmbedSpec(table="embed_tokens", scale=1.0),
            ropes=[RopeSpec(name="default", inv_freq="rope.default.inv_freq",
                            attention_scaling=float(getattr(rot, "attention_scaling", 1.0)))],
        )

    def host_tensors(self, hf, args) -> dict[str, np.ndarray]:
        tm = self.text_model(hf)
        rot = tm.rotary_emb
        return {
            "embed_tokens": tm.embed_tokens.weight.detach().float().numpy(),
            "rope.default.inv_freq": rot.inv_freq.detach().float().numpy(),
        }

    def layer_weight_bytes(self, hf, bytes_per_weight: float) -> list[int]:
        return [
            int(sum(p.numel() for p in layer.parameters()) * bytes_per_weight)
            for layer in self.reference_layers(hf)
        ]

    def head_weight_bytes(self, hf, bytes_per_weight: float) -> int:
        return int(hf.lm_head.weight.numel() * bytes_per_weight)

    # ---- export modules ----
    def decoder_module(self, hf, args, layers: tuple[int, int], seq_len: int, context: int):
        from . import blocks

        return blocks.DenseShard(self, hf, args, layers, seq_len, context)

    def head_module(self, hf, args):
        from . import blocks

        tm = self.text_model(hf)
        return blocks.Head(tm.norm, hf.lm_head, softcap=None)

    def attention(self, hf_layer, args):
        """The static attention block for one HF layer (families add q/k norms here)."""
        from . import blocks

        return blocks.StaticAttention(
            hf_layer.self_attn, n_heads=args.num_attention_heads, n_kv=args.num_key_value_heads,
            head_dim=args.head_dim, scaling=args.head_dim**-0.5,
        )


class EncoderFamily:
    """The contract of a media encoder family: ``families/<sub-config model_type>.py`` (e.g.
    ``gemma4_vision.py`` for config.vision_config.model_type == "gemma4_vision") provides
    ``ENCODER = <EncoderFamily subclass>()`` with::

      modality                       "image" | "audio"
      spec(hf, config)     -> EncoderSpec   manifest entry: preprocessor key + params, placeholder
                                            ids/text, max_soft_tokens (build time)
      encoder_module(hf, spec) -> torch module with .io (GraphIO): inputs bound "media:<key>" (the
                                  preprocessor's output keys, batch dim 1, fixed shapes), outputs
                                  "soft" [1, S, H_text] (+ "deepstack:<i>" [1, S, H_text])  [export]
      example_inputs(spec) -> {key: ndarray}   a real preprocessed sample (synthetic media through
                                  the runtime preprocessor) for export, calibration and the oracle
      reference(hf, inputs) -> {bind: ndarray [n, H]}  HF's own soft tokens (+ deepstack) for the
                                  same preprocessed inputs, valid rows only (the oracle)

    The host preprocessing is runtime code (numpy, no torch): a class in runtime/vision.py or
    runtime/audio.py registered in runtime/multimodal.py PREPROCESSORS under ``spec.preprocessor``.
    """

    modality: str = ""

    def spec(self, hf, config: dict):
        raise NotImplementedError

    def encoder_module(self, hf, spec):
        raise NotImplementedError

    def example_inputs(self, spec) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def reference(self, hf, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError


def encoder_families(config: dict) -> list[EncoderFamily]:
    """The encoders a multimodal checkpoint carries: one per ``*_config`` sub-config whose
    model_type has a family file (vision_config, audio_config)."""
    from . import load_family

    out = []
    for key in ("vision_config", "audio_config"):
        sub = config.get(key)
        if isinstance(sub, dict) and sub.get("model_type"):
            out.append(load_family(sub["model_type"]).ENCODER)
    return out
