"""The family contract and the pieces every decoder family shares.

A family module (``families/<model_type>.py``) provides::

    Args                      dataclass of HF config field names; Args.from_config(dict)
    FAMILY = DecoderFamily subclass instance with:
      load_hf(ckpt_dir)       -> the HF model, eval, in the checkpoint's stored dtype when that
                                 is bf16/fp16 (else fp32); float32(...) / float32_forward(hf)
                                 make the parts being exported / run compute in fp32 (build time)
      state_spec(args, ctx)   -> [StateSpec]     per layer: kind, shape, dtype (manifest "state")
      mask_groups(args, ctx)  -> [MaskGroup]     full / sliding cache groups
      host_tensors(hf, args)  -> {name: ndarray} embedding table, rope inv_freq, PLE tables ...
      host_recipe(hf, args)   -> HostRecipe      how the host makes graph inputs
      layer_weight_bytes(hf)  -> [int]           per-layer weight bytes, for the shard planner
      decoder_module(hf, args, layers, seq_len, ctx, form) -> torch module with .io   [export]
      cpu_step_module(hf, args, layers, seq_len, ctx) -> the cpu target's AR-N / AR-1 module [export]
      head_module(hf, args, form) -> torch module with .io                            [export]
        (form: the frozen ExportForm each block is made in, families/form.py)
      reference_layers(hf)    -> the HF decoder layers (hooked by the oracle for per-shard cosine)

This module itself is torch-free; ``families/blocks.py`` holds the torch export building blocks,
``graphio.py`` the export modules' input/output names, ``lowp.py`` the bf16 loading and fp32 upcast.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..bundle.manifest import EmbedSpec, HostRecipe, MaskGroup, RopeSpec, StateSpec
from . import lowp
from .form import CPU, PLAIN, ExportForm


@dataclass(frozen=True)
class Accepts:
    """A config field's values a family implements (``DecoderFamily.ACCEPTED``), and what the
    others would change that the graphs do not do."""

    values: tuple
    why: str


def _same(a, b) -> bool:
    """Config equality that keeps JSON's types apart (``False == 0`` in Python, not in a config)."""
    return type(a) is type(b) and a == b


