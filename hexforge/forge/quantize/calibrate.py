"""Calibration of the fixed-point recipes (forge/quantize/recipes.FixedPointRecipe): the float
graphs run on the CPU EP over the calibration text (and the towers' media prompts), each call's
feeds streamed into its graph's statistics, then each graph's QDQ twin written beside it.

    float graphs ─calibrate()─▶ ranges, absmax, GPTQ Hessians ─qdq.quantize_graph─▶ X.qdq.onnx
"""

from __future__ import annotations

import gc
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ...bundle.manifest import GraphSpec, Manifest, RunPlan, TargetSpec, confine
from ...runtime.backends import Backend
from ...runtime.engine import Engine
from ...runtime.text import TextTokenizer
from ..heap import release_mapped_pages
from ..oracle.backend import OracleCpuBackend
from ..progress import stage
from .calibstats import GraphStats, HessianStore
from .calibtext import calibration_text
from .qdq import quantize_graph

if TYPE_CHECKING:
    from .recipe import QuantRecipe, ShardJob

CALIB_DECODE_STEPS = 64  # decode samples (teacher-forced text tokens through the AR-1 graph)
KEEP_FEED_BYTES = 1 << 20  # a graph's calls this small are kept from an earlier graph's replay
KEEP_TOTAL_BYTES = 256 << 20


@dataclass
class Calibration:
    """Per graph: ORT's calibration cache (activation ranges), the ``past.*`` inputs' and every
    output's absmax; GPTQ Hessians pooled over the graphs that share a weight (on disk)."""
    ranges: dict[str, Path]
    past_absmax: dict[str, dict[str, float]]
    absmax: dict[str, dict[str, float]]
    hessians: HessianStore


def calibrate(root: Path, manifest: Manifest, graphs: list[GraphSpec], plan: RunPlan,
              recipe: QuantRecipe, text: str, hf=None, work: Path | None = None,
              log=None, encoders: list[GraphSpec] = ()) -> Calibration:
    """Run the float graphs on the CPU EP over the calibration text, streaming each call's feeds
    into its graph's statistics (``GraphStats``) as it happens: nothing stores the feeds, whose
    decode steps each hold the whole KV cache (real-size Qwen3-0.6B: 235 MB a step at context
    1024). The text is replayed once per graph, so only that graph's calibration sessions are
    alive next to the float engine's (real-size graphs hold GBs of fp32 weights each).
    ``encoders``: the towers' float graphs, which make the media prompts' soft tokens."""
    spec = TargetSpec(name="_calib", graphs=graphs + list(encoders), plan=plan,
                      mask_value=recipe.mask_value)
    m = manifest.model_copy(deep=True)
    m.targets = {"_calib": spec}
    backend = calibration_backend()
    engine = Engine(root, m, "_calib", backend)
    maps = getattr(backend, "_maps", None)  # its weight memmaps, shared with GraphStats
    work = work or root / "_work" / "calib"
    tok = TextTokenizer(confine(root, manifest.tokenizer.dir))
    ids = tok.encode(text)[: manifest.context - 1]
    # prefill graphs: the text in AR-N chunks; decode graphs + head: the text again, one token per
    # step (teacher-forced, so every token of the text is seen — greedy tokens of a model loop)
    prompts = [(ids, None)]
    if hf is not None:
        # soft tokens (and deepstack rows) have their own ranges: text alone would calibrate
        # the deepstack inputs on zeros and clip them (Qwen3-VL image logits cos 0.93 -> 0.999)
        prompts += _media_prompts(engine, m, ids, hf)
    out = Calibration({}, {}, {}, HessianStore(work / "hessians"))
    runs = _calibration_runs(graphs, len(prompts), plan.verify_head)
    kept: dict[str, dict[tuple, list]] = {g.name: {} for g in graphs}  # small feeds seen early
    kept_bytes = 0
    with stage("calibrate", len(graphs)) as advance:
        for gi, g in enumerate(graphs):
            t = time.perf_counter()
            stats = GraphStats(root / g.file, work, hessians=recipe.gptq and g.role != "head",
                               maps=maps)
            seen = out.absmax[g.name] = {}
            later = {h.name for h in graphs[gi + 1:]}
            now: list = []  # the (prompt, phase) run in progress, the graphs keeping its calls

            def record(graph: GraphSpec, f: dict, outputs: dict, _pos, g=g, stats=stats, seen=seen,
                       now=now):
                nonlocal kept_bytes
                if graph.name == g.name:
                    stats.add(f)
                    for o in graph.outputs:
                        seen[o.name] = max(seen.get(o.name, 0.0), float(np.abs(outputs[o.bind]).max()))
                    return
                if not now or graph.name not in now[1]:
                    return
                run = now[0]
                # a later graph with small feeds (the head: one hidden row a call) keeps them now, so
                # its own turn needs no replay of the whole model for this run
                calls = kept[graph.name].setdefault(run, [])
                if calls is None:
                    return
                size = sum(v.nbytes for v in f.values())
                if size > KEEP_FEED_BYTES or kept_bytes + size > KEEP_TOTAL_BYTES:
                    kept_bytes -= sum(v.nbytes for c, _ in calls for v in c.values())
                    kept[graph.name][run] = None  # too big: that graph replays this run itself
                    return
                absmax = {o.name: float(np.abs(outputs[o.bind]).max()) for o in graph.outputs}
                calls.append(({k: np.array(v) for k, v in f.items()}, absmax))
                kept_bytes += size

            engine.observer = record
            try:
                for run in runs[g.name]:
                    calls = kept[g.name].pop(run, None)
                    if calls is not None:  # kept from an earlier replay
                        for f, absmax in calls:
                            stats.add(f)
                            kept_bytes -= sum(v.nbytes for v in f.values())
                            for name, v in absmax.items():
                                seen[name] = max(seen.get(name, 0.0), v)
                        continue
                    prompt, rows = prompts[run[0]]
                    # the later graphs this run calls that no earlier replay already kept it for
                    now[:] = [run, {h for h in later if run in runs[h] and run not in kept[h]}]
                    engine.reset()
                    if run[1] == "chunked":
                        engine.prefill(prompt, media=rows)
                    elif run[1] == "decode":
                        engine.prefill(prompt[:CALIB_DECODE_STEPS], mode="decode", media=rows)
                    else:
                        _verify_steps(engine, prompt)
                    now.clear()
                out.ranges[g.name] = stats.save_ranges(work / f"{g.name}.ranges.json")
                out.past_absmax[g.name] = dict(stats.past_absmax)
                out.hessians.add(stats.hessian_groups())
                calls = stats.calls
            finally:
                engine.observer = None
                stats.close()
                # the replay read every weight file (and checkpoint pages, for media prompts)
                release_mapped_pages(root, *([hf.name_or_path] if hf is not None else []))
            if log:
                log(f"  calibrated {g.name}: {calls} calls ({time.perf_counter() - t:.1f}s)")
            advance()
    return out


