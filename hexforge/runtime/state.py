"""State buffers, allocated once from the manifest's state spec and carried between calls.

    kv_full     [1, KVH, C, D]  row p holds position p
    kv_sliding  [1, KVH, W, D]  ring: row p % W holds position p (keeps the last W positions)
    kv_shared   no buffer: reads resolve to the donor state's buffer
    conv_fifo / ssm   [1, ...]  replaced whole by the graph's output

A ``SlotGroup`` tracks which position each cache row holds, for every cache of its group at once,
and turns that into the additive attention mask of a step.

Decode steps (T = 1) have their own cheap paths, same values as the general ones: the mask is one
persistent row that each commit moves on by one or two elements (``decode_mask``), and a KV write is
one row by basic indexing: rebuilding the mask and fancy-indexed writes were a fifth of a
tiny-model token (docs/notes/measurements.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..bundle.manifest import Manifest, MaskGroup, StateSpec, TargetSpec

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
             "uint16": np.uint16, "uint8": np.uint8, "int8": np.int8, "bool": np.bool_}


class SlotGroup:
    def __init__(self, spec: MaskGroup):
        self.capacity, self.window = spec.capacity, spec.window
        self.ring = spec.window is not None
        self.slot_pos = np.full(self.capacity, -1, dtype=np.int64)  # position held by each row
        # decode_mask's row: mask([row_q]), kept in place (IO binding then never rebinds it);
        # row_q = -1: stale, rebuilt on the next decode_mask
        self.row = np.zeros((1, 1, 1, self.capacity + 1), dtype=np.float32)
        self.row_q, self.row_value = -1, None  # type: tuple[int, float | None]

    def reset(self) -> None:
        self.slot_pos.fill(-1)
        self.row_q = -1

    def surviving(self, positions: np.ndarray) -> np.ndarray:
        """The positions a write keeps: a ring holds only the last `capacity` of them."""
        return positions[-self.capacity:] if self.ring else positions

    def slots(self, positions: np.ndarray) -> np.ndarray:
        """Rows that (surviving) positions go to."""
        return positions % self.capacity if self.ring else positions

    def slot(self, position: int) -> int:
        return position % self.capacity if self.ring else position

    def mask(self, q_pos: np.ndarray, mask_value: float) -> np.ndarray:
        """Additive mask [1, 1, T, capacity + T] for queries at q_pos [T] (consecutive)."""
        T = q_pos.shape[0]
        held = self.slot_pos[None, :]  # [1, S]
        cache_ok = held >= 0
        rel = np.arange(T)[None, :] <= np.arange(T)[:, None]  # causal among the new tokens
        if self.window is not None:
            cache_ok = cache_ok & (q_pos[:, None] - held < self.window)
            rel = rel & (np.arange(T)[:, None] - np.arange(T)[None, :] < self.window)
        else:
            cache_ok = np.broadcast_to(cache_ok, (T, self.capacity))
        ok = np.concatenate([cache_ok, rel], axis=1)
        return np.where(ok, np.float32(0), np.float32(mask_value))[None, None].astype(np.float32)

    def decode_mask(self, q: int, mask_value: float) -> np.ndarray:
        """``mask([q])`` [1, 1, 1, capacity + 1] as the persistent ``row``: rebuilt only when it
        is stale (after a reset or a prefill chunk), else commit() has already moved it to q.
        Valid until the next commit; callers must not write it."""
        if self.row_q != q or self.row_value != mask_value:
            self.row[...] = self.mask(np.array([q]), mask_value)
            self.row_q, self.row_value = q, mask_value
        return self.row

    def commit(self, positions: np.ndarray) -> None:
        if positions.shape[0] == 1:  # a decode step
            p = int(positions[0])
            self.slot_pos[self.slot(p)] = p
            if p == self.row_q:
                self._advance_row()
                return
        else:
            kept = self.surviving(positions)
            self.slot_pos[self.slots(kept)] = kept
        self.row_q = -1

    def _advance_row(self) -> None:
        """The row was mask([q]) and q was just written: make it mask([q + 1]). Slot(q) becomes
        visible; in a window, the one position that leaves it (q + 1 - W) is hidden if still held."""
        q = self.row_q
        self.row[0, 0, 0, self.slot(q)] = 0.0
        if self.window is not None:
            gone = q + 1 - self.window
            if gone >= 0 and self.slot_pos[self.slot(gone)] == gone:
                self.row[0, 0, 0, self.slot(gone)] = self.row_value
        self.row_q = q + 1


def _source(spec: StateSpec) -> str:
    """A kv_shared state's donor (the manifest checks every kv_shared state names one)."""
    assert spec.source is not None, spec.name
    return spec.source


def _group(spec: StateSpec) -> str:
    """A KV cache's slot group (the manifest checks every kv_* state names one)."""
    assert spec.group is not None, spec.name
    return spec.group


