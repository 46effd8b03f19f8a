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
from torch import nn

from ..bundle.manifest import EmbedSpec, HostRecipe, RopeSpec
from . import blocks
from .base import DenseArgs
from .form import PLAIN, ExportForm
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
        from ..bundle.errors import UnsupportedModelError

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

    def decoder_module(self, hf, args: Args, layers: tuple[int, int], seq_len: int, context: int,
                       form: ExportForm = PLAIN):
        return Qwen3VLShard(self, hf, args, layers, seq_len, context, form)

    # ---- Genie: qwen3vl-mrope, the LUT's inputs_embeds, deepstack inputs (below) ----
    def genie_spec(self, hf, args: Args):
        return genie_spec(self, hf, args)

    def genie_step(self, hf, args: Args, host, layers: tuple[int, int], seq_len: int,
                   context: int, residual_scale: float):
        return Qwen3VLGenieStep(self, hf, args, host, layers, seq_len, context, residual_scale)

    def check_genie(self, args: Args) -> None:
        """Every Qwen3-VL text config the Genie step takes: nothing to refuse."""


class Qwen3VLShard(blocks.DenseShard):
    """Dense Qwen3 layers [start, end) plus the deepstack adds of the layers below k.

    inputs : hidden [1,T,H], cos/sin [1,T,D], mask_full [1,1,T,C+T],
             deepstack_{i} [1,T,H] for each layer i < k in the shard, past.L{i}.k/v [1,KVH,C,D]
    outputs: hidden_out [1,T,H], new.L{i}.k/v [1,KVH,T,D]
    """

    def __init__(self, fam: Qwen3VLFamily, hf, args: Args, layers: tuple[int, int], seq_len: int,
                 context: int, form: ExportForm = PLAIN):
        super().__init__(fam, hf, args, layers, seq_len, context, form)
        self.deepstack = [i for i in self.layer_ids if i < args.num_deepstack]
        io = self.io
        self.io = GraphIO(
            inputs=io.inputs[:4] + [(f"deepstack_{i}", f"deepstack:{i}") for i in self.deepstack]
            + io.inputs[4:],
            outputs=io.outputs,
            keys_transposed=io.keys_transposed,  # the dense shard's cache layout, kept
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


# ---- Genie (forge/genie/decoder.py; docs/genie-pipelines.md) ----------------------------------------------


def genie_spec(fam: Qwen3VLFamily, hf, args: Args):
    """One cache group, the config's rope as Genie's qwen3vl-mrope (interleaved sections over
    (t, h, w): Genie places each image token's position from the image node's vision-param and
    the sections; on text t = h = w, the 1-D rope), and Genie's embedding LUT of the token
    embedding with its media flag: the decoder takes inputs_embeds [AR, H + 1], the rows a
    pipeline's image node appends ending in 1.0, the LUT's in 0.0 (``Qwen3VLGenieStep``)."""
    from dataclasses import replace

    from .base import DecoderFamily, GenieSpec

    base = DecoderFamily.genie_spec(fam, hf, args)
    rot = fam.text_model(hf).rotary_emb
    scaling = {"rope-type": "qwen3vl-mrope", "mrope-section": [int(x) for x in rot.mrope_section],
               "spatial-merge-size": int(hf.config.vision_config.spatial_merge_size)}
    return GenieSpec(caches=base.caches, ropes=(replace(base.ropes[0], scaling=scaling),),
                     lut=(("embed_tokens", 1.0),), media_flag=True)


class Qwen3VLGenieStep(nn.Module):
    """Layers [a, b) of Qwen3-VL in Genie's I/O contract (``genieio``), around ``Qwen3VLShard``,
    one graph for libGenie and for GenieX's QAIRT plugin (forge/genie/geniex.py)::

        inputs_embeds | residual_a   [1, AR, H (+1)]  the LUT's / image node's rows, the media
                                                      flag last (split 1; a later split's
                                                      residual carries it when it has layers < k)
        attention_mask               [1, 1, AR, CL]
        position_ids_cos / _sin      [1, 1, AR, D/2]  Genie's qwen3vl-mrope tables
        deepstack_visual_embeds_<i>  [1, AR, H + 1]   splits with layers i < k: feature i (its
                                                      last column unread)
        visual_pos_masks             [1, AR] bool     the same splits: GenieX's image rows
        past_key/value_<L>_in / _out                  Genie's default cache group
        ->  logits | residual_b [1, AR, H (+1)]

    The deepstack rows come two ways. libGenie (measured with dump-tensors,
    docs/genie-pipelines.md) writes row r with the feature of the chunk's row r when that row is
    an image token and leaves the other rows as they were (zeros when the buffer was fresh, up
    to 2e34 after a 1-token image), and never writes ``visual_pos_masks`` (zero-filled once at
    load). GenieX's DeepstackInputProvider (core/src/vlm/vlm_input_provider.cpp) writes the mask
    (1 at the chunk's image rows) and the features compactly: row j the j-th masked row's. So
    with any mask entry set the graph scatters row j onto the j-th masked row (a one-hot matmul:
    no dynamic gather), else it takes the rows positionally; either way feature i is added
    after layer i only where the row's media flag is set. The rows are H + 1 wide because the
    plugin takes one row width for inputs_embeds, the image rows and the deepstack rows: the
    hidden size it infers from shard 1's first non-special input in key order, which is
    deepstack_visual_embeds_0 (rank 3 so that it counts). The input has AR rows, the chunk's
    (with one image's soft tokens as rows, libGenie aborted on a chunk whose image rows ran
    past them: "Requested tensor segment of 26 entries ... 9")."""

    def __init__(self, fam: Qwen3VLFamily, hf, args: Args, host, layers: tuple[int, int],
                 seq_len: int, context: int, residual_scale: float):
        super().__init__()
        from .genieio import DenseGenieStep, GenieContract

        io_form = GenieContract(token_ids=False, embeds_name=INPUTS_EMBEDS)
        self.inner = DenseGenieStep.make(fam, hf, args, host, layers, seq_len, context, io_form,
                                         residual_scale)
        self.ds = list(self.inner.shard.deepstack)
        k = args.num_deepstack
        # the flag rides on the stream while a split at or after this one adds a feature
        self.flag_in = layers[0] == 0 or layers[0] < k
        self.flag_out = not self.inner.last and layers[1] < k
        self.T, self.H = seq_len, args.hidden_size
        io = self.inner.io
        side = [(f"{DEEPSTACK}{i}", f"deepstack:{i}") for i in self.ds]
        if self.ds:
            side.append((VISUAL_POS_MASKS, "visual_pos_masks"))
        self.io = GraphIO(inputs=io.inputs[:4] + side + io.inputs[4:], outputs=io.outputs)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        base = self.inner.example_inputs()
        tokens = base[0]
        if self.flag_in:  # half the example rows media: both sides of the gate traced
            flag = (torch.arange(self.T) % 2).to(tokens.dtype).view(1, self.T, 1)
            tokens = torch.cat([tokens, flag], dim=-1)
        feats = [torch.randn(1, self.T, self.H + 1) * 0.1 for _ in self.ds]
        mask = [(torch.arange(self.T) % 2 == 1).view(1, self.T)] if self.ds else []
        return (tokens, *base[1:4], *feats, *mask, *base[4:])

    def forward(self, tokens, mask, cos, sin, *rest):
        from .genieio import clean_past, full_rope, kv_from_genie, kv_to_genie

        inner = self.inner
        n = len(self.ds)
        flag = None
        if self.flag_in:  # [1, AR, H + 1] -> rows [1, AR, H], media [1, AR, 1]
            tokens, flag = tokens[..., :self.H], tokens[..., self.H:]
        media = None if flag is None else flag > 0.5
        feats = [f[..., :self.H] for f in rest[:n]]
        if n:
            feats = scatter_compact(feats, rest[n])
        # Where, not a product: the unwritten rows may hold inf or NaN
        adds = [torch.where(media, f, torch.zeros((), dtype=f.dtype)) for f in feats]
        past = list(rest[n + (1 if n else 0):])
        ours = []
        for j in range(0, len(past), 2):
            ours += kv_from_genie(past[j], past[j + 1], 1)
        ours = clean_past(mask, ours, inner.S)
        out, *new = inner.shard(tokens, full_rope(cos), full_rope(sin), mask, *adds, *ours)
        genie = []
        for j in range(0, len(new), 2):
            genie += kv_to_genie(new[j], new[j + 1], 1)
        if inner.head is not None:
            out = inner.head(out)
        elif self.flag_out:
            out = torch.cat([out, flag.to(out.dtype)], dim=-1)
        return (out, *genie)


def scatter_compact(feats: list[torch.Tensor], mask: torch.Tensor) -> list[torch.Tensor]:
    """The deepstack rows [1, AR, H] each runtime means: with any entry of ``mask`` [1, AR] set
    (GenieX), row j onto the j-th set row (zeros on the others); else (libGenie: the mask never
    written) the rows as they are. A one-hot [AR, AR] matmul, exact in fp16 for AR <= 2048;
    GenieX zero-fills every row it does not write, so the product meets no inf, and libGenie's
    unwritten rows reach only the positional branch of the select."""
    m = mask.reshape(-1).to(torch.float32)  # [AR]
    T = m.shape[0]
    before = torch.tril(torch.ones(T, T), diagonal=-1) @ m  # set rows above each row
    onehot = (before.unsqueeze(1) == torch.arange(T, dtype=torch.float32).unsqueeze(0)
              ).to(torch.float32) * m.unsqueeze(1)  # [AR row, AR source row]
    compact = (m.sum() > 0.5).view(1, 1, 1)
    return [torch.where(compact, (onehot @ f[0].to(torch.float32)).unsqueeze(0).to(f.dtype), f)
            for f in feats]


INPUTS_EMBEDS = "inputs_embeds"
VISUAL_POS_MASKS = "visual_pos_masks"  # AI Hub's Qwen3-VL name, the one GenieX writes
DEEPSTACK = "deepstack_visual_embeds_"  # AI Hub's Qwen3-VL name, the image node's side outputs
