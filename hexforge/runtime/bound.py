"""A CPU session run through ORT IO binding, so a decode step allocates nothing it can avoid.

    inputs   bound by array identity: an array the previous call already bound (the engine's
             state buffers, which live as long as the engine; the previous shard's preallocated
             hidden output) is not bound again — ORT reads its memory in place, so in-place
             updates between calls are seen. New arrays (mask, rope rows, embeds) are rebound.
    outputs  preallocated once per graph, written in place and returned as they are: valid
             until this graph runs again. The engine consumes ``hidden`` and ``state:*`` within
             the step; the logits go to the caller, and ``Engine.decode``/``prefill`` copy them
             unless asked not to (``copy=False``: generate_step, the benchmarks), which saves a
             fresh buffer's page faults a token. ``alias:<input>`` outputs (a cache the
             graph updates in place) are bound to the memory of that input whenever it is bound,
             and returned as that input's array.
    repeats  a call whose feeds are the very arrays of the call before (an AR-1 step: the state
             buffers, the kept per-step rows, the shard outputs) skips the binding loop: one
             tuple of names and ids, compared in C, instead of ~60 dict lookups.

It pays where the Python loop shows (small models), with the engine's AR-1 paths keeping the
per-step arrays the same objects so that nothing is rebound; real-size steps are bound by weight
traffic (docs/notes/measurements.md).
"""

from __future__ import annotations

import numpy as np

from ..bundle.manifest import GraphSpec
from .state import NP_DTYPES


class BoundSession:
    writes_in_place = True  # alias:<input> outputs are that input's own memory (see run())

    def __init__(self, sess, graph: GraphSpec):
        self.sess = sess
        self._io = sess.io_binding()
        self._bound: dict[str, np.ndarray] = {}
        self._last_ids: tuple | None = None  # the names and id()s of a repeatable call's feeds
        self._names = [o.name for o in sess.get_outputs()]
        specs = {o.name: o for o in graph.outputs}
        self._fixed: dict[str, np.ndarray] = {}
        # input name -> the outputs written into its memory (bound together in run()): more
        # than one where several ops update one cache (Gemma-4's KV-shared layers)
        self._alias: dict[str, list[str]] = {}
        for o in graph.outputs:
            if o.bind.startswith("alias:"):
                self._alias.setdefault(o.bind[6:], []).append(o.name)
        for name in self._names:
            spec = specs.get(name)
            if spec is not None and spec.bind.startswith("alias:"):
                self._fixed[name] = np.empty(0)  # its input's array, once bound
            elif spec is not None:
                arr: np.ndarray = np.empty(spec.shape, dtype=NP_DTYPES[spec.dtype])
                self._io.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
                self._fixed[name] = arr
            else:
                self._io.bind_output(name, "cpu")
        self._same: list[np.ndarray] | None = None
        self._update_same()

    def _update_same(self) -> None:
        """A graph whose outputs are all preallocated returns the same list every call (remade
        when an alias output is bound to a new input array)."""
        self._same = ([self._fixed[n] for n in self._names]
                      if len(self._fixed) == len(self._names) else None)

    def __getattr__(self, name: str):  # get_inputs(), get_outputs(), ... of the session
        return getattr(self.sess, name)

    def run(self, output_names, feeds: dict[str, np.ndarray], run_options=None) -> list[np.ndarray]:
        """As ``InferenceSession.run(None, feeds)``; the outputs are the same arrays on every
        call (valid until this graph runs again)."""
        ids = (*feeds, *map(id, feeds.values()))  # names, then arrays: compared in C
        if ids != self._last_ids:  # an id is unique here: self._bound holds each bound array
            self._last_ids = ids if self._bind(feeds) else None
        self.sess.run_with_iobinding(self._io, run_options)
        if self._same is not None:
            return self._same
        # ORT-allocated outputs (none unless the graph spec misses one): .numpy() is a view of a
        # buffer ORT reuses next call, so they are copied
        outs = self._io.get_outputs()
        return [self._fixed[n] if n in self._fixed else outs[i].numpy().copy()
                for i, n in enumerate(self._names)]

    def _bind(self, feeds: dict[str, np.ndarray]) -> bool:
        """Bind the feeds not bound already; -> whether all of them are now (none was a strided
        view, bound as a copy that is not kept and whose id may be reused)."""
        io, bound, kept = self._io, self._bound, True
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
                kept = False
        return kept
