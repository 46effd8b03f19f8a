"""The torch pieces every family's Genie step shares: Genie's tensor names, its KV layout, its rope
tables, the masks it writes (build time only: imports torch; docs/genie.md has the evidence).

Genie (``libGenie.so``) drives a model's context binaries itself and finds everything by tensor
name and shape. A family's Genie step (``DecoderFamily.genie_step``) is its own shard module
wrapped at this boundary::

    input_ids  int32 [1, AR]               split 1: the embedding gather is in the graph
    residual_<a>     [1, AR, H]            split i > 1: the stream from the split before
    attention_mask   [1, 1, AR, CL]        additive 0 / -1000 (Genie's SMART_MASK); past slot r
                                           holds position r, the AR new rows come last
    <p>position_ids_cos / _sin [1, 1, AR, R]   each rope's frequencies once (prefix p per rope)
    past_key_<L>_in  [KVH*, 1, d, CL-AR]   keys transposed; a head of D = f*d is f heads of the
    past_value_<L>_in [KVH*, 1, CL-AR, d]  group's kv-dim d (``split_heads``)
    ->
    logits [1, AR, V] (last split) | residual_<b> [1, AR, H]
    past_key_<L>_out [KVH*, 1, d, AR], past_value_<L>_out [KVH*, 1, AR, d]

or, in the scatter form (``GenieContract(cache_index=True)``, build ``--genie-kv scatter``: the
cache group's ``cache-index-tensor-name``; Genie's log then says "scatter=true")::

    cache_index      int32 [1, AR]         the slot of each new row (Genie: n + i; a pad row CL - 1)
    attention_mask   [1, 1, AR, CL]        over the CL slots, a new row's own slot included
    past_key_<L>_in  [KVH*, 1, d, CL]      the whole cache (an input of CL rows is what makes
    past_value_<L>_in [KVH*, 1, CL, d]     Genie pick scatter: "Expected CL=.. or CL - AR-n=..")
    ->  the new rows [.., AR] as above: Genie copies row i into slot cache_index[i]

In the scatter form Genie's lookahead dialog (``lade``) keeps a step's rejected rows out of the
next step's mask (its slots stay written, unattended); in the concat form it commits every row
of a step (docs/notes/genie-record.md, "lade").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

INPUT_IDS, MASK, LOGITS = "input_ids", "attention_mask", "logits"
CACHE_INDEX = "cache_index"  # the scatter form's slots of the new rows (cache-index-tensor-name)
INPUTS_EMBEDS = "inputs_embeds"  # Genie's token-embedding LUT rows (its "embedding" config)
MASKED = -1000.0  # what Genie writes into a float mask for a slot not attended


def residual_name(layer: int) -> str:
    """The tensor carrying the residual stream into ``layer`` from the split before it: Genie
    gives an output and a later split's input of the same name one buffer."""
    return f"residual_{layer}"


def rope_names(prefix: str = "") -> tuple[str, str]:
    """Genie's rope inputs for a positional-encoding entry with ``prefix`` (it prepends the
    prefix to the names as they are: "swa_" -> swa_position_ids_cos)."""
    return f"{prefix}position_ids_cos", f"{prefix}position_ids_sin"


def kv_names(layer: int, direction: str, prefix: str = "past_") -> tuple[str, str]:
    """<prefix>key_<L>_<in|out>, <prefix>value_<L>_<in|out>: a layer's cache in Genie's cache
    group ``prefix`` (past_: the default group)."""
    return f"{prefix}key_{layer}_{direction}", f"{prefix}value_{layer}_{direction}"


@dataclass(frozen=True)
class GenieContract:
    """Which parts of the Genie contract a dense export takes (bench/genie_probe.py walks them one
    by one; ``GenieContract()`` is the whole contract)."""

    names: bool = True  # Genie's tensor names (else hexforge's: hidden, mask_full, past.L0.k ..)
    genie_kv_layout: bool = True  # keys [KVH, 1, D, S], values [KVH, 1, S, D] (else [1, KVH, S, D])
    past_is_cl_minus_ar: bool = True  # past rows CL - AR, mask CL wide (else past CL, mask CL + AR)
    half_rope: bool = True  # cos/sin [1, 1, AR, D/2] (else hexforge's [1, AR, D])
    with_head: bool = True  # logits out of the same graph (else hidden_out, head separate)
    token_ids: bool = True  # input_ids + the gather in the graph (else the embedded hidden)
    embeds_name: str = "input_embeds"  # the embedded input's name without token_ids (AI Hub's)
    sanitize_past: bool = True  # masked past slots zeroed in the graph (Genie leaves them dirty)
    cache_index: bool = False  # the scatter form: cache_index in, past of CL rows, mask CL wide


