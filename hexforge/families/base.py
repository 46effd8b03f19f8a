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
      decoder_module(hf, args, layers, seq_len, ctx) -> torch module with .io (GraphIO)  [export]
      cpu_step_module(hf, args, layers, seq_len, ctx) -> the cpu target's AR-N / AR-1 module [export]
      head_module(hf, args)   -> torch module with .io                                 [export]
      reference_layers(hf)    -> the HF decoder layers (hooked by the oracle for per-shard cosine)

This module itself is torch-free; ``families/blocks.py`` holds the torch export building blocks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..manifest import EmbedSpec, HostRecipe, MaskGroup, RopeSpec, StateSpec, TensorSpec


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
    # fp16 graphs may carry the residual stream scaled (blocks.use_fp16_form): every module
    # that reads or writes it in this family's shards and head has ``set_residual_scale``
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
        from ..errors import UnsupportedModelError

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
        lowp = stored_lowp_dtype(ckpt_dir)  # bf16/fp16 checkpoints stay so; upcast on use
        dtype = getattr(torch, lowp) if lowp else torch.float32
        model = AutoModelForCausalLM.from_pretrained(
            str(ckpt_dir), dtype=dtype, use_safetensors=True, attn_implementation="eager"
        )
        if lowp:
            float32_buffers(model)
        model._hexforge_lowp = bool(lowp)
        return model.eval()

    # ---- fp32 on use (a bf16/fp16-loaded model; no-ops on an fp32 one) ----
    def float32(self, hf, layers: tuple[int, int] | None = None, head: bool = False):
        """Context: decoder layers [a, b), the small tensors outside them (norms, projections,
        encoder towers) and with ``head`` the lm_head in fp32 (the bf16/fp16 values upcast, which
        is exact), for building + exporting modules from them; the originals come back after."""
        if not is_lowp(hf):
            return _nullcontext()
        params = _small_params(hf, self.reference_layers(hf))
        if layers is not None:
            for layer in self.reference_layers(hf)[layers[0]:layers[1]]:
                params += list(layer.parameters())
        if head and getattr(hf, "lm_head", None) is not None:
            params += list(hf.lm_head.parameters())
        return _Upcast(params)

    def float32_forward(self, hf):
        """Context: HF forward passes compute exactly as an fp32 model holding the same values
        (the oracle, calibration): small tensors and the lm_head upcast for the duration, each
        decoder layer upcast by hooks only while it runs, large gather-only embedding tables
        (token embeddings, Gemma-4's per-layer tables) gather their rows and upcast only those."""
        if not is_lowp(hf):
            return _nullcontext()
        return _Float32Forward(hf, self.reference_layers(hf))

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

    # ---- export modules ----
    def decoder_module(self, hf, args, layers: tuple[int, int], seq_len: int, context: int):
        from . import blocks

        return blocks.DenseShard(self, hf, args, layers, seq_len, context)

    def cpu_step_module(self, hf, args, layers: tuple[int, int], seq_len: int, context: int):
        """The cpu target's AR-N prefill (seq_len N) and AR-1 decode (1) modules: full-cache
        attention runs onnxruntime's GroupQueryAttention on the cache in place
        (``blocks.InPlaceCache``), reading only the rows held instead of all ``context`` of them
        (and, in a prefill chunk, only the causal ones)."""
        from . import blocks

        return blocks.InPlaceCache.wrap(
            blocks.use_cpu_kernels(self.decoder_module(hf, args, layers, seq_len, context)),
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


# ---- streaming weights: low-precision checkpoints stay low-precision, fp32 on use -------------------

LOWP_ST = {"BF16": "bfloat16", "F16": "float16"}
FLOAT_ST = {"BF16", "F16", "F32", "F64", "F8_E5M2", "F8_E4M3"}
BIG_TABLE = 1 << 24  # embedding tables with more elements are gathered, never upcast whole


def stored_lowp_dtype(ckpt_dir: Path) -> str | None:
    """"bfloat16" / "float16" when every floating tensor of the checkpoint's safetensors is
    stored so (real checkpoints: bf16), else None (fp32 or mixed: load in fp32 as before)."""
    dtypes = set()
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        dtypes |= {t["dtype"] for k, t in header.items() if k != "__metadata__"} & FLOAT_ST
    return LOWP_ST[next(iter(dtypes))] if len(dtypes) == 1 and dtypes <= set(LOWP_ST) else None


def is_lowp(hf) -> bool:
    return bool(getattr(hf, "_hexforge_lowp", False))


def float32_buffers(model) -> None:
    """Every floating buffer of a low-precision-loaded model in fp32, as an fp32 load makes it:
    loaded ones (Gemma-4's layer_scalar) upcast; computed ones (rope inv_freq, embed_scale), which
    the init made in the low-precision default dtype, recomputed by the model's own
    ``_init_weights`` in fp32 (its init functions skip tensors flagged ``_is_hf_initialized``)."""
    import torch

    with torch.no_grad():
        for mod in model.modules():
            computed = []
            for name, buf in list(mod._buffers.items()):
                if buf is None or not buf.is_floating_point() or buf.dtype == torch.float32:
                    continue
                if name in mod._non_persistent_buffers_set:
                    mod._buffers[name] = torch.empty(buf.shape, dtype=torch.float32)
                    computed.append(name)
                else:
                    mod._buffers[name] = buf.float()
            if not computed:
                continue
            keep = [t for t in (*mod.parameters(recurse=False), *(
                b for n, b in mod._buffers.items() if b is not None and n not in computed))]
            saved = [getattr(t, "_is_hf_initialized", None) for t in keep]
            for t in keep:
                t._is_hf_initialized = True
            try:
                model._init_weights(mod)
            finally:
                for t, flag in zip(keep, saved, strict=True):
                    if flag is None:
                        del t._is_hf_initialized
                    else:
                        t._is_hf_initialized = flag


def _layer_param_ids(layers) -> set[int]:
    return {id(p) for layer in layers for p in layer.parameters()}


def _big_tables(hf, layers) -> list:
    """Embedding modules outside the decoder layers too large to upcast whole."""
    from torch import nn

    inside = {id(m) for layer in layers for m in layer.modules()}
    return [m for m in hf.modules() if isinstance(m, nn.Embedding) and id(m) not in inside
            and m.weight.numel() >= BIG_TABLE]


def _small_params(hf, layers) -> list:
    """Parameters outside the decoder layers, the large embedding tables and the lm_head."""
    skip = _layer_param_ids(layers) | {id(m.weight) for m in _big_tables(hf, layers)}
    head = getattr(hf, "lm_head", None)
    if head is not None:
        skip |= {id(p) for p in head.parameters()}
    return [p for p in hf.parameters() if id(p) not in skip]


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Upcast:
    """Parameters set to fp32 copies of their low-precision values (tied ones once); on exit they
    get their original tensors back (no rounding round trip, the fp32 copies are freed)."""

    def __init__(self, params=()):
        self.saved: dict[int, tuple] = {}
        self.params = list(params)

    def up(self, params) -> None:
        import torch

        for p in params:
            if id(p) not in self.saved and p.is_floating_point() and p.dtype != torch.float32:
                self.saved[id(p)] = (p, p.data)
                p.data = p.data.float()

    def down(self, params) -> None:
        for p in params:
            if id(p) in self.saved:
                p.data = self.saved.pop(id(p))[1]

    def __enter__(self):
        self.up(self.params)
        return self

    def __exit__(self, *exc):
        for p, data in self.saved.values():
            p.data = data
        self.saved.clear()
        return False


class _Float32Forward(_Upcast):
    def __init__(self, hf, layers):
        head = getattr(hf, "lm_head", None)
        super().__init__(_small_params(hf, layers) + (list(head.parameters()) if head else []))
        self.layers, self.tables, self.hooks = list(layers), _big_tables(hf, layers), []

    def __enter__(self):
        super().__enter__()
        for layer in self.layers:
            ps = list(layer.parameters())
            self.hooks.append(layer.register_forward_pre_hook(lambda *_, ps=ps: self.up(ps)))
            self.hooks.append(layer.register_forward_hook(lambda *_, ps=ps: self.down(ps)))
        for table in self.tables:
            if id(table.weight) not in self.saved:  # not tied to the (upcast) lm_head
                table.forward = _gather_fp32(table)
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        for table in self.tables:
            table.__dict__.pop("forward", None)
        return super().__exit__(*exc)


def _gather_fp32(table):
    """The table's own forward on an fp32 table of just the rows asked for (ids remapped): equal
    to gathering from the whole table upcast, without making it."""
    import torch

    forward = type(table).forward

    def gather(ids, *args, **kwargs):
        uniq, inv = torch.unique(ids, return_inverse=True)
        weight, pad = table._parameters["weight"], table.padding_idx
        table._parameters["weight"] = torch.nn.Parameter(weight.detach()[uniq].float(),
                                                         requires_grad=False)
        table.padding_idx = None  # affects gradients only; its index means nothing in the subset
        try:
            return forward(table, inv.reshape(ids.shape), *args, **kwargs)
        finally:
            table._parameters["weight"], table.padding_idx = weight, pad

    return gather


def write_host_tensors(path: Path, tensors: dict,
                       quantized: dict[str, tuple[int, int]] | None = None) -> None:
    """safetensors with floating torch tensors in the precision they hold: bf16 and fp16 tables
    as they are (BF16 / F16; the runtime upcasts the rows it gathers, which is exact), any other
    as F32, converted a chunk of rows at a time (a table never exists whole twice in memory).
    A bf16 checkpoint's tables were written as F32, twice its bytes: Gemma-4-E2B's per-layer
    table 9.4 GB instead of 4.7, Qwen3.5-0.8B's embedding 1.02 GB instead of 0.51.
    The tables named in ``quantized`` (name -> (bits, block)) are written as 8-bit rows + per-block
    scales (runtime/host.py ``Int8Table``; its own block) or int4 rows + scales per ``block``
    columns (``Int4Table``), a chunk at a time too. numpy arrays are written as they are."""
    import torch

    from ..runtime.host import INT4_SCALES, INT8_SCALES, int4_blocks, int8_blocks

    def blocks_of(bits: int, block: int):  # rows [r, D] float32 -> (q, scales)
        return lambda rows: (int8_blocks if bits == 8 else int4_blocks)(rows, block)

    np_st = {np.dtype(k): v for k, v in (("float32", "F32"), ("float16", "F16"), ("float64", "F64"),
             ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"),
             ("uint8", "U8"), ("bool", "BOOL"))}
    # torch dtype -> (safetensors dtype, bytes, the dtype whose bits are written)
    kept = {torch.bfloat16: ("BF16", 2, torch.int16), torch.float16: ("F16", 2, torch.float16)}
    items = []
    for name, t in tensors.items():
        if name in (quantized or {}):  # a 2-D table's rows and their scales, both made chunk by
            # chunk below (each chunk is quantized twice, once per item: cheaper than holding either)
            t = torch.as_tensor(t)
            if t.dim() != 2:
                raise ValueError(f"host table {name!r} is {t.dim()}-D; quantized tables are 2-D")
            bits, block = quantized[name]
            quant = blocks_of(bits, block)
            q, sc = quant(np.zeros((1, t.shape[1]), np.float32))
            st, suffix = np_st[q.dtype], INT8_SCALES if bits == 8 else INT4_SCALES
            items.append((name, st, 1, [t.shape[0], q.shape[1]], ("rows", t, quant)))
            items.append((name + suffix, "F32", 4, [t.shape[0], sc.shape[1]], ("scales", t, quant)))
            continue
        if isinstance(t, torch.Tensor):
            if t.is_floating_point():
                st, size, _ = kept.get(t.dtype, ("F32", 4, None))
                items.append((name, st, size, list(t.shape), t))
                continue
            t = t.numpy()
        t = np.ascontiguousarray(t)
        items.append((name, np_st[t.dtype], t.dtype.itemsize, list(t.shape), t))
    items.sort(key=lambda x: (-x[2], x[0]))  # wider dtypes first: every tensor stays aligned
    header, off = {}, 0
    for name, dt, size, shape, _ in items:
        n = int(np.prod(shape, dtype=np.int64)) * size
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for *_, t in items:
            if isinstance(t, np.ndarray):
                f.write(memoryview(t.reshape(-1)).cast("B"))
                continue
            part, t, quant = t if isinstance(t, tuple) else (None, t, None)
            flat = t.detach().reshape(t.shape[0], -1) if t.dim() > 1 else t.detach().reshape(1, -1)
            rows = max(1, (64 << 20) // max(1, flat.shape[1] * 4))  # ~64 MB of fp32 at a time
            for i in range(0, flat.shape[0], rows):
                chunk = flat[i:i + rows].contiguous()
                if part is not None:  # a quantized table's rows or scales
                    chunk = quant(chunk.to(torch.float32).numpy())[part == "scales"]
                else:
                    chunk = (chunk.view(kept[t.dtype][2]) if t.dtype in kept
                             else chunk.to(torch.float32)).numpy()
                f.write(memoryview(np.ascontiguousarray(chunk).reshape(-1)).cast("B"))
