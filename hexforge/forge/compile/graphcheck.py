"""Each compiled graph run once on the HTP against the graph it was compiled from, on the CPU.

A build without the oracle (``--no-verify``: real sizes, where the full-length HF comparison
takes hours on the simulator) still learns whether a graph that compiled computes right:

    float graphs (_work/) ── engine on the CPU EP over the calibration text's first rows
        │                      (prefill graphs: the 2nd AR-N chunk; decode graphs and the head:
        │                       the 9th token, so attention reads a filled cache; verify graphs
        │                       and the verify head: the k tokens after it)
        ├─▶ each graph's last call: its feeds and float outputs
        ├─▶ the graph the HTP compiled (weight-only / QDQ; the float graph itself for fp16),
        │   same feeds, on the CPU EP ─▶ the reference
        └─▶ the compiled graph, same feeds, on the HTP (the simulator on x86) ─▶ per output:
                  relative error ‖htp − ref‖ / ‖ref‖, cosine, max|Δ|, max|ref| (gated), and the
                  same against the float outputs (recorded: quantization and HTP together)

    encoder graphs (vision, audio) ── the family's example item (its synthetic image / clip)
        through the float graph on the CPU and the compiled graph on the HTP, compared the same way

Why the compiled graph's own source is the reference, not the float graph: the check asks
whether the HTP computes what it was given. Against the float graph it also measures the
weights' rounding, and a random-weight network at real depth amplifies that like a chaotic
system (Qwen3.5-4B w4-fp16 s0, 16 layers: relative error 1.09 vs float, where its int8 twin
read 0.08): the bar could not tell rounding from a broken kernel.

What it covers: one call of every graph, with the build's own I/O (fp16 residual scale, weight
formats) and a real KV cache; not a generation, not long positions (rope past the text's rows,
the sliding ring's wrap), not sampling, not an encoder against HF's tower (the float graph is
the reference), not quantization quality (the real models' gates) — the oracle's job where the
size allows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ...bundle.errors import ParityGateError
from ...bundle.manifest import GraphSpec, Manifest, RunPlan, TargetSpec, confine
from ...runtime import qnn
from ...runtime.backends import Backend
from ...runtime.engine import Engine
from ...runtime.state import NP_DTYPES
from ...runtime.text import TextTokenizer
from ..heap import release_heap
from ..oracle.ortrun import run_graph
from ..quantize.recipe import QuantRecipe

DECODE_STEP = 8  # the decode call checked: 8 cached rows before it
# a graph whose output is this far from its source graph's on the CPU computes wrong, whatever
# its recipe: a sign, a scale, an overflow or a broken kernel reads ~1 or more; fp16 activations
# against fp32 read hundredths. Relative error, not cosine alone: a scaled output keeps cosine 1.
MAX_REL_ERR = 0.5


def capture_calls(root: Path, manifest: Manifest, graphs: list[GraphSpec], plan: RunPlan,
                  mask_value: float, text: str, backend: Callable[[], Backend] = lambda: Backend("cpu")
                  ) -> dict[str, tuple[dict, dict]]:
    """Graph name -> (feeds, float outputs) of its last call: the float graphs on the CPU EP,
    prefill over two AR-N chunks of ``text``, decode over its first DECODE_STEP + 1 tokens.

    One pass of those calls per shard, then one for the head, each on a fresh ``backend()``: a
    pass runs its own graphs, replays the outputs the earlier shards' graphs returned in their
    pass, call by call, and stubs the later ones with zeros (state nothing live reads), so one
    shard's float weights are mapped at a time — all of them at once are their sum (~16 GB of
    fp32 at 4B) — and every graph still sees the inputs a whole float chain gives it."""
    spec = TargetSpec(name="_check", graphs=graphs, plan=plan, mask_value=mask_value)
    m = manifest.model_copy(deep=True)
    m.targets = {"_check": spec}
    tok = TextTokenizer(confine(root, manifest.tokenizer.dir))
    ids = tok.encode(text)[: manifest.context - 1]
    calls: dict[str, tuple[dict, dict]] = {}
    returned: dict[str, list[list[np.ndarray]]] = {}  # graph -> what each of its calls returned

    def record(g, feeds, outputs, _positions):
        if g.name in live:
            calls[g.name] = ({k: np.array(v) for k, v in feeds.items()},
                             {o.name: np.array(outputs[o.bind]) for o in g.outputs})

    heads = [plan.head] + ([plan.verify_head] if plan.verify_head else [])
    for live in [set(s.names()) for s in plan.shards] + [set(heads)]:
        engine = Engine(root, m, "_check", _PassBackend(backend(), live, returned))
        engine.observer = record
        engine.prefill(ids[: 2 * plan.prefill_len], mode="chunked")
        engine.reset()
        engine.prefill(ids[: DECODE_STEP + 1], mode="decode")
        if plan.verify_len:  # AR-k verify graphs (--htp-verify): a step on that filled cache
            engine.verify(ids[DECODE_STEP + 1: DECODE_STEP + 1 + plan.verify_len]).logits(0)
        del engine  # its sessions and the backend's weight maps, before the next pass
        release_heap()
    return calls


class _PassBackend:
    """The sessions of one capture pass: ``live`` graphs run on ``real`` and append what each
    call returned to ``returned``; graphs with a record replay it in call order; the others
    return zeros of their outputs' shapes."""

    def __init__(self, real: Backend, live: set[str], returned: dict[str, list]):
        self.real, self.live, self.returned = real, live, returned
        self.name = real.name

    def session(self, bundle: Path, target: TargetSpec, graph: GraphSpec):
        if graph.name in self.live:
            return _Recorder(self.real.session(bundle, target, graph),
                             self.returned.setdefault(graph.name, []))
        if graph.name in self.returned:
            return _Replay(self.returned[graph.name])
        return _Zeros(graph)


