"""What a bundle target's steps run, read off its manifest once: the engine's lookup tables.

A step of role R (prefill: AR-N chunks, decode: AR-1, verify: speculative decoding's AR-k) runs
``graphs[R]`` in order, each graph fed by name::

    feeds[graph]   input name ◀─ a key of the step's inputs ("hidden", "mask:<group>", ...)
                              ◀─ or a state buffer ("state:<name>", which lives with the engine)
    outputs[graph] output ─▶ a key of the step's inputs ("hidden", "logits", "new:<state>")
    writes[R]      "new:<state>" ─▶ state <name>, committed once every graph of the step ran

Everything here depends on the manifest alone, so it is made once per engine and never
changes (frozen, its tables read-only): the per-token Python cost shows on small models, and a
reader sees in one place what a step reads and writes. The arrays a step binds (state buffers,
rows kept across decode steps) are the engine's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..bundle.manifest import GraphSpec, Manifest, TargetSpec

ROLES = ("prefill", "decode", "verify")


def step_key(bind: str) -> str:
    """Where an output goes in the step's inputs: "state:<name>" -> "new:<name>", else its bind."""
    return "new:" + bind[6:] if bind.startswith("state:") else bind


@dataclass(frozen=True)
class Feed:
    """One graph input: its name, and where its value comes from (exactly one of the two)."""

    name: str
    key: str | None  # a key of the step's inputs
    state: str | None  # a state buffer's name


def _frozen(d: dict) -> Mapping:
    return MappingProxyType(d)


@dataclass(frozen=True)
class StepPlan:
    graphs: Mapping[str, tuple[GraphSpec, ...]]  # role -> the shards' graphs of that step, in order
    head: GraphSpec
    verify_head: GraphSpec | None  # the head on a verify step's rows (HTP --htp-verify), one call
    verify_len: int  # rows of a verify step: the AR-k graphs', else the AR-N prefill graphs'
    prefill_in_place: bool  # prefill graphs write every row of a chunk into the cache (cpu)
    head_in_step: Mapping[str, bool]  # role -> its last graph outputs the logits (cpu)
    masks: Mapping[str, tuple[str, ...]]  # role -> the slot groups whose mask its graphs read
    feeds: Mapping[str, tuple[Feed, ...]]  # graph name -> its inputs
    outputs: Mapping[str, tuple[str, ...]]  # graph name -> the step key of each output
    writes: Mapping[str, Mapping[str, str]]  # role -> {"new:<state>": state}
    tails: tuple[int, ...]  # k of every "tail:<k>" one-hot a graph reads (conv fifos)
    binds_valid: bool  # some graph reads "valid" [1, T]
    kv_length_groups: tuple[str, ...]  # groups whose cache lengths a graph reads (in-place caches)
    row_binds: Mapping[str, int]  # "deepstack:*" per-token media rows -> their width
    ropes: tuple[str, ...]  # the ropes whose cos / sin rows a graph reads
    row_keys: tuple[str, ...]  # per-step rows a decode step keeps in arrays across steps

    @classmethod
    def of(cls, manifest: Manifest, target: TargetSpec, ropes: Iterable[str]) -> StepPlan:
        """``ropes``: the host's rope tables by name (a step makes rows only of those a graph
        reads: a cpu step under 1-D positions holds its rope inside the graph)."""
        plan = target.plan
        graphs = {"prefill": tuple(target.graph(s.prefill) for s in plan.shards),
                  "decode": tuple(target.graph(s.decode) for s in plan.shards)}
        # a speculative verify step: the AR-k graphs, else the AR-N prefill ones (rows padded)
        graphs["verify"] = (tuple(target.graph(s.verify) for s in plan.shards)  # type: ignore[arg-type]
                            if plan.verify_len else graphs["prefill"])
        binds = {i.bind for g in target.graphs for i in g.inputs}
        used_ropes = tuple(name for name in ropes if f"rope_cos:{name}" in binds)
        return cls(
            graphs=_frozen(graphs),
            head=target.graph(plan.head),
            verify_head=target.graph(plan.verify_head) if plan.verify_head else None,
            verify_len=plan.verify_len or plan.prefill_len,
            # an in-place prefill graph writes all N rows of a chunk, pad rows included (later
            # steps overwrite them before anything reads them): a chunk must end inside the cache
            prefill_in_place=any(i.bind.startswith("kv_seqlens:")
                                 for g in graphs["prefill"] for i in g.inputs),
            head_in_step=_frozen({role: any(o.bind == "logits" for o in gs[-1].outputs)
                                  for role, gs in graphs.items()}),
            # a cpu graph that updates the cache in place reads cache lengths instead of a mask
            masks=_frozen({role: tuple(m.name for m in manifest.mask_groups
                                       if any(i.bind == f"mask:{m.name}" for g in gs
                                              for i in g.inputs))
                           for role, gs in graphs.items()}),
            feeds=_frozen({g.name: tuple(_feed(i.name, i.bind) for i in g.inputs)
                           for g in target.graphs}),
            outputs=_frozen({g.name: tuple(step_key(o.bind) for o in g.outputs)
                             for g in target.graphs}),
            writes=_frozen({role: _frozen({step_key(o.bind): o.bind[6:] for g in gs
                                           for o in g.outputs if o.bind.startswith("state:")})
                            for role, gs in graphs.items()}),
            tails=tuple(sorted(int(b[5:]) for b in binds if b.startswith("tail:"))),
            binds_valid="valid" in binds,
            kv_length_groups=tuple(sorted({b.partition(":")[2] for b in binds
                                           if b.startswith(("kv_seqlens:", "kv_total:"))})),
            row_binds=_frozen({i.bind: i.shape[-1] for g in target.graphs
                               if g.role in ("prefill", "decode") for i in g.inputs
                               if i.bind.startswith("deepstack:")}),
            ropes=used_ropes,
            row_keys=("hidden", *(f"host:{e.name}" for e in manifest.host.extra_embeds),
                      *(f"rope_{f}:{name}" for name in used_ropes for f in ("cos", "sin"))),
        )


def _feed(name: str, bind: str) -> Feed:
    kind, _, arg = bind.partition(":")
    return Feed(name, None, arg) if kind == "state" else Feed(name, bind, None)
