"""The engine: runs a bundle target's graphs. ``generate_step`` is the whole generation loop.

One step (prefill chunk of N, or a single decode token) at positions p .. p+T-1::

    ids [T] ─embed─▶ hidden ─▶ shard 0 ─▶ shard 1 ─▶ ... ─▶ hidden[n_valid-1] ─▶ head ─▶ logits [V]
                               │  ▲ state rows written at their slots after each shard
    positions ─▶ rope cos/sin, masks (one per slot group, shared by all shards of the step)

The last prefill chunk is padded to N; pad rows are never written to the caches and pad queries
are never read, so padding changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..errors import ContextOverflowError, RequestError
from ..manifest import GraphSpec, Manifest, confine
from .backends import Backend
from .host import HostInputs, load_host_tensors
from .multimodal import MediaRows
from .sampling import Sampler
from .state import NP_DTYPES, State

# observer(graph, feeds {input name: array}, outputs {bind: array}, valid positions): the oracle
# compares per graph with it, calibration records the feeds
Observer = Callable[[GraphSpec, dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray], None]


def tail_selector(k: int, T: int, n_valid: int) -> np.ndarray:
    """One-hot [1, k, k+T]: row i picks row n_valid + i of [fifo (k rows) | step inputs (T rows)],
    i.e. the last k inputs that were real tokens (pad rows of a last chunk are skipped)."""
    sel = np.zeros((1, k, k + T), dtype=np.float32)
    sel[0, np.arange(k), n_valid + np.arange(k)] = 1.0
    return sel


class Engine:
    def __init__(self, bundle: Path, manifest: Manifest, target: str, backend: Backend):
        self.manifest, self.target = manifest, manifest.targets[target]
        self.context = manifest.context
        self.prefill_len = self.target.plan.prefill_len
        tensors = load_host_tensors(confine(bundle, manifest.host_tensors))
        self.host = HostInputs(manifest.host, tensors, self.context + self.prefill_len)
        self.host.placeholder_ids = [e.placeholder_id for e in manifest.encoders]
        self.prompt_offset = 0  # index in the prompt of the current step's first row
        self.state = State(manifest)
        self.sessions = {g.name: backend.session(bundle, self.target, g) for g in self.target.graphs}
        self.hidden_dtype = NP_DTYPES[self.target.hidden_dtype]
        self.pos = 0
        self.observer: Observer | None = None
        # recurrent-state graphs (conv fifo) keep the last k valid inputs: one-hot "tail:<k>"
        binds = {i.bind for g in self.target.graphs for i in g.inputs}
        self.tails = sorted(int(b[5:]) for b in binds if b.startswith("tail:"))
        self.binds_valid = "valid" in binds
        # per-token rows the media add inside the decoder (Qwen3-VL deepstack): zeros elsewhere
        self.row_binds = {i.bind: i.shape[-1] for g in self.target.graphs if g.role in
                          ("prefill", "decode") for i in g.inputs if i.bind.startswith("deepstack:")}
        self.media: MediaRows | None = None  # the current prompt's soft tokens (prefill only)
        self.rope_delta = 0  # M-RoPE: rope position = slot position + delta after the prompt

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    def reset(self) -> None:
        self.state.reset()
        self.pos = 0
        self.media, self.rope_delta = None, 0

    # ---- one step ----------------------------------------------------------------------------
    def _run(self, graph: GraphSpec, inputs: dict[str, np.ndarray],
             positions: np.ndarray) -> dict[str, np.ndarray]:
        """One session call. State outputs go to ``inputs["new:<state>"]`` (later graphs of the
        step may bind them, e.g. a KV-shared layer reading its donor's new rows) and are written
        to the state buffers only when the step ends (``_commit``)."""
        feeds = {}
        for spec in graph.inputs:
            kind, _, arg = spec.bind.partition(":")
            feeds[spec.name] = self.state.buffer(arg) if kind == "state" else inputs[spec.bind]
        values = self.sessions[graph.name].run(None, feeds)
        out = {}
        for spec, value in zip(graph.outputs, values, strict=True):
            kind, _, arg = spec.bind.partition(":")
            if kind == "state":
                inputs[f"new:{arg}"] = value
            else:
                out[spec.bind] = value
        if self.observer:
            outputs = {s.bind: v for s, v in zip(graph.outputs, values, strict=True)}
            self.observer(graph, feeds, outputs, positions)
        return out

    def forward(self, ids: np.ndarray, n_valid: int, role: str) -> np.ndarray:
        """Run ids [T] (first n_valid real) at self.pos through every shard; -> logits [V]."""
        T = ids.shape[0]
        positions = self.pos + np.arange(T, dtype=np.int64)
        gather_ids = self.host.media_ids(ids)
        embeds = self.host.embed(gather_ids)
        inputs = {}
        for name, value in self.host.extra_embeds(gather_ids).items():
            inputs[f"host:{name}"] = value
        rope_pos = positions + self.rope_delta
        if self.media is not None:  # this step's slice of the prompt's soft tokens
            embeds, rows, rope_pos = self.media.slice(self.prompt_offset, T, embeds, rope_pos)
            inputs.update(rows)
        for bind, dim in self.row_binds.items():
            inputs.setdefault(bind, np.zeros((1, T, dim), np.float32))
        embeds = embeds.astype(self.hidden_dtype, copy=False)
        inputs["hidden"] = inputs["embed"] = embeds
        for name in self.host.rope:
            inputs[f"rope_cos:{name}"], inputs[f"rope_sin:{name}"] = self.host.rope_tables(
                name, rope_pos)
        for name, group in self.state.groups.items():
            inputs[f"mask:{name}"] = group.mask(positions, self.target.mask_value)
        if self.binds_valid:
            inputs["valid"] = (np.arange(T) < n_valid).astype(np.float32)[None]  # [1, T]
        for k in self.tails:
            inputs[f"tail:{k}"] = tail_selector(k, T, n_valid)
        for shard in self.target.plan.shards:
            graph = self.target.graph(shard.prefill if role == "prefill" else shard.decode)
            inputs["hidden"] = self._run(graph, inputs, positions[:n_valid])["hidden"]
        valid = positions[:n_valid]
        for key, value in inputs.items():  # the step's state writes, after every graph read
            if key.startswith("new:"):
                self.state.update(key[4:], value, valid)
        for group in self.state.groups.values():
            group.commit(valid)
        self.pos += n_valid
        last = inputs["hidden"][:, n_valid - 1:n_valid]
        head = self.target.graph(self.target.plan.head)
        return self._run(head, {"hidden": last}, positions[n_valid - 1:n_valid])["logits"][0, -1]

    def prefill(self, ids: list[int], mode: str = "chunked", media: MediaRows | None = None
                ) -> np.ndarray:
        """Prompt -> logits of its last token. mode "decode" feeds it through the AR-1 graph.
        media: the soft tokens (and M-RoPE positions) of this prompt's images / audio."""
        ids_arr = np.asarray(ids, dtype=np.int64)
        self.media, self.prompt_offset = media, 0
        try:
            if mode == "decode":
                for i in range(len(ids_arr)):
                    self.prompt_offset = i
                    logits = self.forward(ids_arr[i:i + 1], 1, "decode")
                return logits
            N = self.prefill_len
            for start in range(0, len(ids_arr), N):
                chunk = ids_arr[start:start + N]
                n = chunk.shape[0]
                if n < N:
                    chunk = np.concatenate([chunk, np.zeros(N - n, dtype=np.int64)])
                self.prompt_offset = start
                logits = self.forward(chunk, n, "prefill")
            return logits
        finally:
            if media is not None:
                self.rope_delta = media.rope_delta
            self.media = None

    def decode(self, token: int) -> np.ndarray:
        return self.forward(np.array([token], dtype=np.int64), 1, "decode")

    # ---- media encoders ------------------------------------------------------------------------
    def encode(self, spec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run encoder ``spec``'s graph on preprocessed inputs; -> {bind: array} ("soft", ...)."""
        graph = self.target.graph(spec.name)
        feeds = {}
        for i in graph.inputs:
            value = inputs[i.bind.removeprefix("media:")]
            if list(value.shape) != i.shape:
                raise RequestError(f"{spec.name} input {i.name}: shape {list(value.shape)} != the "
                                   f"graph's {i.shape}")
            feeds[i.name] = value.astype(NP_DTYPES[i.dtype], copy=False)
        values = self.sessions[graph.name].run(None, feeds)
        return {o.bind: v for o, v in zip(graph.outputs, values, strict=True)}

    # ---- the loop ------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], max_new_tokens: int, past: int = 0) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty (0 tokens)")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        bad = [t for t in prompt_ids if not (isinstance(t, int | np.integer)
                                             and 0 <= t < self.vocab_size)]
        if bad:
            raise RequestError(f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if past + len(prompt_ids) + max_new_tokens > self.context:
            raise ContextOverflowError(past + len(prompt_ids), max_new_tokens, self.context)

    def generate_step(self, prompt_ids: list[int], sampler: Sampler, max_new_tokens: int,
                      prefill_mode: str = "chunked", fresh: bool = True,
                      media: MediaRows | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (token, logits it was sampled from) up to max_new_tokens; stop by breaking out.
        fresh=False continues from the current state (a chat session's next turn): the ids are
        appended at self.pos. Every yielded token but the last is in the state afterwards."""
        self.check_request(prompt_ids, max_new_tokens, 0 if fresh else self.pos)
        if fresh:
            self.reset()
        logits = self.prefill(prompt_ids, prefill_mode, media)
        for i in range(max_new_tokens):
            token = sampler(logits)
            yield token, logits
            if i + 1 < max_new_tokens:
                logits = self.decode(token)
