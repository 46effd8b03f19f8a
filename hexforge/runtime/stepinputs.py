"""The host-made inputs of one step: what the engine feeds its graphs besides the state.

    ids [T], positions [T] ─▶ embed rows (or the prompt's soft tokens), per-layer rows
                            ─▶ rope cos / sin (position + the prompt's M-RoPE delta)
                            ─▶ masks and cache lengths (one per slot group), valid [1, T], tails

A decode step (T = 1, no media) writes its rows into the arrays of the first AR-1 step, which IO
binding then binds once: the same values by the same float ops in fewer Python steps.
"""

from __future__ import annotations

import numpy as np

from ..bundle.manifest import TargetSpec
from .host import HostInputs
from .multimodal import MediaRows
from .state import NP_DTYPES, State
from .stepplan import StepPlan


def tail_selector(k: int, T: int, n_valid: int) -> np.ndarray:
    """One-hot [1, k, k+T]: row i picks row n_valid + i of [fifo (k rows) | step inputs (T rows)],
    i.e. the last k inputs that were real tokens (pad rows of a last chunk are skipped)."""
    sel = np.zeros((1, k, k + T), dtype=np.float32)
    sel[0, np.arange(k), n_valid + np.arange(k)] = 1.0
    return sel


class StepInputs:
    """Makes a step's {bind: array} inputs; holds the current prompt's media rows (prefill only)
    and its M-RoPE delta (after it)."""

    def __init__(self, host: HostInputs, plan: StepPlan, state: State, target: TargetSpec):
        self.host, self.plan, self.state = host, plan, state
        self.mask_value = target.mask_value
        self.hidden_dtype = NP_DTYPES[target.hidden_dtype]
        self.media: MediaRows | None = None  # the current prompt's soft tokens (prefill only)
        self.prompt_offset = 0  # index in the prompt of the current step's first row
        self.rope_delta = 0  # M-RoPE: rope position = slot position + delta after the prompt
        # cpu graphs that read only the cache rows held (in-place caches; Gemma-4's cut caches):
        # rows held after the step, per group, as GroupQueryAttention takes them — arrays kept
        # across steps, updated in place
        self.kv_lengths = {name: (np.zeros(1, np.int32), np.zeros((), np.int32))
                           for name in plan.kv_length_groups}
        self._constants_of: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self._kept_rows: dict[str, np.ndarray] = {}
        self._ar1: dict[str, np.ndarray] | None = None  # the first AR-1 step's inputs, reused

    def reset(self) -> None:
        self.media, self.rope_delta = None, 0

    def step(self, ids: np.ndarray, positions: np.ndarray, n_valid: int, role: str
             ) -> dict[str, np.ndarray]:
        """The inputs of a step at positions [T] (the first n_valid rows real): {bind: array}."""
        if role == "decode" and self.media is None:
            inputs = self._decode(int(ids[0]), int(positions[0]))
            if inputs is not None:
                return inputs
        inputs = self._general(ids, positions, n_valid, role)
        if role == "decode" and self.media is None:
            self._ar1 = inputs
        return inputs

    def _general(self, ids: np.ndarray, positions: np.ndarray, n_valid: int, role: str
                 ) -> dict[str, np.ndarray]:
        T = ids.shape[0]
        gather_ids = self.host.media_ids(ids)
        embeds = self.host.embed(gather_ids)
        inputs = {f"host:{name}": value
                  for name, value in self.host.extra_embeds(gather_ids).items()}
        inputs.update(self._constants(T, n_valid))
        rope_pos = positions + self.rope_delta
        if self.media is not None:  # this step's slice of the prompt's soft tokens
            embeds, rows, rope_pos = self.media.slice(self.prompt_offset, T, embeds, rope_pos)
            inputs.update(rows)  # replaces the zero rows
        inputs["hidden"] = inputs["embed"] = embeds.astype(self.hidden_dtype, copy=False)
        for name in self.plan.ropes:
            inputs[f"rope_cos:{name}"], inputs[f"rope_sin:{name}"] = self.host.rope_tables(
                name, rope_pos)
        self._lengths_and_masks(inputs, role, int(positions[0]), positions if T > 1 else None)
        if T == 1:  # AR-1: the per-step rows go into arrays kept across steps, which IO binding
            # then binds once (a bind costs ~1 us, copying one row ~0.2 us)
            for key in self.plan.row_keys:
                inputs[key] = self._kept_row(key, inputs[key])
            inputs["embed"] = inputs["hidden"]
        return inputs

    def _decode(self, token: int, pos: int) -> dict[str, np.ndarray] | None:
        """A decode step's inputs written into the arrays the last one bound: the embed and rope
        rows in place, the cache lengths and mask rows as ``_general`` makes them. None where the
        general path must run: no AR-1 step yet, a rope position past the tables."""
        inputs, host = self._ar1, self.host
        rope_pos = pos + self.rope_delta
        if inputs is None or not 0 <= rope_pos < host.max_positions:
            return None
        host.write_token_rows(token, self._kept_rows)
        # a shard's output replaced "hidden" last step
        inputs["hidden"] = inputs["embed"] = self._kept_rows["hidden"]
        for name in self.plan.ropes:
            cos, sin = host.rope[name]
            self._kept_rows[f"rope_cos:{name}"][0, 0] = cos[rope_pos]
            self._kept_rows[f"rope_sin:{name}"][0, 0] = sin[rope_pos]
        self._lengths_and_masks(inputs, "decode", pos)
        return inputs

    def _constants(self, T: int, n_valid: int) -> dict[str, np.ndarray]:
        """The inputs that depend on (T, n_valid) only: valid [1, T], the tail:<k> one-hots,
        zero deepstack rows. Made once per (T, n_valid) — a decode step is always (1, 1) — and
        shared by every step of that shape, so nothing may write them."""
        c = self._constants_of.get((T, n_valid))
        if c is None:
            c = {bind: np.zeros((1, T, dim), np.float32) for bind, dim in self.plan.row_binds.items()}
            if self.plan.binds_valid:
                c["valid"] = (np.arange(T) < n_valid).astype(np.float32)[None]  # [1, T]
            for k in self.plan.tails:
                c[f"tail:{k}"] = tail_selector(k, T, n_valid)
            self._constants_of[(T, n_valid)] = c
        return c

    def _lengths_and_masks(self, inputs: dict[str, np.ndarray], role: str, pos: int,
                           positions: np.ndarray | None = None) -> None:
        """A step's cache lengths (row p holds position p) and masks into ``inputs``: rows at
        ``positions`` [T], or (None) one row at ``pos``, whose masks are their groups'
        persistent decode rows."""
        last = pos if positions is None else int(positions[-1])
        for name, (seqlens, total) in self.kv_lengths.items():
            total[...] = last + 1
            seqlens[0] = last
            inputs[f"kv_seqlens:{name}"], inputs[f"kv_total:{name}"] = seqlens, total
        for name in self.plan.masks[role]:
            group = self.state.groups[name]
            inputs[f"mask:{name}"] = (group.decode_mask(pos, self.mask_value) if positions is None
                                      else group.mask(positions, self.mask_value))

    def _kept_row(self, key: str, value: np.ndarray) -> np.ndarray:
        """value copied into the array kept for key (made on first use)."""
        kept = self._kept_rows.get(key)
        if kept is None or kept.shape != value.shape or kept.dtype != value.dtype:
            kept = self._kept_rows[key] = np.empty_like(value)
        kept[...] = value
        return kept