class _Recorder:
    def __init__(self, sess, out: list):
        self.sess, self.out = sess, out

    def run(self, names, feeds):
        values = self.sess.run(names, feeds)
        self.out.append([np.array(v) for v in values])  # a bound session reuses its buffers
        return values


class _Replay:
    def __init__(self, returned: list):
        self.calls = iter(returned)

    def run(self, names, feeds):
        return next(self.calls)


class _Zeros:
    def __init__(self, graph: GraphSpec):
        self.values = [np.zeros(o.shape, NP_DTYPES[o.dtype]) for o in graph.outputs]

    def run(self, names, feeds):
        return self.values


def compare(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per float output: relative error, cosine, max|Δ| and max|ref|."""
    out = {}
    for name, r in ref.items():
        if name not in got or r.dtype.kind != "f":
            continue
        a, b = got[name].astype(np.float64).ravel(), r.astype(np.float64).ravel()
        na, nb, diff = np.linalg.norm(a), np.linalg.norm(b), np.linalg.norm(a - b)
        rel = diff / nb if nb else (0.0 if diff < 1e-3 else float("inf"))
        cos = a @ b / (na * nb) if na and nb else float(na == nb)
        out[name] = {"rel_err": float(rel), "cosine": round(float(cos), 6),
                     "max_abs_diff": float(np.abs(a - b).max()), "max_abs": float(np.abs(b).max())}
    return out


def check_target(root: Path, spec: TargetSpec, recipe: QuantRecipe,
                 calls: dict[str, tuple[dict, dict]], log,
                 sources: dict[str, Path] | None = None) -> dict[str, dict]:
    """Every compiled decoder graph of ``spec`` on the HTP with its captured feeds, against
    ``sources[name]`` (the graph it was compiled from) on the CPU, else its float outputs;
    -> graph name -> {outputs: {name: relative error, cosine, max|Δ|, max|ref|}, vs_float,
    seconds, passed}."""
    so = qnn.session_options(qnn.provider_options(spec.htp_arch, spec.soc_model,
                                                  fp16=recipe.fp16_activations), {})
    report = {}
    for g in spec.graphs:
        if g.name not in calls:
            continue  # the encoders: check_encoders
        feeds, floats = calls[g.name]
        src = (sources or {}).get(g.name)
        ref = run_graph(src, feeds) if src is not None else floats
        release_heap()
        report[g.name] = _check(root / g.file, feeds, ref, so, f"[{spec.name}] checked {g.name}",
                                log, floats if src is not None else None)
    return report


def check_encoders(root: Path, target: str, so, float_graphs: list[GraphSpec],
                   compiled: list[GraphSpec], items: list[dict[str, np.ndarray]], log
                   ) -> dict[str, dict]:
    """Each compiled encoder graph with its example item (``items``: preprocessed inputs, as
    ``Engine.encode`` takes them) vs its float graph on the CPU; -> graph name -> report."""
    report = {}
    for f, g, item in zip(float_graphs, compiled, items, strict=True):
        feeds = {i.name: item[i.bind.removeprefix("media:")].astype(NP_DTYPES[i.dtype], copy=False)
                 for i in f.inputs}
        ref = run_graph(root / f.file, feeds)
        report[g.name] = _check(root / g.file, feeds, ref, so, f"[{target}] checked {g.name}", log)
    return report


def _check(path: Path, feeds: dict, ref: dict, so, what: str, log,
           floats: dict | None = None) -> dict:
    t = time.perf_counter()
    got = run_graph(path, feeds, so)
    release_heap()  # the simulator's session, freed into the C heap
    r = {"outputs": compare(got, ref), "seconds": round(time.perf_counter() - t, 1)}
    if floats is not None:
        r["vs_float"] = compare(got, floats)
    sm = summary(r)
    r["passed"] = sm["rel_err"] <= MAX_REL_ERR
    log(f"{what} on the HTP: relative error {sm['rel_err']:.2e}, cosine {sm['cosine']:.6f}, "
        f"max|Δ| {sm['max_abs_diff']:.3g}"
        + (f" (vs the float graph: {sm['rel_err_vs_float']:.2e})" if floats is not None else "")
        + f" ({r['seconds']:.1f}s)")
    return r


def gate(target: str, compiled: list[GraphSpec], report: dict[str, dict]) -> list[GraphSpec]:
    """Fail the build if a checked graph is over the error bar; -> the graphs with their
    ``htp_check`` (the manifest's record of it)."""
    failed = {n: r for n, r in report.items() if not r["passed"]}
    if failed:
        detail = ", ".join(f"{n}: relative error {summary(r)['rel_err']:.3g}"
                           for n, r in failed.items())
        raise ParityGateError(f"[{target}] compiled graphs compute wrong on the HTP against "
                              f"the graphs they were compiled from ({detail}; the bar is "
                              f"{MAX_REL_ERR}); the bundle was not written")
    return [g.model_copy(update={"htp_check": summary(report[g.name])}) if g.name in report
            else g for g in compiled]


def summary(r: dict) -> dict[str, float]:
    """What the manifest keeps of a graph's check: its outputs' worst relative error, cosine
    and max|Δ| against its reference, the worst relative error against the float graph (where
    the reference is a quantized graph), and the simulator's seconds."""
    outs = list(r["outputs"].values())
    out = {"rel_err": max((o["rel_err"] for o in outs), default=float("inf")),
           "cosine": min((o["cosine"] for o in outs), default=0.0),
           "max_abs_diff": max((o["max_abs_diff"] for o in outs), default=0.0),
           "seconds": r["seconds"]}
    if "vs_float" in r:
        out["rel_err_vs_float"] = max((o["rel_err"] for o in r["vs_float"].values()),
                                      default=float("inf"))
    return out