def _calibration_runs(graphs: list[GraphSpec], prompts: int, verify_head: str | None = None
                      ) -> dict[str, list[tuple[int, str]]]:
    """Graph name -> the (prompt, phase) runs it is called in: chunked -> prefill graphs and the
    head, one token a step -> decode graphs and the head, k tokens a step -> the verify graphs
    and the verify head (the text prompt only: a verify step drafts text)."""
    def phases(g: GraphSpec, i: int) -> tuple[str, ...]:
        if g.role == "verify" or g.name == verify_head:
            return ("verify",) if i == 0 else ()
        return {"prefill": ("chunked",), "decode": ("decode",)}.get(g.role, ("chunked", "decode"))

    return {g.name: [(i, ph) for i in range(prompts) for ph in phases(g, i)] for g in graphs}


def _verify_steps(engine: Engine, ids: list[int]) -> None:
    """Teacher-forced verify steps over the text, every row accepted: an AR-N chunk first (the
    steps read a filled cache), then k tokens a step up to the decode steps' count of rows."""
    T, N = engine.verify_len, engine.prefill_len
    engine.prefill(ids[:N])
    end = min(len(ids), N + CALIB_DECODE_STEPS, engine.context)
    for p in range(N, end - T + 1, T):
        v = engine.verify(ids[p:p + T])
        v.logits(0)  # the verify head, where the target has one
        v.accept(T)


def calibration_backend(prepack: bool = True) -> Backend:
    """The oracle's cpu backend (each weight file mapped once, shared by prefill + decode, no
    prepacked copies where the runtime would not pack them either; prepack=False: none at all)."""
    return OracleCpuBackend(prepack)


def _media_prompts(engine: Engine, manifest: Manifest, ids: list[int], hf):
    """One prompt per encoder: its example item (the family's synthetic image / clip) first,
    then calibration text; -> [(expanded ids, MediaRows)]."""
    from ...families import encoder_families
    from ...runtime.multimodal import encode_items, splice
    from ..export.encoders import example_feeds

    out = []
    for enc, spec in zip(encoder_families(manifest.hf_config), manifest.encoders, strict=True):
        feeds = example_feeds(enc, spec)
        n = enc.reference(hf, feeds)["soft"].shape[0]  # the item's valid soft tokens
        encoded = {spec.placeholder_id: encode_items(engine, spec, [feeds], [n])}
        text = ids[: max(1, manifest.context - n - 2)]
        out.append(splice(manifest, [spec.placeholder_id, *text], encoded))
    return out


def calibrate_and_quantize(job: ShardJob, recipe: QuantRecipe) -> None:
    """The float graphs' activation ranges from the calibration text (and the towers' media
    prompts), then each graph's QDQ twin ``srcs/<name>.qdq.onnx`` beside it."""
    t = time.perf_counter()
    ctx = job.ctx
    root, graphs, srcs, log = ctx.root, job.graphs, job.srcs, ctx.log
    text = calibration_text(ctx.opts.calib)
    with ctx.fam.float32_forward(ctx.hf):  # the towers run on the media prompts
        cal = calibrate(root, job.manifest, graphs, job.plan, recipe, text, ctx.hf,
                        work=srcs / "calib", log=log, encoders=job.encoders)
    gc.collect()  # the float engine's sessions and weight maps, before quantizing
    what = f"quantize {recipe.name}" + (" (GPTQ)" if recipe.gptq else "")
    with stage(what, len(graphs)) as advance:
        for g in graphs:
            tq = time.perf_counter()
            quantize_graph(root / g.file, srcs / f"{g.name}.qdq.onnx",
                           cal.ranges[g.name], cal.past_absmax[g.name],
                           cal.absmax[g.name], recipe, g.role, cal.hessians)
            log(f"  quantized {g.name} ({time.perf_counter() - tq:.1f}s)")
            advance()
    rtn, kept = cal.hessians.gptq_kept
    if rtn + kept:
        log(f"  GPTQ kept for {kept} of {rtn + kept} weights (the others lost to round "
            "to nearest on held-out calibration rows)")
    shutil.rmtree(srcs / "calib", ignore_errors=True)
    log(f"[{job.target.name}] calibrated + quantized {recipe.name} "
        f"({time.perf_counter() - t:.1f}s)")
