"""The lookahead guard (build ``--genie-kv lade``): what makes a scatter-form Genie graph one under
which Genie's lookahead dialog (``lade``) gives ``basic``'s tokens, and the dense step with it
(Gemma's: ``gemma4.GemmaLadeStep``; build time only: imports torch; the evidence is
docs/notes/genie-record.md, "lade").

libGenie 1.21's ``lade``, on the scatter form (``genieio.GenieContract.cache_index``), keeps a
step's rejected rows out of the next step's mask but commits its warm-up steps whole (N - 2 of
them for n-gram N: the steps that fill the window's levels, each feeding the same token): their
window rows and placeholder guesses stay in every later step's context, and their rope
positions are counted. Genie's mask, cache index and positions alone do not tell that step from
an accepted chain, so the graph keeps what does in one more cache layer of the group, which
Genie copies to its slots like any layer's (the meta layer, ``meta_layer``)::

    past_key_<M>_in [1, 1, D, CL], past_value_<M>_in [1, 1, CL, D]
      M = layers + the split's first layer (one a split)
    value row of slot s: [start, count, chain, written, warm_lo, warm_hi, position, 0 ...]
      start    1 + the slot its step's row 0 was written to (identifies the step)
      count    the step's real rows (a pad row attends nothing)
      chain    1 if row r of the step attended exactly rows 0..r of it (a prompt chunk, an
               AR-1 step, an accepted n-gram: every step but lade's warm-up and guesses)
      written  1 (Genie does not clear its buffers: a slot this dialog never wrote is dirty)
      warm_lo  the start of the first step found to be a warm-up (0: none yet), carried on
      warm_hi  the start of the last one found, carried on (the warm-up steps are consecutive:
               every step whose start lies in [warm_lo, warm_hi] is one)
      position the row's position (its rope's; a sliding-window layer's mask reads it)

Genie writes a step's rows to consecutive slots, and a warm-up step is found by the step right
after it: the last step before the current one (the largest start among the kept slots)
attended whole while not a chain can only be a warm-up -- a lade step's accepted rows are a
chain drawn from a step with branches, never all of it. Per step, all O(CL) (A: the past slots
row 0 attends, less those written this step)::

    last     = max start over A;  seen = |A & start == last|
    found    = seen == count(last) & !chain(last) & count(last) > 1
    warm_hi  = last if found, else max warm_hi over A
    warm_lo  = last if found and no warm-up was found before, else max warm_lo over A
    mask     = Genie's, the slots of the warm-up steps (start in [warm_lo, warm_hi]) masked
    position = (A less the warm-ups).sum() + (rows of this step the row attends) - 1   [AR]
    cos/sin  = one-hot(position) x the rope table [CL, R] (Genie's inv_freq, computed in fp64;
               Genie's position_ids_cos / _sin are read only to stay inputs)
    window   a sliding layer's key at slot s is in row t's window iff
             position(t) - position(s) < W (s: a past slot's stored position, or a new row's)

Positions and slots are small integers in the graph's fp16: exact up to 2048, so the form is
refused for longer contexts (``MAX_CONTEXT``). Every split computes the same from its own copy
of the metadata, so no tensor but Genie's passes between splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .genieio import MASKED, DenseGenieStep, GenieContract, kv_names

MAX_CONTEXT = 2048  # fp16 holds every integer up to 2048: positions and slots in the graph
META = 7  # the meta layer's fields: start, count, chain, written, warm_lo, warm_hi, position


def meta_layer(num_layers: int, first_layer: int) -> int:
    """The meta layer's index in a split whose first layer is ``first_layer``: past every real
    layer, one a split."""
    return num_layers + first_layer


def rope_tables(inv_freq: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [CL, R] of position x ``inv_freq`` [R], computed in fp64 (a zero frequency,
    HF's padding of a partial rope, rotates nothing: cos 1, sin 0)."""
    angles = np.arange(context, dtype=np.float64)[:, None] * np.asarray(inv_freq)[None]
    return (torch.tensor(np.cos(angles), dtype=torch.float32),
            torch.tensor(np.sin(angles), dtype=torch.float32))


@dataclass
class Guarded:
    """What the guard makes of one step (T rows, CL slots)."""

    mask: torch.Tensor  # [1, 1, T, CL] Genie's, the warm-up step's slots masked
    at: torch.Tensor  # [T, CL] one-hot of each row's position: x a rope table = its cos / sin
    position: torch.Tensor  # [T] each row's position
    slot_position: torch.Tensor  # [CL] the position each past slot was written at
    meta: tuple[torch.Tensor, torch.Tensor]  # the meta layer's new rows (key, value)


