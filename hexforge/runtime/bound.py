"""A CPU session run through ORT IO binding, so a decode step allocates nothing it can avoid.

    inputs   bound by array identity: an array the previous call already bound (the engine's
             state buffers, which live as long as the engine; the previous shard's preallocated
             hidden output) is not bound again — ORT reads its memory in place, so in-place
             updates between calls are seen. New arrays (mask, rope rows, embeds) are rebound.
    outputs  preallocated once per graph and written in place. ``hidden`` and ``state:*`` are
             returned as they are (the engine consumes them within the step: the next shard, the
             state commit); anything else (logits, which callers may keep) is returned as a copy
             — one copy, as ORT's own output buffer had to be copied too, without its allocation.
             ``alias:<input>`` outputs (a cache the graph updates in place) are bound to the memory
             of that input whenever it is bound, and returned as that input's array.

Measured (bench/loop_overhead.py --runs 31 --tokens 32, tiny qwen3, interleaved): 237 vs 266 us
per decode token with the engine's AR-1 paths, which keep the per-step arrays (mask row, embed and
rope rows) the same objects so that nothing is rebound (before them: 307.5 vs 311.2). Real-size
steps are bound by weight traffic, where it changes nothing measurable.
``HEXFORGE_CPU_IOBINDING=0`` turns it off (plain ``InferenceSession.run``) for A/B runs.
"""

from __future__ import annotations

import numpy as np

from ..manifest import GraphSpec
from .state import NP_DTYPES


def preallocated(bind: str) -> bool:
    """Outputs returned as the preallocated array itself, not a copy: the engine consumes them
    before the same graph runs again."""
    return bind == "hidden" or bind.startswith(("state:", "alias:"))


class BoundSession:
    writes_in_place = True  # alias:<input> outputs are that input's own memory (see run())

    def __init__(self, sess, graph: GraphSpec):
        self.sess = sess
        self._io = sess.io_binding()
        self._bound: dict[str, np.ndarray] = {}
        self._names = [o.name for o in sess.get_outputs()]
        specs = {o.name: o for o in graph.outputs}
        self._fixed: dict[str, np.ndarray] = {}
        self._kept: list[bool] = []  # per output: returned as is (True) or as a copy
        # input name -> the outputs written into its memory (bound together in run()): more
        # than one where several ops update one cache (Gemma-4's KV-shared layers)
        self._alias: dict[str, list[str]] = {}
        for o in graph.outputs:
            if o.bind.startswith("alias:"):
                self._alias.setdefault(o.bind[6:], []).append(o.name)
        for name in self._names:
            spec = specs.get(name)
            self._kept.append(spec is not None and preallocated(spec.bind))
            if spec is not None and spec.bind.startswith("alias:"):
                self._fixed[name] = np.empty(0)  # its input's array, once bound
            elif spec is not None:
                arr = np.empty(spec.shape, dtype=NP_DTYPES[spec.dtype])
                self._io.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
                self._fixed[name] = arr
            else:
                self._io.bind_output(name, "cpu")
        self._all_fixed = len(self._fixed) == len(self._names)
        self._same: list[np.ndarray] | None = None
        self._update_same()

    def _update_same(self) -> None:
        """A graph whose outputs are all returned as they are (a decoder shard) returns the same
        list every call (remade when an alias output is bound to a new input array)."""
        self._same = [self._fixed[n] for n in self._names] if all(self._kept) else None

    def __getattr__(self, name: str):  # get_inputs(), get_outputs(), ... of the session
        return getattr(self.sess, name)

    def run(self, output_names, feeds: dict[str, np.ndarray], run_options=None) -> list[np.ndarray]:
        """As ``InferenceSession.run(None, feeds)``; preallocated outputs are the same arrays on
        every call (valid until this graph runs again)."""
        io, bound = self._io, self._bound
        for name, arr in feeds.items():
            if bound.get(name) is arr:
                continue
            if arr.flags.c_contiguous:
                io.bind_cpu_input(name, arr)
                bound[name] = arr  # the reference keeps the buffer (and the identity) alive
                outs = self._alias.get(name)
                for out in outs or ():  # the graph writes this input in place
                    io.bind_output(out, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
                    self._fixed[out] = arr
                if outs:
                    self._update_same()
            elif name in self._alias:  # a copy would take the in-place write and drop it
                raise ValueError(f"input {name} is updated in place: it must be contiguous")
            else:  # a strided view: bind a contiguous copy, never cache it
                io.bind_cpu_input(name, np.ascontiguousarray(arr))
                bound.pop(name, None)
        self.sess.run_with_iobinding(io, run_options)
        if self._same is not None:
            return self._same
        # ORT-allocated outputs (none unless the graph spec misses one): .numpy() is a view of a
        # buffer ORT reuses next call, so they are copied like the other unkept ones
        outs = None if self._all_fixed else io.get_outputs()
        return [self._fixed[n] if kept else
                self._fixed[n].copy() if n in self._fixed else outs[i].numpy().copy()
                for i, (n, kept) in enumerate(zip(self._names, self._kept, strict=True))]