def from_config(cls, config: dict):
    """Build dataclass ``cls`` from an HF config dict: HF field names, unknown keys ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in config.items() if k in names})


@dataclass(frozen=True)
class GenieRope:
    """One of Genie's positional-encoding entries: Genie computes the tables itself, cos / sin of
    position * 1 / theta^(2i / (2 dim)) for i < dim (with ``scaling`` applied), into the inputs
    ``<prefix>position_ids_cos`` / ``_sin`` [1, 1, AR, dim]. Genie reads ``rope-theta`` as an
    integer (truncated: its dump of theta 31.62 gave 31^(-i/4)), so theta must be whole.

    ``used``: the graph reads only the first ``used`` frequencies and rotates no more (Gemma-4's
    proportional rope: HF's inv_freq is zero past them); None: all ``dim``."""

    prefix: str  # "" for the default rope, else a cache group's prefix
    dim: int  # Genie's rope-dim: the frequencies, half the rotated dims
    theta: float
    scaling: dict | None = None  # Genie's rope-scaling block (llama3, linear), as it spells it
    rope: str = "default"  # the host recipe's rope (RopeSpec.name) it stands for
    used: int | None = None  # the frequencies the graph reads (the first ones)


@dataclass(frozen=True)
class GenieCache:
    """One of Genie's cache groups: its layers' tensors are ``<prefix>key_<L>_in`` ...; the first
    group of a spec is the default one, whose mask is ``attention_mask`` (the others read it
    too: Genie gives a group a mask of its own only with a sliding-window eviction, which
    hexforge's graphs do not use, docs/genie.md)."""

    prefix: str  # "past_" for the default group
    kv_dim: int  # its layers' head dim (a head of D = f x kv_dim is f Genie heads)


@dataclass(frozen=True)
class GenieSpec:
    """What a family's Genie graphs need from Genie's config beside the dialog (docs/genie.md):
    its cache groups, its ropes (a rope with a prefix applies to the cache group of that
    prefix), the host tables whose rows (x scale), side by side, make Genie's embedding LUT
    (the graphs then take ``inputs_embeds``; without it the first graph gathers from
    ``input_ids``), whether layers carry a linear-attention state, and whether each LUT row
    ends with a media flag (``media_flag``)."""

    caches: tuple[GenieCache, ...]
    ropes: tuple[GenieRope, ...]
    lut: tuple[tuple[str, float], ...] = ()
    linear_attention: bool = False
    # one more LUT column: 0.0 on every token's row, 1.0 on the rows a pipeline's media node
    # writes. Genie writes a side input (Qwen3-VL's deepstack rows) on media rows only and leaves
    # the chunk's other rows as it found them (garbage up to 2e34, measured), so the graph gates
    # the side input by this column: the one per-row fact Genie writes on every row.
    media_flag: bool = False


def genie_rope_scaling(params: dict) -> dict | None:
    """Genie's rope-scaling block for an HF rope_parameters dict (types Genie computes as HF)."""
    from ..bundle.errors import UnsupportedModelError

    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind == "llama3":
        return {"rope-type": "llama3", "factor": params["factor"],
                "low-freq-factor": params["low_freq_factor"],
                "high-freq-factor": params["high_freq_factor"],
                "original-max-position-embeddings": params["original_max_position_embeddings"]}
    if kind == "linear":
        return {"rope-type": "linear", "factor": params["factor"]}
    raise UnsupportedModelError(f"--genie: rope type {kind!r} is not mapped to Genie's "
                                "rope-scaling")


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
    # fp16 graphs may carry the residual stream scaled (``ExportForm.residual_scale``): every
    # module that reads or writes it in this family's shards and head applies the form's scale
    residual_scaling = True

    # Config fields that change the math, each with the values these graphs reproduce (and why
    # the others are not): any other value is refused at build time by ``check_config``. Read
    # from the text config (``text_config`` where the checkpoint nests one); a field the config
    # leaves out takes HF's default, which is one of the accepted values. A field HF adds later
    # is not caught here: new fields are read when a family is brought up to a transformers pin.
    ACCEPTED: ClassVar[dict[str, Accepts]] = {}

    def check_config(self, config: dict) -> None:
        """Refuse, in one line, a config whose ``ACCEPTED`` fields hold a value the graphs do not
        implement: a build would pass its text-only oracle and diverge on the prompts that reach
        the unimplemented path (Gemma-4's bidirectional image attention did, at token 3)."""
        from ..bundle.errors import UnsupportedModelError

        nested = isinstance(config.get("text_config"), dict)
        text = config["text_config"] if nested else config
        for name, accepts in self.ACCEPTED.items():
            if name in text and not any(_same(text[name], v) for v in accepts.values):
                where = f"text_config.{name}" if nested else name
                allowed = " or ".join("absent/null" if v is None else json.dumps(v)
                                      for v in accepts.values)
                raise UnsupportedModelError(
                    f"{config.get('model_type')} with {where}={json.dumps(text[name])} is not "
                    f"supported: {accepts.why} (supported: {allowed})")

    def check_supported(self, args) -> None:
        """Raise UnsupportedModelError for configs these export modules do not reproduce (checks
        that need the resolved Args; single config fields go in ``ACCEPTED``)."""

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
        stored = lowp.stored_lowp_dtype(ckpt_dir)  # bf16/fp16 checkpoints stay so; upcast on use
        dtype = getattr(torch, stored) if stored else torch.float32
        model = AutoModelForCausalLM.from_pretrained(
            str(ckpt_dir), dtype=dtype, use_safetensors=True, attn_implementation="eager"
        )
        if stored:
            lowp.float32_buffers(model)
        model._hexforge_lowp = bool(stored)
        return model.eval()

    # ---- fp32 on use (a bf16/fp16-loaded model; no-ops on an fp32 one) ----
    def float32(self, hf, layers: tuple[int, int] | None = None, head: bool = False,
                towers: bool = True):
        """Context: decoder layers [a, b), the small tensors outside them (norms, projections,
        and with ``towers`` the encoder towers: a decoder shard's export leaves them bf16, they
        are 0.4-0.9 B parameters at real size) and with ``head`` the lm_head in fp32 (the
        bf16/fp16 values upcast, which is exact), for building + exporting modules from them;
        the originals come back after."""
        return lowp.float32_parts(hf, self.reference_layers(hf), layers, head,
                                  None if towers else self.text_model(hf))

    def float32_forward(self, hf):
        """Context: HF forward passes compute exactly as an fp32 model holding the same values
        (the oracle, calibration): small tensors and the lm_head upcast for the duration, each
        decoder layer upcast by hooks only while it runs, large gather-only embedding tables
        (token embeddings, Gemma-4's per-layer tables) gather their rows and upcast only those."""
        return lowp.float32_forward(hf, self.reference_layers(hf))

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
        return {  # a torch table: written in its precision, in chunks (write_host_tensors)
            "embed_tokens": tm.embed_tokens.weight.detach(),
            "rope.default.inv_freq": rot.inv_freq.detach().float().numpy(),
        }

    def layer_weight_bytes(self, hf, bytes_per_weight: float) -> list[int]:
        return [
            int(sum(p.numel() for p in layer.parameters()) * bytes_per_weight)
            for layer in self.reference_layers(hf)
        ]

    def head_weight_bytes(self, hf, bytes_per_weight: float) -> int:
        return int(hf.lm_head.weight.numel() * bytes_per_weight)

    def tower_parameters(self, hf) -> int:
        """Parameters outside the decoder stack and the lm_head: the encoder towers and their
        projections (counted as stored: no module is built, a bf16 tower cannot run here)."""
        text = {id(p) for m in (self.text_model(hf), hf.lm_head) for p in m.parameters()}
        return sum(p.numel() for p in hf.parameters() if id(p) not in text)

    # ---- export modules ----
    def decoder_module(self, hf, args, layers: tuple[int, int], seq_len: int, context: int,
                       form: ExportForm = PLAIN):
        """Decoder layers ``layers`` as one static step of ``seq_len`` rows over a ``context``-row
        cache, written in ``form`` (the cpu, fixed-point or fp16 graph: form.py)."""
        from . import blocks

        return blocks.DenseShard(self, hf, args, layers, seq_len, context, form)

    def cpu_step_module(self, hf, args, layers: tuple[int, int], seq_len: int, context: int):
        """The cpu target's AR-N prefill (seq_len N) and AR-1 decode (1) modules: full-cache
        attention runs onnxruntime's GroupQueryAttention on the cache in place
        (``blocks.InPlaceCache``), reading only the rows held instead of all ``context`` of them
        (and, in a prefill chunk, only the causal ones)."""
        from . import blocks

        return blocks.InPlaceCache.wrap(
            self.decoder_module(hf, args, layers, seq_len, context, CPU),
            self.cache_row_rope_tables(hf, args, context))

    def cache_row_rope_tables(self, hf, args, rows: int) -> dict[str, tuple]:
        """The host's cos/sin tables [rows, R] (``runtime.host.rope_tables``) of each rope whose
        position is the token's cache row: every rope of a family with 1-D positions; none under
        M-RoPE, whose positions the host derives from the media and shifts after it."""
        from ..runtime.host import rope_tables

        recipe = self.host_recipe(hf, args)
        if recipe.positions != "1d":
            return {}
        tensors = self.host_tensors(hf, args)
        return {r.name: rope_tables(np.asarray(tensors[r.inv_freq]), r.attention_scaling, rows)
                for r in recipe.ropes if r.mrope_section is None}

    def head_module(self, hf, args, form: ExportForm = PLAIN):
        """Final norm + lm_head on one hidden row, in ``form``."""
        from . import blocks

        tm = self.text_model(hf)
        return blocks.Head(tm.norm, hf.lm_head, softcap=None, form=form)

    def attention(self, hf_layer, args, form: ExportForm = PLAIN):
        """The static attention block for one HF layer (families add q/k norms here)."""
        from . import blocks

        return blocks.StaticAttention(
            hf_layer.self_attn, n_heads=args.num_attention_heads, n_kv=args.num_key_value_heads,
            head_dim=args.head_dim, scaling=args.head_dim**-0.5, form=form,
        )


    # ---- Genie: the decoder in Qualcomm's runtime (forge/genie/decoder.py writes the bundle) ----
    def genie_spec(self, hf, args) -> GenieSpec:
        """One cache group of head_dim, one rope (the config's), no per-layer inputs."""
        from ..bundle.errors import UnsupportedModelError

        cfg = hf.config.get_text_config().to_dict()
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise UnsupportedModelError("--genie: the config names no rope_theta")
        rotated = len(self.text_model(hf).rotary_emb.inv_freq)
        return GenieSpec(caches=(GenieCache("past_", args.head_dim),),
                         ropes=(GenieRope("", rotated, float(theta), genie_rope_scaling(params)),))

    def genie_step(self, hf, args, host, layers: tuple[int, int], seq_len: int, context: int,
                   residual_scale: float):
        """Decoder layers ``layers`` for AR ``seq_len`` in Genie's I/O contract (the embedding
        gather in the first split, the head in the last): ``genieio.DenseGenieStep``."""
        from .genieio import DenseGenieStep, GenieContract

        return DenseGenieStep.make(self, hf, args, host, layers, seq_len, context, GenieContract(),
                                   residual_scale)

    def genie_lade_spec(self, hf, args) -> GenieSpec:
        """The Genie config's model part for the lade form (``genie_lade_step``'s graphs)."""
        return self.genie_spec(hf, args)

    def genie_lade_step(self, inv_freq: dict):
        """``genie_step`` (the same signature) in the scatter form with the lookahead guard
        (``--genie-kv lade``: ``genielade.LadeGuardStep``); ``inv_freq``: the frequencies Genie
        computes for each of ``genie_spec``'s ropes, by its host rope name (one here)."""
        from .genielade import LadeGuardStep

        (inv,) = inv_freq.values()

        def step(hf, args, host, layers: tuple[int, int], seq_len: int, context: int,
                 residual_scale: float):
            return LadeGuardStep.make_guarded(self, hf, args, host, layers, seq_len, context,
                                              residual_scale, inv)
        return step

    def check_genie_lade(self, args) -> None:
        """Refuse, before any work, a config whose Genie graphs have no lade form."""
        from ..bundle.errors import UnsupportedModelError

        if type(self).genie_step is not DecoderFamily.genie_step \
                and type(self).genie_lade_step is DecoderFamily.genie_lade_step:
            raise UnsupportedModelError(
                f"--genie-kv lade: {args.model_type}'s Genie graphs take the concat form only "
                "(lade: llama, qwen2, mistral, qwen3, gemma3_text)")

    def check_genie(self, args) -> None:
        """Refuse, before any work, a config these Genie graphs do not express."""
        from ..bundle.errors import UnsupportedModelError

        own = type(self).decoder_module is not DecoderFamily.decoder_module
        if own or getattr(args, "layer_types", None):
            raise UnsupportedModelError(
                f"--genie: {args.model_type} states no Genie mapping of its own")


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

    def genie_row_bound(self, hf, spec) -> float | None:
        """A bound on |value| of every column of the soft tokens this tower's Genie node emits,
        proven from its weights, or None (unknown). Genie's 16-bit embedding LUT holds media
        rows in its own encoding (a node's rows are converted to it, the host's quantized), so
        a bundle whose every node states one gets a LUT whose range covers it, half a float32
        LUT's bytes (forge/genie/towers.media_row_bound); one None keeps the LUT float32."""
        return None

    def genie_node(self, hf, spec, row_tail: np.ndarray | None):
        """The tower as a Genie pipeline node (families/genienode.py GenieNodeForm; ``row_tail``
        the LUT columns after the soft token in a media row). A tower without one is left out
        of a bundle's Genie pipeline (forge/genie/towers.py), with the reason."""
        from ..bundle.errors import UnsupportedModelError

        raise UnsupportedModelError(f"the {self.modality} tower states no Genie node form")