class LadeGuard(nn.Module):
    """The guard's arithmetic on one split's meta layer (the module docstring), for a graph of
    AR ``seq_len`` over ``context`` slots whose cache group has kv-dim ``kv_dim``."""

    def __init__(self, seq_len: int, context: int, kv_dim: int):
        super().__init__()
        if context > MAX_CONTEXT:
            raise ValueError(f"the lade guard computes positions in fp16: context <= {MAX_CONTEXT}")
        if kv_dim < META:
            raise ValueError(f"kv-dim {kv_dim}: the meta layer needs {META} fields")
        self.T, self.S, self.D = seq_len, context, kv_dim
        self.register_buffer("slots", torch.arange(context, dtype=torch.int32)[None],
                             persistent=False)  # [1, CL]
        self.register_buffer("positions", torch.arange(context, dtype=torch.float32)[None],
                             persistent=False)  # [1, CL]
        self.register_buffer("tri", torch.tril(torch.ones(seq_len, seq_len)), persistent=False)

    def example_meta(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, 1, self.D, self.S), torch.zeros(1, 1, self.S, self.D)

    def forward(self, mask, index, meta_k, meta_v, *unread) -> Guarded:
        """``unread``: Genie's inputs the graph has no use for (its rope), read so that they
        stay inputs (an input no node reads is dropped at export)."""
        T, D = self.T, self.D
        meta = meta_v[0, 0]  # [CL, D]
        start, count, chain, written, warm_lo, warm_hi, position = (meta[:, j]
                                                                     for j in range(META))
        onehot = (index.transpose(0, 1) == self.slots).to(torch.float32)  # [T, CL]
        taken = onehot.sum(0)  # [CL]: the slots this step writes
        # the past slots row 0 attends that this dialog wrote (a dirty slot's bytes may be NaN:
        # they meet comparisons only, and where() picks their fields away)
        A = ((mask[0, 0, 0] > -1.0) & (taken < 0.5) & (written > 0.5))  # [CL] bool
        zero = torch.zeros_like(start)
        start_a = torch.where(A, start, zero)
        last = start_a.max()  # the last step before this one (0: none)
        of_last = A & ((start - last).abs() < 0.5)
        seen = of_last.to(torch.float32).sum()
        count_last = torch.where(of_last, count, zero).max()
        chain_last = torch.where(of_last, chain, zero).max()
        found = (last > 0.5) & ((seen - count_last).abs() < 0.5) & (chain_last < 0.5) \
            & (count_last > 1.5)
        # the warm-up steps' starts, [lo, hi] (0: none yet); N - 2 of them, consecutive
        carried_lo = torch.where(A, warm_lo, zero).max()
        hi = torch.where(found, last, torch.where(A, warm_hi, zero).max())
        lo = torch.where(found & (carried_lo < 0.5), last, carried_lo)
        garbage = A & (hi > 0.5) & (start > lo - 0.5) & (start < hi + 0.5)  # [CL]
        held = (A & ~garbage).to(torch.float32).sum()
        real = ((mask[0, 0] > -1.0).to(torch.float32).sum(-1) > 0.5).to(torch.float32)  # [T]
        # this step's rows each row attends (itself included): the mask over their slots
        mine = (torch.matmul(mask[0, 0], onehot.transpose(0, 1)) > -1.0).to(torch.float32)
        pos = held + mine.sum(-1) - 1.0  # [T]
        at = ((pos[:, None] - self.positions).abs() < 0.5).to(torch.float32)  # [T, CL]
        guarded = torch.where(garbage[None, None, None, :], torch.full_like(mask, MASKED), mask)
        # this step's rows' metadata: is it one chain (row r attends exactly rows 0..r)?
        chain_rows = self.tri * real[:, None] * real[None, :]
        is_chain = ((mine - chain_rows).abs().sum() < 0.5).to(torch.float32)
        first = index[0, 0].to(torch.float32) + 1.0
        row = torch.stack([first.expand(T), real.sum().expand(T), is_chain.expand(T),
                           torch.ones(T), lo.expand(T), hi.expand(T), pos], -1)  # [T, META]
        z = (sum(x.sum() for x in unread) + (meta_k > 1e30).to(torch.float32).sum()) * 0.0
        row = torch.cat([row, torch.zeros(T, D - META)], -1)[None, None] + z  # [1, 1, T, D]
        slot_position = torch.where(written > 0.5, position, zero)
        return Guarded(guarded, at, pos, slot_position, (row.transpose(2, 3) + 0.0, row))


class LadeGuardStep(DenseGenieStep):
    """``DenseGenieStep`` in the scatter form with the lookahead guard (the module docstring)."""

    @classmethod
    def make_guarded(cls, fam, hf, args, host, layers: tuple[int, int], seq_len: int,
                     context: int, residual_scale: float, inv_freq: np.ndarray
                     ) -> LadeGuardStep:
        """``DenseGenieStep.make`` in the scatter form, guarded; ``inv_freq`` [R]: the rope's
        frequencies as Genie computes them (``forge/genie/verify.genie_inv_freq``)."""
        step = cls.make(fam, hf, args, host, layers, seq_len, context,
                        GenieContract(cache_index=True), residual_scale)
        step.guard(inv_freq, meta_layer(args.num_hidden_layers, layers[0]))
        return step

    def guard(self, inv_freq: np.ndarray, meta: int) -> None:
        self.lade = LadeGuard(self.T, self.S, self.head_dim)
        for direction, io in (("in", self.io.inputs), ("out", self.io.outputs)):
            k, v = kv_names(meta, direction)
            io += [(k, "meta.k"), (v, "meta.v")]
        cos, sin = rope_tables(inv_freq, self.S)
        self.register_buffer("cos_table", cos, persistent=False)  # [CL, R]
        self.register_buffer("sin_table", sin, persistent=False)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return (*super().example_inputs(), *self.lade.example_meta())

    def forward(self, tokens, mask, cos, sin, index, *rest):
        g = self.lade(mask, index, rest[-2], rest[-1], cos, sin)
        cos2 = torch.matmul(g.at, self.cos_table)[None, None]  # [1, 1, T, R]
        sin2 = torch.matmul(g.at, self.sin_table)[None, None]
        out = super().forward(tokens, g.mask, cos2, sin2, index, *rest[:-2])
        return (*out, *g.meta)
