"""Gemma-4 text decoder (model_type gemma4_text; and the language model inside gemma4).

Per layer (HF Gemma4TextDecoderLayer; RMSNorm is x * w, scores are not scaled)::

    x ─ in_norm ─ attn ─ post_attn_norm ─(+)─ pre_ff_norm ─ MLP(gelu_tanh) ─ post_ff_norm ─(+)─┐
    ┌──────────────────────────────────────────────────────────────────────────────────────────┘
    └─(+)◀ post_ple_norm ◀ ple_proj ◀ (gelu_tanh(ple_gate(x)) * ple_i) ;  x *= layer_scalar

  attention: q/k norms (weighted), v norm (no weight), GQA, scaling 1.0
    sliding layers: head_dim d_s, rope θ 1e4 over all dims, window W (key visible iff q-k < W)
    full layers:    head_dim d_f, "proportional" rope θ 1e6: inv_freq zero-padded, so only the
                    first 25% of each half rotates and cos=1/sin=0 elsewhere (host tables carry it)
  KV sharing: the last ``num_kv_shared_layers`` layers have no k/v: each reads the keys/values of
    the last unshared layer of its type (the donor) — the manifest's kv_shared kind; no state.

Per-layer inputs (PLE), for layer i of L, P = hidden_size_per_layer_input::

    host:  tok = table[ids] * sqrt(P)            [T, L*P]   the table is vocab x L*P (4.7 GB bf16
                                                            on E2B): it stays on the host, gathered
    graph: prj = norm_P((embed @ W_proj^T) * H^-0.5)        each shard projects only its layers
           ple = (prj + tok) * 2^-0.5                        (W_proj rows a*P .. b*P)

Shards may split donor and sharer: the sharer's shard then takes the donor's cache (as it was
before the step) and the donor's new rows of this step (bind ``new:``) as inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from ..bundle.errors import UnsupportedModelError
from ..bundle.manifest import EmbedSpec, ExtraEmbedSpec, HostRecipe, MaskGroup, RopeSpec, StateSpec
from . import blocks, ortops
from .base import Accepts, DecoderFamily
from .form import CPU, PLAIN, ExportForm, fp16
from .graphio import GraphIO

SLIDING, FULL = "sliding_attention", "full_attention"
GROUP = {SLIDING: "sliding", FULL: "full"}


@dataclass
class Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    vocab_size_per_layer_input: int
    hidden_size_per_layer_input: int
    sliding_window: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    enable_moe_block: bool
    hidden_activation: str = "gelu_pytorch_tanh"
    layer_types: list[str] = field(default_factory=list)
    head_dims: list[int] = field(default_factory=list)
    kv_heads: list[int] = field(default_factory=list)
    donors: list[int | None] = field(default_factory=list)  # kv-shared layer -> donor layer

    @classmethod
    def from_config(cls, config: dict) -> Args:
        """From config.json (gemma4_text, or gemma4 with text_config): per-layer values through
        the HF config object (``cfg.head_dim`` is ambiguous on Gemma-4; per_layer_config is not)."""
        from transformers import Gemma4TextConfig

        text = config.get("text_config") or config
        cfg = Gemma4TextConfig.from_dict({k: v for k, v in text.items() if k != "model_type"})
        L = cfg.num_hidden_layers
        modes = list(cfg.kv_sharing_modes) if getattr(cfg, "kv_sharing_modes", None) else [None] * L
        donors: list[int | None] = []
        for i in range(L):
            if modes[i] == "reuse":
                t = cfg.layer_types[i]
                donors.append(max(j for j in range(i) if cfg.layer_types[j] == t
                                  and modes[j] != "reuse"))
            else:
                donors.append(None)
        return cls(
            model_type=config.get("model_type", "gemma4_text"), hidden_size=cfg.hidden_size,
            num_hidden_layers=L, num_attention_heads=cfg.num_attention_heads,
            vocab_size=cfg.vocab_size, vocab_size_per_layer_input=cfg.vocab_size_per_layer_input,
            hidden_size_per_layer_input=cfg.hidden_size_per_layer_input or 0,
            sliding_window=cfg.sliding_window, rms_norm_eps=cfg.rms_norm_eps,
            final_logit_softcapping=cfg.final_logit_softcapping,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", cfg.tie_word_embeddings)),
            enable_moe_block=bool(getattr(cfg, "enable_moe_block", False)),
            hidden_activation=cfg.hidden_activation,
            layer_types=list(cfg.layer_types),
            head_dims=[cfg.per_layer_config[i].head_dim for i in range(L)],
            kv_heads=[cfg.per_layer_config[i].num_key_value_heads for i in range(L)],
            donors=donors,
        )


class Gemma4Family(DecoderFamily):
    """Gemma-4 E2B/E4B text: sliding + full attention, KV sharing, PLE, logit softcap."""

    Args = Args
    ACCEPTED: ClassVar[dict[str, Accepts]] = {
        "use_bidirectional_attention": Accepts(
            (None,), "'vision' has each image's soft tokens attend to one another both ways "
                     "('all': every token), hexforge's graphs attend causally"),
        "enable_moe_block": Accepts(
            (False,), "the graphs hold the dense MLP of the E2B/E4B checkpoints, no MoE block"),
    }

    def check_supported(self, args: Args) -> None:
        from .blocks import ACTIVATIONS

        if args.hidden_activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"Gemma-4 activation {args.hidden_activation!r} is not "
                                        "supported")

    # ---- state, masks, host recipe ------------------------------------------------------------
    def mask_groups(self, args: Args, context: int) -> list[MaskGroup]:
        groups = {GROUP[t] for t in args.layer_types}
        out = []
        if "full" in groups:
            out.append(MaskGroup(name="full", capacity=context))
        if "sliding" in groups:
            W = args.sliding_window
            out.append(MaskGroup(name="sliding", capacity=min(W, context), window=W))
        return out

    def state_spec(self, args: Args, context: int) -> list[StateSpec]:
        out = []
        for i, t in enumerate(args.layer_types):
            for kv in ("k", "v"):
                if args.donors[i] is not None:
                    out.append(StateSpec(name=f"L{i}.{kv}", layer=i, kind="kv_shared",
                                         source=f"L{args.donors[i]}.{kv}"))
                    continue
                cap = context if t == FULL else min(args.sliding_window, context)
                out.append(StateSpec(
                    name=f"L{i}.{kv}", layer=i, kind="kv_full" if t == FULL else "kv_sliding",
                    shape=[args.kv_heads[i], cap, args.head_dims[i]], group=GROUP[t]))
        return out

    def host_recipe(self, hf, args: Args) -> HostRecipe:
        tm = self.text_model(hf)
        rot = tm.rotary_emb
        extra = []
        if args.hidden_size_per_layer_input:
            extra.append(ExtraEmbedSpec(name="ple", table="embed_tokens_per_layer",
                                        scale=math.sqrt(args.hidden_size_per_layer_input)))
        return HostRecipe(
            embed=EmbedSpec(table="embed_tokens", scale=float(tm.embed_tokens.embed_scale)),
            extra_embeds=extra,
            # HF gathers embeddings + per-layer inputs at image/audio placeholders from the pad id
            media_pad_id=hf.config.get_text_config().pad_token_id,
            ropes=[RopeSpec(name=GROUP[t], inv_freq=f"rope.{GROUP[t]}.inv_freq",
                            attention_scaling=float(getattr(rot, f"{t}_attention_scaling")))
                   for t in sorted(set(args.layer_types))],
        )

    def host_tensors(self, hf, args: Args) -> dict[str, np.ndarray]:
        tm = self.text_model(hf)
        # torch tables (bf16 in a real checkpoint): written in their precision (int8 under
        # --cpu-weights int8|int4), a chunk at a time
        out = {"embed_tokens": tm.embed_tokens.weight.detach()}
        if args.hidden_size_per_layer_input:
            out["embed_tokens_per_layer"] = tm.embed_tokens_per_layer.weight.detach()
        for t in set(args.layer_types):
            out[f"rope.{GROUP[t]}.inv_freq"] = getattr(tm.rotary_emb, f"{t}_inv_freq").float().numpy()
        return out

    def layer_weight_bytes(self, hf, bytes_per_weight: float) -> list[int]:
        tm = self.text_model(hf)
        P = getattr(tm.config, "hidden_size_per_layer_input", 0) or 0
        proj = P * tm.config.hidden_size  # each shard holds its layers' slice of the PLE projection
        return [int((sum(p.numel() for p in layer.parameters()) + proj) * bytes_per_weight)
                for layer in tm.layers]

    # ---- export modules -------------------------------------------------------------------------
    def decoder_module(self, hf, args: Args, layers: tuple[int, int], seq_len: int, context: int,
                       form: ExportForm = PLAIN):
        return Gemma4Shard(self, hf, args, layers, seq_len, context, form)

    def head_module(self, hf, args: Args, form: ExportForm = PLAIN):
        tm = self.text_model(hf)
        return blocks.Head(tm.norm, hf.lm_head, softcap=args.final_logit_softcapping,
                           hidden_size=args.hidden_size, form=form)

    def layer_module(self, hf_layer, args: Args, i: int, form: ExportForm = PLAIN) -> nn.Module:
        """Layer i's static step module (``Gemma4Layer``'s interface)."""
        return Gemma4Layer(hf_layer, args, i, form)

    def cpu_step_module(self, hf, args, layers: tuple[int, int], seq_len: int, context: int):
        """The cpu form of the step (``Gemma4Shard`` in the CPU form): full caches updated in
        place by GroupQueryAttention, sliding rings cut to the rows held."""
        return Gemma4Shard(self, hf, args, layers, seq_len, context, CPU)

    # ---- Genie --------------------------------------------------------------------------------
    def genie_spec(self, hf, args: Args):
        """Two cache groups, one per layer type, each of its head dim: Genie's default past_ for
        the full layers, swa_ for the sliding ones (each with its rope: a rope entry with a
        prefix is its group's); with PLE, Genie gathers [embedding | per-layer inputs] rows.

        The full layers' proportional rope (Gemma-4: the first m = 25 % of each half rotates,
        inv_freq_i = theta^(-2i / D)) is Genie's default rope over all D / 2 frequencies with
        HF's theta, of which the graph reads the first m and pads the rest with cos 1 / sin 0.
        (Not m frequencies at theta' = theta^(2m / D): E2B's 1e6^(1/4) = 31.62, and Genie
        truncates rope-theta to an integer, ``genie_verify.genie_inv_freq``.)"""
        import numpy as np

        from .base import GenieCache, GenieRope, GenieSpec, genie_rope_scaling

        cfg = hf.config.get_text_config().to_dict()
        params = cfg.get("rope_parameters") or {}
        tm = self.text_model(hf)
        ropes, caches = [], []
        for t in sorted(set(args.layer_types), key=lambda t: t != FULL):
            inv = getattr(tm.rotary_emb, f"{t}_inv_freq").double().numpy()
            m = int(np.count_nonzero(inv))
            D = args.head_dims[args.layer_types.index(t)]
            p = dict(params.get(t) or {})
            dim = m
            if p.get("rope_type") == "proportional":
                p["rope_type"], dim = "default", D // 2
            prefix = GENIE_GROUP[t]
            ropes.append(GenieRope(prefix="" if t == FULL else prefix, dim=dim,
                                   theta=float(p.get("rope_theta", 10000.0)),
                                   scaling=genie_rope_scaling(p), rope=GROUP[t],
                                   used=m if m < dim else None))
            caches.append(GenieCache(prefix, D))
        P = args.hidden_size_per_layer_input
        lut = (("embed_tokens", float(tm.embed_tokens.embed_scale)),)  # once in the folder
        if P:
            lut += (("embed_tokens_per_layer", math.sqrt(P)),)
        return GenieSpec(caches=tuple(caches), ropes=tuple(ropes), lut=lut)

    def _rope_dims(self, hf, args: Args) -> dict[str, tuple[int, int]]:
        """Layer type -> (Genie's rope-dim, the frequencies the graph reads) of its rope."""
        return {FULL if r.prefix == "" else SLIDING: (r.dim, r.used or r.dim)
                for r in self.genie_spec(hf, args).ropes}

    def genie_step(self, hf, args: Args, host, layers: tuple[int, int], seq_len: int,
                   context: int, residual_scale: float):
        return GemmaGenieStep(self, hf, args, host, layers, seq_len, context, residual_scale,
                              self._rope_dims(hf, args))

    def check_genie(self, args: Args) -> None:
        """Every Gemma-3 / Gemma-4 text config the graphs take: nothing more to refuse."""

    def genie_lade_spec(self, hf, args: Args):
        """One cache group for every layer (``GemmaLadeStep``: kv-dim the narrowest head),
        Genie's default rope only (the graph reads it to keep it an input), and no embedding
        LUT: the first split takes token ids (libGenie 1.21's lade dialog refuses a LUT)."""
        import dataclasses

        from .base import GenieCache

        spec = self.genie_spec(hf, args)
        return dataclasses.replace(spec, caches=(GenieCache(GENIE_GROUP[FULL], lade_kv_dim(args)),),
                                   ropes=tuple(r for r in spec.ropes if not r.prefix), lut=())

    def genie_lade_step(self, inv_freq: dict[str, np.ndarray]):
        def step(hf, args: Args, host, layers: tuple[int, int], seq_len: int, context: int,
                 residual_scale: float):
            return GemmaLadeStep(self, hf, args, host, layers, seq_len, context, residual_scale,
                                 self._rope_dims(hf, args), inv_freq)
        return step

    def check_genie_lade(self, args: Args) -> None:
        """The lade form is proven on Gemma-3's configs (one head width, every layer its own
        cache): per-layer inputs and shared caches are refused until a check covers them."""
        if args.hidden_size_per_layer_input or any(d is not None for d in args.donors) \
                or FULL not in args.layer_types:
            raise UnsupportedModelError(
                f"--genie-kv lade: {args.model_type}'s per-layer inputs or shared caches have no "
                "lade form yet (it takes Gemma-3's configs; --genie-kv concat for this one)")


# ---- export modules (torch) ----------------------------------------------------------------------


class Gemma4Layer(nn.Module):
    """One HF Gemma4TextDecoderLayer as a static step. Unshared layers return (x, k_new, v_new,
    keys, values) — keys/values = [cache | new] for sharers in the same shard; sharers take them."""

    def __init__(self, hf_layer: nn.Module, args: Args, i: int, form: ExportForm = PLAIN):
        super().__init__()
        a = hf_layer.self_attn
        self.shared = args.donors[i] is not None
        self.attn = blocks.StaticAttention(
            a, n_heads=args.num_attention_heads, n_kv=args.kv_heads[i], head_dim=args.head_dims[i],
            scaling=1.0, q_norm=blocks.RMSNorm.from_hf(a.q_norm, form=form),
            k_norm=None if self.shared else blocks.RMSNorm.from_hf(a.k_norm, form=form),
            v_norm=None if self.shared else blocks.RMSNorm.from_hf(a.v_norm, form=form),
            form=form)
        self._norms(hf_layer, form, unit_offset=False)
        h = hf_layer
        self.mlp = blocks.GatedMLP(h.mlp, args.hidden_activation, form)
        self.has_ple = bool(args.hidden_size_per_layer_input)
        if self.has_ple:
            self.ple_gate, self.ple_proj = h.per_layer_input_gate, h.per_layer_projection
            self.ple_norm = blocks.RMSNorm.from_hf(h.post_per_layer_input_norm, form=form,
                                                   out_scale=form.stream)
            self.act = blocks.activation(args.hidden_activation, form)
        self.register_buffer("layer_scalar", h.layer_scalar.detach().clone())

    def _norms(self, h: nn.Module, form: ExportForm, unit_offset: bool) -> None:
        """The four sandwich norms. The residual stream at 1/s (``form.stream``): the pre-norms
        read it so, the post-norms write it so (their gains / s: exact for a power of two)."""
        u = form.stream

        def norm(m: nn.Module, **scale: float) -> blocks.RMSNorm:
            return blocks.RMSNorm.from_hf(m, unit_offset, form, **scale)

        self.residual_scale = form.residual_scale
        self.in_norm = norm(h.input_layernorm, input_scale=u)
        self.post_attn_norm = norm(h.post_attention_layernorm, out_scale=u)
        self.pre_ff_norm = norm(h.pre_feedforward_layernorm, input_scale=u)
        self.post_ff_norm = norm(h.post_feedforward_layernorm, out_scale=u)

    def _tail(self, x, attn_out, ple_i):
        x = x + self.post_attn_norm(attn_out)
        x = x + self.post_ff_norm(self.mlp(self.pre_ff_norm(x)))
        if self.has_ple:  # the gate reads the stream itself, not a norm of it
            g = x * self.residual_scale if self.residual_scale != 1.0 else x
            x = x + self.ple_norm(self.ple_proj(self.act(self.ple_gate(g)) * ple_i))
        return x if self.layer_scalar is None else x * self.layer_scalar

    def forward(self, x, cos, sin, mask, ple_i, past_k, past_v):
        h = self.in_norm(x)
        k, v = self.attn.project_kv(h, cos, sin)
        keys, values = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        out = self.attn.attend(h, cos, sin, mask, keys, values)
        return self._tail(x, out, ple_i), k, v, keys, values

    def forward_shared(self, x, cos, sin, mask, ple_i, keys, values):
        h = self.in_norm(x)
        return self._tail(x, self.attn.attend(h, cos, sin, mask, keys, values), ple_i)

    def forward_in_place(self, x, cos, sin, lengths: ortops.CacheLengths, ple_i, past_k, past_v,
                         rows: tuple | None = None):
        """cpu graphs, full layers: GroupQueryAttention over the cache rows held, the op writing
        the step's rows into the cache it is given (``blocks.InPlaceCache``'s op; the rope
        outside it: a sharer's q rotates, its keys are rows the cache holds). A sharer passes
        its donor's new rows as ``rows``: the op writes what it is given, so it writes the
        donor's rows again, unchanged. -> (x, rows: k, v [1, T, KVH*D] as the cache holds
        them, (present_k, present_v))."""
        a = self.attn
        H, KV = a.n_heads, a.n_kv
        h = self.in_norm(x)
        q = ortops.rotary_embedding(a._head_norm(a.q_proj(h), H, a.q_norm), cos, sin, H)
        if rows is None:
            k = a.k_proj(h)  # [1, T, KV*D]
            v = a.v_proj(h) if a.v_proj is not None else k  # k_eq_v: the raw k projection
            rows = (ortops.rotary_embedding(a._head_norm(k, KV, a.k_norm), cos, sin, KV),
                    a._head_norm(v, KV, a.v_norm))
        out, present_k, present_v = ortops.group_query_attention(
            q, *rows, past_k, past_v, lengths.seqlens_k, lengths.total, H, KV, float(a.scaling))
        return self._tail(x, a.o_proj(out), ple_i), rows, (present_k, present_v)


class Gemma4Shard(nn.Module):
    """Layers [a, b) + their slice of the PLE projection, as one static step graph.

    inputs : hidden [1,T,H], embed [1,T,H] (scaled token embeddings), ple [1,T,L*P],
             cos/sin per rope type used [1,T,d], mask per group used [1,1,T,S+T],
             past.L{i}.k/v per unshared layer, and for donors in earlier shards
             past.L{d}.k/v (state before the step) + cur.L{d}.k/v (the donor's new rows)
    outputs: hidden_out [1,T,H], new.L{i}.k/v per unshared layer

    cpu=True, the cpu target's step: attention reads only the cache rows that hold a position.
    The static step (the HTP's) attends over every row and masks the rows not written yet, so
    its cost follows --context, not the tokens held (docs/notes/measurements.md)::

        full   cache ──past──▶ GroupQueryAttention(q, k_new, v_new, kv_seqlens, kv_total)
               ▲                     │ reads rows [0, total), writes the T new rows in place
               └──────present────────┘ (output bind alias:<cache input>: the same memory)
               a sharer in the shard: past = its donor's present, k/v = the donor's new rows
               (the op writes them again, unchanged); in a later shard: past = the cache input,
               k/v = its rows total-T .. total-1, which the donor's shard wrote
        ring   past [1,KVH,W,D] ─Slice[:held]─▶ ─┐
                           new rows [1,KVH,T,D] ─┴─Concat─▶ keys [1,KVH,held+T,D]
               mask [1,1,T,W+T] ─▶ columns [:held] ++ [W:W+T];  held = min(total - T, W)

    The rings keep the slices: GroupQueryAttention's window cache keeps positions in order
    (rows [0, L), evicting as it goes), not at row p % W as the ring the engine and the HTP
    share. Inputs: mask_full gives way to kv_seqlens [1] + kv_total [] int32 (rows held once
    the step is written); only sliding donors in earlier shards come with cur.L{d} rows.
    Outputs: new rows of the rings only, then present.L{i}.k/v per full layer (own or sharing)
    bound alias:past.L{cache}.k/v. Why: cut to the rows held, the full caches were sliced and
    concatenated each step (tens of MB copied a token at long context), so decode there fell
    back to the static step's speed (docs/notes/measurements.md).
    """

    def __init__(self, fam: Gemma4Family, hf, args: Args, layers: tuple[int, int], seq_len: int,
                 context: int, form: ExportForm = PLAIN, rings: bool = True):
        super().__init__()
        tm = fam.text_model(hf)
        form = form.with_plain_keys()  # its caches keep keys as rows
        cpu = form.cpu
        self.args, self.seq_len, self.context, self.cpu = args, seq_len, context, cpu
        self.rings = rings  # False: sliding layers keep every row too, windowed by their mask
        self.a, self.b = layers
        # the first shard scales HF's hidden (the embedding) to 1/s (``form.stream``)
        self.entry_scale = form.stream if self.a == 0 else 1.0
        ids = list(range(*layers))
        self.layers = nn.ModuleList([fam.layer_module(tm.layers[i], args, i, form) for i in ids])
        P = args.hidden_size_per_layer_input
        if P:
            w = tm.per_layer_model_projection.weight.detach()  # [L*P, H]
            self.ple_w = nn.Parameter(w[self.a * P:self.b * P].clone(), requires_grad=False)
            self.ple_norm = blocks.RMSNorm.from_hf(tm.per_layer_projection_norm, form=form)
        self.types = [t for t in (SLIDING, FULL) if t in {args.layer_types[i] for i in ids}]
        self.own = [i for i in ids if args.donors[i] is None]
        self.external = sorted({args.donors[i] for i in ids
                                if args.donors[i] is not None and args.donors[i] < self.a})
        # the caches GroupQueryAttention updates in place: cpu full layers
        self.in_place = {i for i in self.own + self.external if cpu and args.layer_types[i] == FULL}
        g = [GROUP[t] for t in self.types]
        lengths = [("kv_seqlens", "kv_seqlens:full")] if cpu and FULL in self.types else []
        lengths += [("kv_total", "kv_total:full")] if cpu else []
        self.io = GraphIO(
            inputs=[("hidden", "hidden")]
            + ([("embed", "embed"), ("ple", "host:ple")] if P else [])
            + [(f"{cs}_{n}", f"rope_{cs}:{n}") for n in g for cs in ("cos", "sin")]
            + [(f"mask_{GROUP[t]}", f"mask:{GROUP[t]}") for t in self.types
               if not (cpu and t == FULL)] + lengths
            + [(f"past.L{i}.{kv}", f"state:L{i}.{kv}") for i in self.own for kv in "kv"]
            + [(f"past.L{d}.{kv}", f"state:L{d}.{kv}") for d in self.external for kv in "kv"]
            + [(f"cur.L{d}.{kv}", f"new:L{d}.{kv}") for d in self.external
               if d not in self.in_place for kv in "kv"],
            outputs=[("hidden_out", "hidden")]
            + [(f"new.L{i}.{kv}", f"state:L{i}.{kv}") for i in self.own
               if i not in self.in_place for kv in "kv"]
            + [(f"present.L{i}.{kv}", f"alias:past.L{self._cache_of(i)}.{kv}") for i in ids
               if self._cache_of(i) in self.in_place for kv in "kv"],
        )

    def _cache_of(self, i: int) -> int:
        """The layer whose cache layer i reads: its own, or its donor's."""
        d = self.args.donors[i]
        return i if d is None else d

    def _capacity(self, t: str) -> int:
        """Cache rows of a layer type: the context (full), the ring's window (sliding)."""
        if t == FULL or not self.rings:
            return self.context
        return min(self.args.sliding_window, self.context)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        a, T = self.args, self.seq_len
        out = [torch.randn(1, T, a.hidden_size)]
        if a.hidden_size_per_layer_input:  # the token embeddings + per-layer inputs (PLE)
            out += [torch.randn(1, T, a.hidden_size),
                    torch.randn(1, T, a.num_hidden_layers * a.hidden_size_per_layer_input)]
        dims = {t: next(a.head_dims[i] for i in range(a.num_hidden_layers) if a.layer_types[i] == t)
                for t in self.types}
        for t in self.types:
            out += [torch.ones(1, T, dims[t]), torch.zeros(1, T, dims[t])]
        for t in self.types:
            if not (self.cpu and t == FULL):
                out.append(torch.zeros(1, 1, T, self._capacity(t) + T))
        if self.cpu:  # the full caches held to their last row once the step is written
            total = self.context
            out += [torch.tensor([total - 1], dtype=torch.int32)] if FULL in self.types else []
            out.append(torch.tensor(total, dtype=torch.int32))
        for i in self.own + self.external:  # distinct tensors: the dynamo exporter aliases equal ones
            rows = self._capacity(a.layer_types[i])
            out += [torch.zeros(1, a.kv_heads[i], rows, a.head_dims[i]) for _ in "kv"]
        for d in self.external:
            if d not in self.in_place:
                out += [torch.zeros(1, a.kv_heads[d], T, a.head_dims[d]) for _ in "kv"]
        return tuple(out)

    def forward(self, hidden, *rest):
        a, T = self.args, hidden.shape[1]
        rest = list(rest)
        if self.entry_scale != 1.0:
            hidden = hidden * self.entry_scale
        P = a.hidden_size_per_layer_input
        if P:
            n = self.b - self.a
            embed = rest.pop(0)
            tok = rest.pop(0)[:, :, self.a * P:self.b * P].reshape(1, T, n, P)
            prj = torch.matmul(embed, self.ple_w.t()) * (a.hidden_size ** -0.5)
            ple = (self.ple_norm(prj.reshape(1, T, n, P)) + tok) * (2.0 ** -0.5)  # [1,T,n,P]
        rope = {}
        for t in self.types:  # cos/sin [1, 1, T, d]: broadcast over heads
            c, s = rest.pop(0), rest.pop(0)
            rope[t] = (c[:, None], s[:, None])
        masks = {t: rest.pop(0) for t in self.types if not (self.cpu and t == FULL)}
        lengths = None
        if self.cpu:
            seqlens = rest.pop(0) if FULL in self.types else None
            total = rest.pop(0)
            lengths = ortops.CacheLengths(seqlens, total)
        past = {}
        for i in self.own + self.external:
            past[i] = (rest.pop(0), rest.pop(0))
        if self.cpu and ortops.run_time_sizes():  # dynamo: the static step
            masks, past = self._held_rows(total - self.seq_len, masks, past)
        kv, presents = {}, []  # kv: cache layer -> keys/values (static) or new rows (in place)
        for d in self.external:
            if d in self.in_place:  # the donor's shard wrote its rows: read them back
                rows = (total - T).to(torch.int64) + torch.arange(T)
                kv[d] = tuple(c.index_select(2, rows).transpose(1, 2).reshape(1, T, -1)
                              for c in past[d])
            else:
                kv[d] = (torch.cat((past[d][0], rest.pop(0)), dim=2),
                         torch.cat((past[d][1], rest.pop(0)), dim=2))
        new = []
        for j, layer in enumerate(self.layers):
            i = self.a + j
            t, c = a.layer_types[i], self._cache_of(i)
            cos, sin = rope[t]
            ple_i = ple[:, :, j] if P else None
            if c in self.in_place:
                rows = kv.get(c) if layer.shared else None
                hidden, kv[c], cache = layer.forward_in_place(hidden, cos, sin, lengths, ple_i,
                                                              *past[c], rows)
                past[c] = cache  # a sharer here reads the present: it runs after the write
                presents += cache
            elif layer.shared:
                keys, values = kv[c]
                hidden = layer.forward_shared(hidden, cos, sin, masks[t], ple_i, keys, values)
            else:
                hidden, k, v, keys, values = layer(hidden, cos, sin, masks[t], ple_i, *past[i])
                kv[i] = (keys, values)
                new += [k, v]
        return (hidden, *new, *presents)

    def _held_rows(self, before: torch.Tensor, masks: dict, past: dict) -> tuple[dict, dict]:
        """Each ring cut to the rows that hold a position before the step (``before`` = its
        first position) and each ring mask [1,1,T,W+T] to those columns + the step's own T."""
        cap = {t: self._capacity(t) for t in masks}
        # a ring holds position p at row p % W: min(before, W) leading rows are held
        held = {t: torch.minimum(before, torch.tensor(cap[t], dtype=before.dtype))
                .reshape(1).to(torch.int64) for t in masks}  # [1]: Slice's end
        masks = {t: torch.cat((ortops.leading_rows(m, held[t], 3), m[..., cap[t]:]), dim=3)
                 for t, m in masks.items()}
        types = self.args.layer_types
        past = {i: kv if i in self.in_place else
                tuple(ortops.leading_rows(c, held[types[i]], 2) for c in kv)
                for i, kv in past.items()}
        return masks, past



# ---- Genie (forge/genie/decoder.py; docs/genie.md) ---------------------------------------------------------

# Genie cache group (and rope prefix) per layer type: the full layers in the default group
GENIE_GROUP = {FULL: "past_", SLIDING: "swa_"}


def shared_names(donor: int) -> tuple[str, str]:
    """A donor's keys / values [cache | new] for its sharers in later splits."""
    return f"shared_key_{donor}", f"shared_value_{donor}"


class GemmaGenieStep(nn.Module):
    """Layers [a, b) of Gemma-3 / Gemma-4 text in Genie's I/O contract (``genieio``), around the
    family's own static shard (``Gemma4Shard``, sliding layers unringed)::

        inputs_embeds | residual_a ─┐  Genie's LUT rows: Gemma-3 [1,AR,H] into the first split;
        inputs_embeds ──────────┼─▶ Gemma4Shard ─▶ logits (softcap) | residual_b
          [1,AR,H+L*P]          │    Gemma-4: [embedding | per-layer inputs],
        attention_mask ─────────┤    every split (+ shared_key/value_<d> out of a donor's
          └ window_mask ─▶ sliding layers          split for sharers in later splits)
        position_ids_*     full layers' rope, proportional: padded with cos 1 / sin 0
        swa_position_ids_* sliding layers' rope
        past_key/value_<L>_in/out  full layers: Genie's default cache group
        swa_key/value_<L>_in/out   sliding layers: the group swa_ (its kv-dim, its rope)

    Every layer keeps CL - AR past rows, the sliding ones windowed in the graph from Genie's
    mask: Genie 1.21's sliding-window eviction masks ring slots by position while writing the
    cache index as if the new rows came last, and a graph cannot line its keys up with both
    (measured, docs/genie.md). The per-layer inputs ride in the embedding LUT: Genie's own
    perlayer-embedding ("lut") left per_layer_inputs zero, and given one it refuses token ids.

    The hooks ``_group`` / ``_kv_dim`` / ``_position_io`` / ``_position_examples`` /
    ``_positions`` are what the lade form (``GemmaLadeStep``) changes."""

    def __init__(self, fam: Gemma4Family, hf, args: Args, host, layers: tuple[int, int],
                 seq_len: int, context: int, residual_scale: float,
                 rope_dims: dict[str, tuple[int, int]]):
        super().__init__()
        from .genieio import INPUTS_EMBEDS, LOGITS, MASK, kv_names, residual_name

        a, b = layers
        L = args.num_hidden_layers
        self.args, self.T, self.CL = args, seq_len, context
        self.S = self.past_rows(context, seq_len)
        self.rope_dims = rope_dims
        self.first, self.last = a == 0, b == L
        form = fp16(residual_scale)
        self.shard = Gemma4Shard(fam, hf, args, layers, seq_len, self.S, form, rings=False)
        self.head = fam.head_module(hf, args, form) if self.last else None
        self.ple = bool(args.hidden_size_per_layer_input)
        self.entry = None  # the LUT's rows come in (the lade form gathers from input_ids)
        self.types = self.shard.types
        sh = self.shard
        # donors here whose sharers come in later splits: their [cache | new] rows go out
        self.exported = sorted({args.donors[i] for i in range(b, L)
                                if args.donors[i] is not None and a <= args.donors[i] < b})
        ins = [] if self.first else [(residual_name(a), "hidden")]
        if self.ple:
            ins.append((INPUTS_EMBEDS, "embed"))
        elif self.first:
            ins.append((INPUTS_EMBEDS, "tokens"))
        ins.append((MASK, "mask"))
        ins += self._position_io()
        for i in sh.own:
            ins += [(n, f"state:L{i}") for n in kv_names(i, "in", self._group(i))]
        for d in sh.external:
            ins += [(n, f"shared:L{d}") for n in shared_names(d)]
        outs = [(LOGITS if self.last else residual_name(b), "out")]
        for i in sh.own:
            outs += [(n, f"state:L{i}") for n in kv_names(i, "out", self._group(i))]
        for d in self.exported:
            outs += [(n, f"shared:L{d}") for n in shared_names(d)]
        self.io = GraphIO(inputs=ins, outputs=outs)

    # ---- the concat form (Genie's default): what the lade form changes -------------------------
    @staticmethod
    def past_rows(context: int, seq_len: int) -> int:
        """The past rows each layer's cache input holds: CL - AR (Genie appends the new ones)."""
        return context - seq_len

    def _group(self, i: int) -> str:
        """Layer i's Genie cache group (its prefix)."""
        return GENIE_GROUP[self.args.layer_types[i]]

    def _kv_dim(self, i: int) -> int:
        """Layer i's Genie head width (its group's kv-dim: a head of D is D / kv-dim of them)."""
        return self.args.head_dims[i]

    def _position_io(self) -> list[tuple[str, str]]:
        """The inputs between the mask and the caches: each layer type's rope."""
        from .genieio import rope_names

        return [(n, "rope") for t in self.types
                for n in rope_names("" if t == FULL else GENIE_GROUP[t])]

    def _position_examples(self) -> list[torch.Tensor]:
        out = []
        for t in self.types:
            R, _, _ = self._rope_width(t)
            out += [torch.ones(1, 1, self.T, R), torch.zeros(1, 1, self.T, R)]
        return out

    def _positions(self, mask: torch.Tensor, rest: list) -> tuple[dict, dict, torch.Tensor, list]:
        """Genie's mask [1, 1, AR, CL] and the inputs after it (``_position_io``'s popped from
        the front of ``rest``) -> (each type's cos / sin [1, AR, D], each type's mask over
        [past | new rows], which past rows to keep [1, 1, S, 1], outputs to add)."""
        from .genieio import full_rope, pad_rope, window_mask

        ropes = {}
        for t in self.types:
            c, s_ = rest.pop(0), rest.pop(0)
            _, used, half = self._rope_width(t)  # [1, 1, AR, R] -> the first `used`, padded
            ropes[t] = (full_rope(pad_rope(c[..., :used], half, 1.0)),
                        full_rope(pad_rope(s_[..., :used], half, 0.0)))
        masks = {t: mask if t == FULL else window_mask(mask, self.S, self.args.sliding_window)
                 for t in self.types}
        # the slots row 0 does not attend, zeroed (Genie leaves them dirty: genieio.clean_past)
        keep = (mask[:, :, :1, :self.S] > -1.0).transpose(2, 3)
        return ropes, masks, keep, []

    def _rope_width(self, t: str) -> tuple[int, int, int]:
        """(Genie's rope-dim, the frequencies the layers rotate, the head's half width) of layer
        type t."""
        a = self.args
        i = a.layer_types.index(t)
        return (*self.rope_dims[t], a.head_dims[i] // 2)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        from .genieio import genie_kv_shapes

        a, T, S = self.args, self.T, self.S
        out = [] if self.first else [torch.randn(1, T, a.hidden_size)]
        if self.ple:
            out.append(torch.randn(1, T, a.hidden_size
                                   + a.num_hidden_layers * a.hidden_size_per_layer_input))
        elif self.first:
            out.append(torch.zeros(1, T, dtype=torch.int32) if self.entry is not None
                       else torch.randn(1, T, a.hidden_size))
        out.append(torch.zeros(1, 1, T, self.CL))
        out += self._position_examples()
        for i in self.shard.own:
            ks, vs = genie_kv_shapes(a.kv_heads[i], a.head_dims[i], self._kv_dim(i), S)
            out += [torch.zeros(ks), torch.zeros(vs)]
        for d in self.shard.external:
            out += [torch.zeros(1, a.kv_heads[d], S + T, a.head_dims[d]) for _ in "kv"]
        return tuple(out)

    def forward(self, *inputs):
        from .genieio import kv_from_genie, kv_to_genie

        a, sh, S = self.args, self.shard, self.S
        rest = list(inputs)
        hidden = None if self.first else rest.pop(0)
        if self.ple:  # the scaled embeddings: the first split's hidden, every split's PLE input
            rows = rest.pop(0)
            embed, ple = rows[..., :a.hidden_size], rows[..., a.hidden_size:]
            # (the shard scales its hidden to 1/s itself; the PLE projection reads HF's)
            shard_in = [embed if self.first else hidden, embed, ple]
        elif self.entry is not None:  # split 1 of the lade form: token ids
            shard_in = [self.entry(rest.pop(0))]
        else:
            shard_in = [rest.pop(0) if self.first else hidden]  # the LUT's rows, split 1
        mask = rest.pop(0)
        ropes, masks, keep, added = self._positions(mask, rest)
        for t in self.types:
            shard_in += list(ropes[t])
        shard_in += [masks[t] for t in self.types]
        own = []
        for i in sh.own:
            own += kv_from_genie(rest.pop(0), rest.pop(0), a.head_dims[i] // self._kv_dim(i))
        own = [torch.where(keep, p, torch.zeros_like(p)) for p in own]
        shared = {d: (rest.pop(0), rest.pop(0)) for d in sh.external}
        shard_in += own
        for d in sh.external:
            shard_in += [shared[d][0][:, :, :S], shared[d][1][:, :, :S]]
        for d in sh.external:
            if d not in sh.in_place:
                shard_in += [shared[d][0][:, :, S:], shared[d][1][:, :, S:]]
        out, *new = sh(*shard_in)
        result = [self.head(out) if self.last else out]
        for j, i in enumerate(sh.own):
            result += kv_to_genie(new[2 * j], new[2 * j + 1], a.head_dims[i] // self._kv_dim(i))
        for d in self.exported:  # [cache | new] of the donor, as its sharers read it
            j = sh.own.index(d)
            result += [torch.cat((own[2 * j], new[2 * j]), dim=2),
                       torch.cat((own[2 * j + 1], new[2 * j + 1]), dim=2)]
        return tuple(result + added)


class GemmaLadeStep(GemmaGenieStep):
    """``GemmaGenieStep`` in the scatter form with the lookahead guard (``--genie-kv lade``,
    families/genielade.py)::

        attention_mask   [1, 1, AR, CL]    over the CL slots (Genie's scatter form)
        input_ids        [1, AR] int32 into the first split (the gather in the graph)
        position_ids_*   Genie's default rope: read only (the positions are the guard's)
        cache_index      [1, AR]
        past_key/value_<L>_in/out  every layer in the default group, kv-dim d: a head of D is
                                   D / d Genie heads; the past CL rows whole
        past_key/value_<M>_in/out  the guard's meta layer (M = layers + the split's first)

    Each layer type's rope is its own table [CL, D/2] (``inv_freq``: Genie's frequencies of the
    concat form's ropes, by the host's rope name) at the guard's positions, and a sliding
    layer's window is cut by position, not slot: lade's rejected rows leave slots unattended,
    so a slot's distance is no longer its position's."""

    def __init__(self, fam: Gemma4Family, hf, args: Args, host, layers: tuple[int, int],
                 seq_len: int, context: int, residual_scale: float,
                 rope_dims: dict[str, tuple[int, int]], inv_freq: dict[str, np.ndarray]):
        from .genieio import INPUT_IDS, TokenGather, kv_names
        from .genielade import LadeGuard, meta_layer, rope_tables

        super().__init__(fam, hf, args, host, layers, seq_len, context, residual_scale, rope_dims)
        if self.first:  # libGenie 1.21's lade takes no LUT ("embedding input type is not
            # supported by dialog"): the first split gathers the token rows itself
            self.entry = TokenGather(fam.text_model(hf).embed_tokens.weight, host.embed.scale)
            self.io.inputs[0] = (INPUT_IDS, "tokens")
        self.kv_dim = lade_kv_dim(args)
        self.lade = LadeGuard(seq_len, context, self.kv_dim)
        for t in self.types:
            cos, sin = rope_tables(inv_freq[GROUP[t]][:self._rope_width(t)[2]], context)
            self.register_buffer(f"cos_{GROUP[t]}", cos, persistent=False)  # [CL, D/2]
            self.register_buffer(f"sin_{GROUP[t]}", sin, persistent=False)
        M = meta_layer(args.num_hidden_layers, layers[0])
        self.io.inputs += [(n, f"meta.{kv}") for n, kv in zip(kv_names(M, "in"), "kv", strict=True)]
        self.io.outputs += [(n, f"meta.{kv}") for n, kv in zip(kv_names(M, "out"), "kv", strict=True)]

    @staticmethod
    def past_rows(context: int, seq_len: int) -> int:
        return context  # the scatter form: the whole cache, Genie writes the new rows to slots

    def _group(self, i: int) -> str:
        return GENIE_GROUP[FULL]

    def _kv_dim(self, i: int) -> int:
        return self.kv_dim

    def _position_io(self) -> list[tuple[str, str]]:
        from .genieio import CACHE_INDEX, rope_names

        return [(n, "rope") for n in rope_names()] + [(CACHE_INDEX, "cache_index")]

    def _position_examples(self) -> list[torch.Tensor]:
        R = self.rope_dims[FULL][0]  # Genie's default rope: the full layers'
        return [torch.ones(1, 1, self.T, R), torch.zeros(1, 1, self.T, R),
                torch.arange(self.CL - self.T, self.CL, dtype=torch.int32)[None]]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return (*super().example_inputs(), *self.lade.example_meta())

    def _positions(self, mask: torch.Tensor, rest: list) -> tuple[dict, dict, torch.Tensor, list]:
        from .genieio import MASKED, full_rope, scatter_mask

        cos, sin, index = rest.pop(0), rest.pop(0), rest.pop(0)
        meta_v = rest.pop()
        meta_k = rest.pop()
        g = self.lade(mask, index, meta_k, meta_v, cos, sin)
        ropes = {t: (full_rope(torch.matmul(g.at, getattr(self, f"cos_{GROUP[t]}"))[None, None]),
                     full_rope(torch.matmul(g.at, getattr(self, f"sin_{GROUP[t]}"))[None, None]))
                 for t in self.types}
        joined, keep = scatter_mask(g.mask, index, self.lade.slots)  # [1, 1, AR, CL + AR]
        masks = {FULL: joined}
        if SLIDING in self.types:  # in the window iff the query's position - the key's < W
            keys = torch.cat([g.slot_position, g.position])  # [CL + AR]
            near = (g.position[:, None] - keys[None, :]) < float(self.args.sliding_window)
            masks[SLIDING] = torch.where(near[None, None], joined, torch.full_like(joined, MASKED))
        return ropes, {t: masks[t] for t in self.types}, keep.transpose(2, 3), list(g.meta)


def lade_kv_dim(args: Args) -> int:
    """The lade form's one cache group's kv-dim: the narrowest head (a wider one is split)."""
    return min(args.head_dims)


FAMILY = Gemma4Family()
