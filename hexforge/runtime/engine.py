"""The engine: runs a bundle target's graphs. ``generate_step`` yields a request's (token,
logits) steps, which runtime/loop.py turns into text; ``stepinputs.StepInputs`` makes each step's
host inputs.

One step (prefill chunk of N, or a single decode token) at positions p .. p+T-1::

    ids [T] ─embed─▶ hidden ─▶ shard 0 ─▶ shard 1 ─▶ ... ─▶ hidden[n_valid-1] ─▶ head ─▶ logits [V]
                               │  ▲ state rows written at their slots after each shard
    positions ─▶ rope cos/sin, masks (one per slot group, shared by all shards of the step)

A cpu target's last decode graph runs the head itself (``TargetSpec.decode_runs_head``): a decode
step is then one session run per shard and nothing more.

The last prefill chunk is padded to N; pad queries are never read, and pad rows are either not
written to the caches (static graphs) or written past the last real row (cpu graphs that update
the cache in place), where the next step's own rows overwrite them before anything reads them. So
padding changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..bundle.errors import BundleError, RequestError
from ..bundle.hostfile import load_host_tensors, shared_table
from ..bundle.manifest import GraphSpec, Manifest, confine
from .backends import Backend
from .host import HostInputs
from .multimodal import MediaRows
from .options import check_request
from .sampling import Sampler
from .speculative import PromptLookup, StepCosts, check_speculation, speculative_steps
from .state import NP_DTYPES, State, target_forms
from .stepinputs import StepInputs
from .stepplan import StepPlan

# observer(graph, feeds {input name: array}, outputs {bind: array}, valid positions): the oracle
# compares per graph with it, calibration records the feeds
Observer = Callable[[GraphSpec, dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray], None]


class Engine:
    def __init__(self, bundle: Path, manifest: Manifest, target: str, backend: Backend,
                 prefill_mode: str = "chunked"):
        self.manifest, self.target = manifest, manifest.targets[target]
        tensors = load_host_tensors(confine(bundle, manifest.host_tensors))
        embed = manifest.host.embed
        if embed.shared is not None:  # a tied quantized head's rows: the table stored once
            tensors[embed.table] = shared_table(confine(bundle, embed.shared.file), embed.table,
                                                embed.shared)
        host = HostInputs(manifest.host, tensors, self.context + self.prefill_len,
                          [e.placeholder_id for e in manifest.encoders])
        self.plan = StepPlan.of(manifest, self.target, host.rope)  # what each step runs
        self.state = State(manifest, target_forms(manifest, self.target))  # HTP: fp16 KV
        self.inputs = StepInputs(host, self.plan, self.state, self.target)
        # a graph's session is opened when the engine is made if its steps are this engine's
        # usual ones, else on its first use: verify graphs (speculative decoding) at the first
        # verify step — a request without it pays neither their load time nor their copy of the
        # weights — and, under prefill_mode "decode", the prefill graphs (a model whose two graph
        # sets pass what one HTP process domain holds runs its prompts through AR-1 alone)
        self.bundle, self.backend = bundle, backend
        self.prefill_mode = prefill_mode  # a request's default
        self.step_costs = StepCosts()  # decode vs verify step time: when a draft pays
        self.sessions: dict = {}
        later = {"verify"} | ({"prefill"} if prefill_mode == "decode" else set())
        for g in self.target.graphs:
            if g.role not in later and g.name != self.target.plan.verify_head:
                self.session(g)
        self.pos = 0
        self.resets = 0  # a chat session's state is its own only while no reset came between
        self.observer: Observer | None = None
        # per graph, each input's step key or its state buffer (which lives as long as the
        # engine): bound once, not per call
        self._feeds = {name: [(f.name, f.key or "", None if f.state is None
                               else self.state.buffer(f.state)) for f in feeds]
                       for name, feeds in self.plan.feeds.items()}

    @property
    def context(self) -> int:
        return self.manifest.context

    @property
    def prefill_len(self) -> int:
        return self.target.plan.prefill_len

    @property
    def host(self) -> HostInputs:
        return self.inputs.host

    @property
    def hidden_dtype(self) -> type:
        """The dtype of the hidden rows the graphs hand on (the head's input)."""
        return self.inputs.hidden_dtype

    @property
    def verify_len(self) -> int:
        """Rows of a verify step (runtime/speculative.py drafts one fewer)."""
        return self.plan.verify_len

    def session(self, g: GraphSpec):
        """Graph ``g``'s session, opened on first use. A graph that updates a cache in place
        (``alias:<input>`` outputs) needs a session that writes its outputs into that input's
        memory (the cpu backend's ``BoundSession``)."""
        sess = self.sessions.get(g.name)
        if sess is None:
            sess = self.backend.session(self.bundle, self.target, g)
            if (any(o.bind.startswith("alias:") for o in g.outputs)
                    and not getattr(sess, "writes_in_place", False)):
                raise BundleError(f"graph {g.name} updates its cache in place (alias: outputs), "
                                  f"which only the cpu backend runs; target {self.target.name} "
                                  f"cannot run on backend {self.backend.name}")
            self.sessions[g.name] = sess
        return sess

    def load_verify_sessions(self) -> None:
        """Open the verify graphs' sessions and the verify head's (HTP targets without them
        verify through the prefill graphs: nothing to open). The first verify step does; a
        benchmark may beforehand."""
        head = [self.plan.verify_head] if self.plan.verify_head else []
        for g in [*self.plan.graphs["verify"], *head]:
            self.session(g)

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    def reset(self) -> None:
        self.state.reset()
        self.inputs.reset()
        self.pos = 0
        self.resets += 1

    # ---- one step ----------------------------------------------------------------------------
    def _run(self, graph: GraphSpec, inputs: dict[str, np.ndarray], positions: np.ndarray) -> None:
        """One session call; its outputs go into ``inputs``: "hidden" (the next graph's input),
        "logits", and state outputs as "new:<state>" (later graphs of the step may bind them, e.g.
        a KV-shared layer reading its donor's new rows; forward() writes them to the state
        buffers when the step ends)."""
        feeds = {name: inputs[key] if buf is None else buf
                 for name, key, buf in self._feeds[graph.name]}
        values = self.session(graph).run(None, feeds)
        for key, value in zip(self.plan.outputs[graph.name], values, strict=True):
            inputs[key] = value
        if self.observer:
            outputs = {s.bind: v for s, v in zip(graph.outputs, values, strict=True)}
            self.observer(graph, feeds, outputs, positions)

    def forward(self, ids: np.ndarray, n_valid: int, role: str, head: bool = True
                ) -> np.ndarray | None:
        """Run ids [T] (first n_valid real) at self.pos through every shard; -> logits [V], or
        None with head=False (a prefill chunk before the last: its logits are never read)."""
        positions = np.arange(self.pos, self.pos + ids.shape[0], dtype=np.int64)
        valid = positions[:n_valid]
        inputs = self.inputs.step(ids, positions, n_valid, role)
        for graph in self.plan.graphs[role]:
            self._run(graph, inputs, valid)  # hidden -> hidden, state -> new:<state>
        # the state writes, once every graph has read the old rows
        self.state.commit({name: inputs[key] for key, name in self.plan.writes[role].items()}, valid)
        self.pos += n_valid
        if self.plan.head_in_step[role]:  # the last graph ran the head (cpu decode: one session)
            return inputs["logits"][0, -1]
        if not head:
            return None
        # the head reads the last valid row; an AR-1 step's hidden is that row already, and the
        # shard's own output array (not a new view of it) is one IO binding has bound before
        hidden = inputs["hidden"]
        last = hidden if hidden.shape[1] == 1 else hidden[:, n_valid - 1:n_valid]
        out = {"hidden": last}
        self._run(self.plan.head, out, valid[-1:])
        return out["logits"][0, -1]

    def _logits(self, ids: np.ndarray, n_valid: int, role: str) -> np.ndarray:
        """``forward`` of a step whose logits are read."""
        logits = self.forward(ids, n_valid, role)
        assert logits is not None  # head=True
        return logits

    def prefill(self, ids: list[int], mode: str | None = None, media: MediaRows | None = None,
                copy: bool = True) -> np.ndarray:
        """Prompt -> logits of its last token. mode "decode" feeds it through the AR-1 graph,
        "chunked" through the AR-N prefill graphs; None: the engine's ``prefill_mode``.
        media: the soft tokens (and M-RoPE positions) of this prompt's images / audio.
        copy=False: the logits may be the graph's own output buffer, valid until the next step."""
        logits = self._prefill(ids, mode or self.prefill_mode, media)
        return logits.copy() if copy else logits

    def _prefill(self, ids: list[int], mode: str, media: MediaRows | None) -> np.ndarray:
        ids_arr = np.asarray(ids, dtype=np.int64)
        rows = self.inputs
        rows.media, rows.prompt_offset = media, 0
        try:
            if mode == "decode":
                return self._prefill_ar1(ids_arr, 0)
            N = self.prefill_len
            for start in range(0, len(ids_arr), N):
                if self.plan.prefill_in_place and self.pos + N > self.context:
                    # the chunk's pad rows would pass the cache's last row: the rest of the
                    # prompt (< N tokens, at most once a prompt) goes through AR-1 instead
                    return self._prefill_ar1(ids_arr, start)
                chunk = ids_arr[start:start + N]
                n = chunk.shape[0]
                if n < N:
                    chunk = np.concatenate([chunk, np.zeros(N - n, dtype=np.int64)])
                rows.prompt_offset = start
                # only the last chunk's logits are read; an observer (calibration, the oracle)
                # sees every chunk's head as well
                if start + N >= len(ids_arr):
                    return self._logits(chunk, n, "prefill")
                self.forward(chunk, n, "prefill", head=self.observer is not None)
            raise ValueError("an empty prompt has no logits")
        finally:
            if media is not None:
                rows.rope_delta = media.rope_delta
            rows.media = None

    def _prefill_ar1(self, ids: np.ndarray, start: int) -> np.ndarray:
        """ids[start:] one token a step through the AR-1 graphs; -> the last one's logits."""
        for i in range(start, len(ids)):
            self.inputs.prompt_offset = i
            logits = self._logits(ids[i:i + 1], 1, "decode")
        return logits

    def head_logits(self, hidden: np.ndarray) -> np.ndarray:
        """The head graph on one hidden row [1, 1, H] -> logits [V] (a copy): the oracle runs
        every row of a prefill chunk through it (forge/oracle/quality.py)."""
        out: dict[str, np.ndarray] = {"hidden": np.ascontiguousarray(hidden,
                                                                      dtype=self.hidden_dtype)}
        self._run(self.plan.head, out, np.array([self.pos - 1]))
        return out["logits"][0, -1].copy()

    def decode(self, token: int, copy: bool = True) -> np.ndarray:
        """token at self.pos -> the next logits [V] (copy=False: as prefill's)."""
        logits = self._logits(np.array([token], dtype=np.int64), 1, "decode")
        return logits.copy() if copy else logits

    def verify(self, ids: list[int]) -> Verification:
        """ids (1 .. verify_len: the last sampled token, then drafts) at self.pos .. through the
        verify graphs (AR-k, else AR-N prefill), rows padded to the graph's; nothing committed
        until ``Verification.accept``. Its rows must end inside the cache (pos + T <= context):
        an in-place graph writes every row, pad rows included."""
        T, n = self.verify_len, len(ids)
        if not 1 <= n <= T or self.pos + T > self.context:
            raise ValueError(f"a verify step takes 1..{T} ids ending inside the cache; got {n} "
                             f"at {self.pos} of {self.context}")
        self.load_verify_sessions()
        padded = np.zeros(T, dtype=np.int64)
        padded[:n] = ids
        positions = np.arange(self.pos, self.pos + T, dtype=np.int64)
        inputs = self.inputs.step(padded, positions, n, "verify")
        for graph in self.plan.graphs["verify"]:
            self._run(graph, inputs, positions[:n])
        return Verification(self, inputs, positions[:n])

    # ---- media encoders ------------------------------------------------------------------------
    def encode(self, spec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run encoder ``spec``'s graph on preprocessed inputs; -> {bind: array} ("soft", ...)."""
        graph = self.target.graph(spec.name)
        feeds: dict[str, np.ndarray] = {}
        for i in graph.inputs:
            value = inputs[i.bind.removeprefix("media:")]
            if list(value.shape) != i.shape:
                raise RequestError(f"{spec.name} input {i.name}: shape {list(value.shape)} != the "
                                   f"graph's {i.shape}")
            feeds[i.name] = value.astype(NP_DTYPES[i.dtype], copy=False)
        values = self.session(graph).run(None, feeds)
        # copies: an IO-bound session hands out its own buffers, which the next item's run (a
        # second image of the prompt) would overwrite
        return {o.bind: np.array(v) for o, v in zip(graph.outputs, values, strict=True)}

    # ---- the steps of a request ---------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], max_new_tokens: int, past: int = 0) -> None:
        check_request(prompt_ids, max_new_tokens, self.vocab_size, self.context, past)

    def generate_step(self, prompt_ids: list[int], sampler: Sampler, max_new_tokens: int,
                      prefill_mode: str | None = None, fresh: bool = True,
                      media: MediaRows | None = None, drafter: PromptLookup | None = None
                      ) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (token, logits it was sampled from) up to max_new_tokens; stop by breaking out.
        The logits are valid until the next step (the graph writes the next ones into the same
        buffer): copy them to keep them.
        fresh=False continues from the current state (a chat session's next turn): the ids are
        appended at self.pos. Every yielded token but the last is in the state afterwards.
        drafter: speculative decoding with its drafts (runtime/speculative.py), same tokens."""
        self.check_request(prompt_ids, max_new_tokens, 0 if fresh else self.pos)
        if drafter is not None:
            check_speculation(self.manifest)
        if fresh:
            self.reset()
        logits = self.prefill(prompt_ids, prefill_mode, media, copy=False)
        if drafter is not None:
            yield from speculative_steps(self, sampler, logits, max_new_tokens, drafter)
            return
        for i in range(max_new_tokens):
            token = sampler(logits)
            yield token, logits
            if i + 1 < max_new_tokens:
                logits = self.decode(token, copy=False)


class Verification:
    """A verify step's rows, run but not committed: ``logits(i)`` after ids[:i + 1], then
    ``accept(n)`` commits the first n rows (the state advances by n; the other rows are never
    visible: see runtime/speculative.py). Valid until the engine's next step."""

    def __init__(self, engine: Engine, inputs: dict[str, np.ndarray], positions: np.ndarray):
        self.engine, self.inputs, self.positions = engine, inputs, positions
        self.rows: np.ndarray | None = None  # every row's logits, once the verify head ran

    def logits(self, i: int) -> np.ndarray:
        """Row i's logits [V] (the graph's buffer). Without logits in the step the HTP's verify
        head runs once on all rows at the first call; without that head either (verifying
        through prefill graphs) the head runs on that row only: rows after the first miss are
        never paid for."""
        eng, inputs = self.engine, self.inputs
        if eng.plan.head_in_step["verify"]:
            return inputs["logits"][0, i]
        if eng.plan.verify_head is not None:
            if self.rows is None:
                out = {"hidden": inputs["hidden"]}
                eng._run(eng.plan.verify_head, out, self.positions)
                self.rows = out["logits"][0]
            return self.rows[i]
        out = {"hidden": np.ascontiguousarray(inputs["hidden"][:, i:i + 1])}
        eng._run(eng.plan.head, out, self.positions[i:i + 1])
        return out["logits"][0, -1]

    def accept(self, n: int) -> None:
        if n < 1:
            return
        eng, kept = self.engine, self.positions[:n]
        eng.state.commit({name: self.inputs[key]
                          for key, name in eng.plan.writes["verify"].items()}, kept)
        eng.pos += n