def write_rows(buf: np.ndarray, new: np.ndarray, slots: np.ndarray, axis: int = 2) -> None:
    """buf [1, H, S, D] <- new [1, H, T, D] rows [:n] at `slots` [n] (slices when contiguous);
    ``axis`` 3: keys held transposed, buf [1, H, D, S] <- new [1, H, D, T]."""
    n = slots.shape[0]
    lead: tuple[slice, ...] = (slice(None),) * axis
    src = new[(*lead, slice(0, n))]
    s0 = int(slots[0])
    if int(slots[-1]) - s0 == n - 1:
        buf[(*lead, slice(s0, s0 + n))] = src
    else:
        rows: tuple[slice | np.ndarray, ...] = (*lead, slots)
        buf[rows] = src


@dataclass(frozen=True)
class BufferForm:
    """How a target's graphs hold one state buffer where that is not the manifest's spec: the
    dtype, and a KV cache's keys transposed (rows along the last axis, [1, KVH, D, C])."""
    dtype: str
    keys_transposed: bool = False


def target_forms(manifest: Manifest, target: TargetSpec) -> dict[str, BufferForm]:
    """State name -> its BufferForm in the target's graphs (their input TensorSpecs), where it
    differs from the manifest's (HTP graphs with fp16 activations take the KV cache as float16,
    keys transposed: forge/compile/kvcast.py). A kv_shared bind reads its donor's buffer."""
    specs = {s.name: s for s in manifest.state}
    out: dict[str, BufferForm] = {}
    for g in target.graphs:
        for t in g.inputs:
            kind, _, name = t.bind.partition(":")
            if kind != "state" or name not in specs:
                continue
            while specs[name].kind == "kv_shared":
                name = _source(specs[name])
            if t.dtype != specs[name].dtype or t.keys_transposed:
                out[name] = BufferForm(t.dtype, t.keys_transposed)
    return out


class State:
    def __init__(self, manifest: Manifest, forms: dict[str, BufferForm] | None = None):
        """``forms``: state name -> BufferForm where the target's graphs hold a buffer unlike
        the manifest's spec (``target_forms``)."""
        forms = forms or {}
        self.specs: dict[str, StateSpec] = {s.name: s for s in manifest.state}
        self.groups = {g.name: SlotGroup(g) for g in manifest.mask_groups}
        self.buffers: dict[str, np.ndarray] = {}
        for s in manifest.state:
            if s.kind == "kv_shared":
                continue
            form = forms.get(s.name, BufferForm(s.dtype))
            shape = [*s.shape[:-2], s.shape[-1], s.shape[-2]] if form.keys_transposed else s.shape
            self.buffers[s.name] = np.zeros([1, *shape], dtype=NP_DTYPES[form.dtype])
        # KV caches: (buffer, slot group, the axis its rows run along), looked up once per write
        self.kv = {s.name: (self.buffers[s.name], self.groups[_group(s)],
                            3 if forms.get(s.name, BufferForm(s.dtype)).keys_transposed else 2)
                   for s in manifest.state if s.kind in ("kv_full", "kv_sliding")}

    def reset(self) -> None:
        """A fresh sequence. The recurrent states (conv fifos, ssm) are read whole: zeroed. KV
        caches are not: no step reads a row its slot group does not hold. The cpu steps read
        only the rows held; the static steps' mask hides the others (the HTP recipes' bounded
        -100 too: the test on w8-fp16 gives a fresh engine's logits bit for bit), and their
        values, zero-initialised or stale, are finite. Zeroing them cost every request a pass
        over all of them, and the first one a fault of every page; left alone, a page of cache
        is resident once a step writes a row in it (docs/notes/measurements.md)."""
        for name, b in self.buffers.items():
            if name not in self.kv:
                b.fill(0)
        for g in self.groups.values():
            g.reset()

    def buffer(self, name: str) -> np.ndarray:
        spec = self.specs[name]
        while spec.kind == "kv_shared":
            spec = self.specs[_source(spec)]
        return self.buffers[spec.name]

    def commit(self, new: dict[str, np.ndarray], positions: np.ndarray) -> None:
        """The end of a step at positions [n] (its valid rows): the state outputs {state: value}
        go to the buffers, then every slot group records the positions."""
        if positions.shape[0] == 1:  # a decode step: one row per cache, by basic indexing
            p = int(positions[0])
            for name, value in new.items():
                if name in self.kv:
                    buf, group, axis = self.kv[name]
                    if axis == 2:
                        buf[0, :, group.slot(p)] = value[0, :, 0]
                    else:  # keys transposed: the row is a column
                        buf[0, :, :, group.slot(p)] = value[0, :, :, 0]
                else:
                    self.update(name, value, positions)
        else:
            for name, value in new.items():
                self.update(name, value, positions)
        for group in self.groups.values():
            group.commit(positions)

    def update(self, name: str, value: np.ndarray, positions: np.ndarray) -> None:
        """Apply a graph's state output: KV rows at their slots, other kinds replaced whole."""
        kv = self.kv.get(name)
        if kv is not None:
            buf, group, axis = kv
            kept = group.surviving(positions)
            skip = positions.shape[0] - kept.shape[0]
            rows = value[:, :, skip:] if axis == 2 else value[:, :, :, skip:]
            write_rows(buf, rows, group.slots(kept), axis)
        elif self.specs[name].kind == "kv_shared":
            raise ValueError(f"state {name} is kv_shared: graphs must not write it")
        else:
            self.buffers[name][...] = value

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())
