"""The scatter-form dense Genie step with the lookahead guard (build ``--genie-kv lade``): a graph
under which Genie's lookahead dialog (``lade``) gives ``basic``'s tokens (build time only:
imports torch; the evidence is docs/notes/genie-record.md, "lade").

libGenie 1.21's ``lade``, on the scatter form (``genieio.GenieContract.cache_index``), keeps a
step's rejected rows out of the next step's mask but commits its first (warm-up) step whole: its
window rows and placeholder guesses stay in every later step's context, and their rope
positions are counted. Genie's mask, cache index and positions alone do not tell that step from
an accepted chain, so the graph keeps what does in one more cache layer of the group, which
Genie copies to its slots like any layer's (the meta layer, ``meta_layer``)::

    past_key_<M>_in [1, 1, D, CL], past_value_<M>_in [1, 1, CL, D]   M = layers + the split's
    value row of slot s: [start, count, chain, written, warm, 0 ...]   first layer (one a split)
      start    1 + the slot its step's row 0 was written to (identifies the step)
      count    the step's real rows (a pad row attends nothing)
      chain    1 if row r of the step attended exactly rows 0..r of it (a prompt chunk, an
               AR-1 step, an accepted n-gram: every step but lade's warm-up and guesses)
      written  1 (Genie does not clear its buffers: a slot this dialog never wrote is dirty)
      warm     the start of the step found to be lade's warm-up (0: none yet), carried on

Genie writes a step's rows to consecutive slots, and the warm-up is found by the step right
after it: the last step before the current one (the largest start among the kept slots)
attended whole while not a chain can only be the warm-up -- a lade step's accepted rows are a
chain drawn from a step with branches, never all of it. Per step, all O(CL) (A: the past slots
row 0 attends, less those written this step)::

    last     = max start over A;  seen = |A & start == last|
    warm     = last if seen == count(last) & !chain(last) & count(last) > 1, else max warm over A
    mask     = Genie's, the slots of the warm-up step masked
    position = (A less the warm-up).sum() + (rows of this step the row attends) - 1   [AR]
    cos/sin  = one-hot(position) x the rope table [CL, R] (Genie's inv_freq, computed in fp64;
               Genie's position_ids_cos / _sin are read only to stay inputs)

Positions and slots are small integers in the graph's fp16: exact up to 2048, so the form is
refused for longer contexts (``MAX_CONTEXT``). Every split computes the same from its own copy
of the metadata, so no tensor but Genie's passes between splits.
"""

from __future__ import annotations

import numpy as np
import torch

from .genieio import MASKED, DenseGenieStep, GenieContract, kv_names

MAX_CONTEXT = 2048  # fp16 holds every integer up to 2048: positions and slots in the graph
META = 5  # the meta layer's fields: start, count, chain, written, warm


def meta_layer(num_layers: int, first_layer: int) -> int:
    """The meta layer's index in a split whose first layer is ``first_layer``: past every real
    layer, one a split."""
    return num_layers + first_layer


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
        if self.S > MAX_CONTEXT:
            raise ValueError(f"the lade guard computes positions in fp16: context <= {MAX_CONTEXT}")
        if self.head_dim < META:
            raise ValueError(f"head dim {self.head_dim}: the meta layer needs {META} fields")
        self.meta = meta
        for direction, io in (("in", self.io.inputs), ("out", self.io.outputs)):
            k, v = kv_names(meta, direction)
            io += [(k, "meta.k"), (v, "meta.v")]
        angles = np.arange(self.S, dtype=np.float64)[:, None] * np.asarray(inv_freq)[None]
        self.register_buffer("cos_table", torch.tensor(np.cos(angles), dtype=torch.float32),
                             persistent=False)  # [CL, R]
        self.register_buffer("sin_table", torch.tensor(np.sin(angles), dtype=torch.float32),
                             persistent=False)
        self.register_buffer("positions", torch.arange(self.S, dtype=torch.float32)[None],
                             persistent=False)  # [1, CL]
        self.register_buffer("tri", torch.tril(torch.ones(self.T, self.T)), persistent=False)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        D, S = self.head_dim, self.S
        return (*super().example_inputs(), torch.zeros(1, 1, D, S), torch.zeros(1, 1, S, D))

    def forward(self, tokens, mask, cos, sin, index, *rest):
        past, meta_k, meta_v = rest[:-2], rest[-2], rest[-1]
        T, D = self.T, self.head_dim
        meta = meta_v[0, 0]  # [CL, D]
        start, count, chain, written, warm = (meta[:, j] for j in range(META))
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
        carried = torch.where(A, warm, zero).max()
        warm_now = torch.where(found, last, carried)  # the warm-up's start, 0: none
        garbage = A & (warm_now > 0.5) & ((start - warm_now).abs() < 0.5)  # [CL]
        held = (A & ~garbage).to(torch.float32).sum()
        real = ((mask[0, 0] > -1.0).to(torch.float32).sum(-1) > 0.5).to(torch.float32)  # [T]
        # this step's rows each row attends (itself included): the mask over their slots
        mine = (torch.matmul(mask[0, 0], onehot.transpose(0, 1)) > -1.0).to(torch.float32)
        pos = held + mine.sum(-1) - 1.0  # [T]
        at = ((pos[:, None] - self.positions).abs() < 0.5).to(torch.float32)  # [T, CL]
        cos2 = torch.matmul(at, self.cos_table)[None, None]  # [1, 1, T, R]
        sin2 = torch.matmul(at, self.sin_table)[None, None]
        guarded = torch.where(garbage[None, None, None, :], torch.full_like(mask, MASKED), mask)
        out = super().forward(tokens, guarded, cos2, sin2, index, *past)
        # this step's rows' metadata: is it one chain (row r attends exactly rows 0..r)?
        chain_rows = self.tri * real[:, None] * real[None, :]
        is_chain = ((mine - chain_rows).abs().sum() < 0.5).to(torch.float32)
        first = index[0, 0].to(torch.float32) + 1.0
        row = torch.stack([first.expand(T), real.sum().expand(T), is_chain.expand(T),
                           torch.ones(T), warm_now.expand(T)], -1)  # [T, META]
        # Genie's rope and the meta keys, read (an input no node reads is dropped at export)
        z = (cos.sum() + sin.sum() + (meta_k > 1e30).to(torch.float32).sum()) * 0.0
        row = torch.cat([row, torch.zeros(T, D - META)], -1)[None, None] + z  # [1, 1, T, D]
        return (*out, row.transpose(2, 3) + 0.0, row)