class TokenGather(nn.Module):
    """int32 ids -> table rows x scale (the first split's entry). Gathered as they come (a Cast
    to int64 would be a node the HTP refuses), clamped into the table: Genie puts ids outside
    it into a graph — its lookahead decoding's first guesses (1000.. on a 384-row table), -1 as
    the pad of a config without one — and an out-of-range gather fails the whole execute on
    the HTP (error 1100)."""

    def __init__(self, table: torch.Tensor, scale: float):
        super().__init__()
        self.table = nn.Parameter(table.detach().float().clone(), requires_grad=False)
        self.scale = float(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        top = torch.full((), self.table.shape[0] - 1, dtype=torch.int32)
        ids = torch.maximum(torch.minimum(ids, top), torch.zeros((), dtype=torch.int32))
        x = torch.nn.functional.embedding(ids, self.table)
        return x * self.scale if self.scale != 1.0 else x


def full_rope(half: torch.Tensor) -> torch.Tensor:
    """Genie's [1, 1, AR, R] (each frequency once) -> HF's [1, AR, 2R] = cat(f, f)."""
    f = half[:, 0]
    return torch.cat([f, f], dim=-1)


def pad_rope(half: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """[1, 1, AR, R] -> [1, 1, AR, width]: R frequencies then ``value`` (1 for cos, 0 for sin)
    for the frequencies Genie was not asked to compute (Gemma-4's proportional rope leaves 3/4 of
    each head unrotated: HF zero-pads its inv_freq)."""
    R = half.shape[-1]
    if R == width:
        return half
    return torch.cat([half, torch.full((*half.shape[:-1], width - R), value)], dim=-1)


def split_heads(d: int, head_dim: int) -> int:
    """How many Genie heads of the group's kv-dim ``d`` carry one head of ``head_dim``."""
    if head_dim % d:
        raise ValueError(f"head dim {head_dim} is not a multiple of the cache's kv-dim {d}")
    return head_dim // d


def kv_from_genie(k: torch.Tensor, v: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Genie's k [H*f, 1, d, S], v [H*f, 1, S, d] -> ours [1, H, S, f*d] each."""
    Hf, _, d, S = k.shape
    H = Hf // f
    k = k.reshape(H, f * d, S).transpose(1, 2)[None]  # [1, H, S, D]
    v = v.reshape(H, f, S, d).permute(0, 2, 1, 3).reshape(H, S, f * d)[None]
    return k, v


def kv_to_genie(k: torch.Tensor, v: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours k, v [1, H, T, D] -> Genie's k [H*f, 1, D/f, T], v [H*f, 1, T, D/f]."""
    _, H, T, D = k.shape
    d = D // f
    k = k[0].transpose(1, 2).reshape(H * f, 1, d, T)
    v = v[0].reshape(H, T, f, d).permute(0, 2, 1, 3).reshape(H * f, 1, T, d)
    return k, v


def genie_kv_shapes(n_kv: int, head_dim: int, d: int, rows: int) -> tuple[tuple, tuple]:
    f = split_heads(d, head_dim)
    return (n_kv * f, 1, d, rows), (n_kv * f, 1, rows, d)


def clean_past(mask: torch.Tensor, past: list[torch.Tensor], S: int) -> list[torch.Tensor]:
    """Each past [1, H, S, D] with the slots row 0 of ``mask`` does not attend zeroed.

    Why: Genie does not clear float caches; a dialog made after another in one process reads
    the freed buffers' bytes (5e27 in a masked slot: q.k overflows fp16 and the -1000 of
    Genie's mask no longer masks it), so nothing read from a masked slot may reach the output."""
    keep = (mask[:, :, :1, :S] > -1.0).transpose(2, 3)  # [1, 1, S, 1]
    return [torch.where(keep, p, torch.zeros_like(p)) for p in past]


def scatter_mask(mask: torch.Tensor, index: torch.Tensor, slots: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scatter form's mask [1, 1, AR, CL] and cache_index [1, AR] (row i's slot) -> (the
    concat form's mask [1, 1, AR, CL + AR] over [the CL past slots | the AR new rows], which
    slots of the past to keep [1, 1, 1, CL]).

    Row i is written at slot index[i] *after* this step (Genie copies it there), so the step
    reads it from the new rows: a slot some row is written to is masked as a past slot, and a
    new row t is attended where the mask attends its slot. A row whose slot is not among the CL
    (none matches) is attended by no row. The slots no row attends are to be zeroed (Genie does
    not clear its caches: ``clean_past``). ``slots``: int32 [1, CL], 0 .. CL - 1."""
    onehot = (index.transpose(0, 1) == slots).to(torch.float32)  # [AR, CL]: row t -> slot
    written = onehot.sum(0, keepdim=True).unsqueeze(0).unsqueeze(0) > 0.5  # [1, 1, 1, CL]
    past = torch.where(written, torch.full_like(mask, MASKED), mask)
    placed = onehot.sum(1).unsqueeze(0).unsqueeze(0).unsqueeze(0)  # [1, 1, 1, AR]
    new = torch.matmul(mask, onehot.transpose(0, 1)) + (1.0 - placed) * MASKED
    keep = (past > -1.0).to(torch.float32).sum(2, keepdim=True) > 0.5  # [1, 1, 1, CL]
    return torch.cat([past, new], dim=-1), keep


def window_mask(mask: torch.Tensor, S: int, window: int) -> torch.Tensor:
    """A sliding-window layer's mask from Genie's full one [1, 1, AR, S + AR].

    Genie's SMART_MASK cache holds position r in past slot r, filled from 0, so the tokens held
    are n = the slots row 0 attends, query i sits at position n + i, a past slot r is in its
    window iff n + i - r < W and a new row t iff i - t < W::

        slots:      0 .. n-W+i | n-W+i+1 .. n-1 | (unfilled) | new 0 .. i-W | i-W+1 .. i
        query i:     masked    |   as Genie's   |  masked    |   masked     | as Genie's
    """
    AR = mask.shape[2]
    held = (mask[:, :, :1, :S] > -1.0).float().sum(-1, keepdim=True)  # [1, 1, 1, 1]: n
    query = torch.arange(AR, dtype=torch.float32)[None, None, :, None]  # [1, 1, AR, 1]
    slot = torch.arange(S, dtype=torch.float32)[None, None, None, :]  # [1, 1, 1, S]
    past = torch.where((held + query - slot) < float(window), mask[..., :S],
                       torch.full_like(mask[..., :S], MASKED))
    if AR <= window:  # every new row is in every query's window
        return torch.cat([past, mask[..., S:]], dim=-1)
    row = torch.arange(AR, dtype=torch.float32)[None, None, None, :]  # [1, 1, 1, AR]
    new = torch.where((query - row) < float(window), mask[..., S:],
                      torch.full_like(mask[..., S:], MASKED))
    return torch.cat([past, new], dim=-1)


class DenseGenieStep(nn.Module):
    """Layers [a, b) of a dense decoder (``blocks.DenseShard``) in Genie's contract: one split of
    a model cut over several contexts (AI Hub's ``<name>_<i>_of_<n>`` graphs)::

        split 1 of n:  input_ids ─▶ gather ─▶ layers [0, b)    ─▶ residual_<b>
        split i of n:  residual_<a>         ─▶ layers [a, b)    ─▶ residual_<b>
        split n of n:  residual_<a>         ─▶ layers [a, L) ─▶ head ─▶ logits

    ``contract`` switches parts of the contract off, for bench/genie_probe.py's ablations."""

    def __init__(self, shard: nn.Module, head: nn.Module | None, entry: TokenGather | None,
                 args, seq_len: int, past_len: int, contract: GenieContract):
        super().__init__()
        self.shard, self.head, self.entry, self.contract = shard, head, entry, contract
        self.n_kv, self.head_dim, self.hidden = args.num_key_value_heads, args.head_dim, args.hidden_size
        self.T, self.S = seq_len, past_len
        layers = shard.layer_ids
        self.first, self.last = layers[0] == 0, layers[-1] == args.num_hidden_layers - 1
        f = contract
        n = (lambda genie, ours: genie if f.names else ours)  # noqa: E731
        if not self.first:
            entry_name = residual_name(layers[0])
        else:
            entry_name = n(INPUT_IDS if f.token_ids else f.embeds_name, "hidden")
        cos, sin = rope_names()
        ins = [(entry_name, "tokens"), (n(MASK, "mask_full"), "mask"),
               (n(cos, "cos"), "rope_cos"), (n(sin, "sin"), "rope_sin")]
        if f.cache_index:  # the scatter form: the new rows' slots among the CL
            ins.append((CACHE_INDEX, "cache_index"))
            self.register_buffer("slots", torch.arange(past_len, dtype=torch.int32)[None],
                                 persistent=False)
        if not self.last:
            out = (residual_name(layers[-1] + 1), "hidden")
        elif f.with_head:
            out = (n(LOGITS, "logits"), "logits")
        else:
            out = (n("hidden_states", "hidden_out"), "hidden")
        outs = [out]
        for i in layers:
            for kv, j in (("k", 0), ("v", 1)):
                ins.append((n(kv_names(i, "in")[j], f"past.L{i}.{kv}"), f"state:L{i}.{kv}"))
                outs.append((n(kv_names(i, "out")[j], f"new.L{i}.{kv}"), f"state:L{i}.{kv}"))
        from .graphio import GraphIO

        self.io = GraphIO(inputs=ins, outputs=outs)

    @classmethod
    def make(cls, fam, hf, args, host, layers: tuple[int, int], seq_len: int, context: int,
             contract: GenieContract, residual_scale: float) -> DenseGenieStep:
        """Layers ``layers`` for AR ``seq_len`` and context ``context`` in the fp16 export form of
        HTP graphs (``form.fp16(residual_scale)``: fused norms, the stream at 1/``residual_scale``),
        the parts of Genie's I/O ``contract`` asked for (its cache layout, ``genie_kv_layout``, in
        place of transposed keys)."""
        from .form import fp16

        export = fp16(residual_scale)
        past = context - seq_len if contract.past_is_cl_minus_ar and not contract.cache_index \
            else context
        last = layers[1] == args.num_hidden_layers
        shard = fam.decoder_module(hf, args, layers, seq_len, past, export)
        head = fam.head_module(hf, args, export) if contract.with_head and last else None
        entry = (TokenGather(fam.text_model(hf).embed_tokens.weight, host.embed.scale)
                 if contract.token_ids and layers[0] == 0 else None)
        return cls(shard, head, entry, args, seq_len, past, contract)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        f, T, S, KV, D = self.contract, self.T, self.S, self.n_kv, self.head_dim
        tokens = (torch.zeros(1, T, dtype=torch.int32) if self.first and f.token_ids
                  else torch.randn(1, T, self.hidden))
        mask = torch.zeros(1, 1, T, S if f.cache_index else S + T)
        R = D // 2 if f.half_rope else D
        rope_shape = (1, 1, T, R) if f.half_rope else (1, T, R)
        past = []
        for _ in self.shard.layer_ids:
            if f.genie_kv_layout:
                past += [torch.zeros(KV, 1, D, S), torch.zeros(KV, 1, S, D)]
            else:
                past += [torch.zeros(1, KV, S, D), torch.zeros(1, KV, S, D)]
        index = (torch.arange(S - T, S, dtype=torch.int32)[None],) if f.cache_index else ()
        return (tokens, mask, torch.ones(rope_shape), torch.zeros(rope_shape), *index, *past)

    def forward(self, tokens, mask, cos, sin, *past):
        f = self.contract
        keep = None
        if f.cache_index:  # Genie's slots -> the concat form's mask over [past | new rows]
            mask, keep = scatter_mask(mask, past[0], self.slots)
            past = past[1:]
        hidden = self.entry(tokens) if self.entry is not None else tokens
        if f.half_rope:
            cos, sin = full_rope(cos), full_rope(sin)
        past = list(past)
        if f.genie_kv_layout:
            ours = []
            for j in range(0, len(past), 2):
                ours += kv_from_genie(past[j], past[j + 1], 1)
            past = ours
        if keep is not None and f.sanitize_past:  # the slots no row attends, zeroed
            keep = keep.transpose(2, 3)  # [1, 1, CL, 1]
            past = [torch.where(keep, p, torch.zeros_like(p)) for p in past]
        elif f.sanitize_past:
            past = clean_past(mask, past, self.S)
        out, *new = self.shard(hidden, cos, sin, mask, *past)
        if f.genie_kv_layout:
            genie = []
            for j in range(0, len(new), 2):
                genie += kv_to_genie(new[j], new[j + 1], 1)
            new = genie
        if self.head is not None:
            out = self.head(out)
        return (out, *new)
