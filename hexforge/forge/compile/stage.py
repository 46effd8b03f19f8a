"""HTP targets: float graphs ─calibrate─▶ QDQ (w8-u16 / w4-u16), MatMulNBits (w8-fp16 /
w4-fp16) or fp16 ─compile per arch─▶ binaries.

    plan (per target ceiling, recipe bytes/weight)
      └─ float graphs in _work/ (same export modules as cpu)
           └─ calibration: the float graphs run on the CPU EP over CALIB_TEXT (prefill chunks +
              greedy decode steps) with the target's bounded mask; every graph's feeds recorded
                └─ QDQ per graph (qdq.py), arch-independent: made once, shared by v79/v81/..
                     │   (then the float graphs go: fp32, the disk peak of a real-size build;
                     │    --no-verify captured each graph's check call from them first)
                     └─ compile per arch -> <target>/<graph>.ctx.onnx + .ctx_qnn.bin

The calibration text is not the oracle's text, so the oracle's numbers are calibration-independent.
"""

from __future__ import annotations

import gc
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...bundle.manifest import GraphSpec, Manifest, RunPlan, TargetSpec, confine
from ...bundle.targets import Target
from ...runtime import qnn
from ...runtime.backends import Backend
from ...runtime.engine import Engine
from ...runtime.text import TextTokenizer
from ..export.graphs import export_float, plan_target
from ..heap import release_mapped_pages
from ..oracle.backend import OracleCpuBackend
from ..progress import stage
from ..quantize.calibstats import GraphStats, HessianStore
from ..quantize.calibtext import calibration_text
from ..quantize.qdq import quantize_graph
from ..quantize.recipes import COMPILED_SUFFIX, QuantRecipe
from . import contexts as compiler  # through the module: tests swap compiler.compile_graph
from .kvcast import fp16_kv, u8_value_state, u8_values

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
    backend = _calibration_backend()
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


def _calibration_backend(prepack: bool = True) -> Backend:
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


def build_htp_targets(fam, hf, args, targets: list[Target], opts, root: Path, manifest: Manifest,
                      encoders: list[GraphSpec], residual_peak: float, log
                      ) -> tuple[dict[str, TargetSpec], dict[str, dict[str, str]], dict[str, dict]]:
    """-> (target specs, per target: graph name -> the QDQ graph it was compiled from, under
    ``root/_work``: the oracle runs those on the CPU EP when a target fails its gate; per target
    its Hextimate estimate under ``opts.estimate``, else none: report.json's sections).
    ``encoders``: the towers' float graphs (calibration's media prompts run them).
    ``residual_peak``: the calibrated peak |x| of the residual stream; graphs with fp16
    activations carry it scaled into fp16's range where the family can (``fp16_scale``)."""
    recipe = opts.recipe
    scale = fp16_scale(fam, residual_peak, log) if recipe.activations is None else None
    u8_v = opts.kv_values == "u8"  # validate(): only with fp16 activations
    if u8_v:  # the value caches' row scales are state too, carried like the rows
        manifest.state = u8_value_state(manifest.state)
    sdk = qnn.sdk_version()
    prepared: dict[tuple, tuple[list[GraphSpec], RunPlan, Path]] = {}
    specs: dict[str, TargetSpec] = {}
    qdq: dict[str, dict[str, str]] = {}
    estimates: dict[str, dict] = {}
    checked: dict[tuple, dict] = {}  # per float export: the graphs' captured calls
    for target in targets:
        shards = plan_target(fam, hf, target, opts, log)
        key = tuple(shards)
        if key not in prepared:  # float export + calibration + QDQ are arch-independent
            rel = f"_work/{recipe.name}-{len(prepared)}"
            graphs, plan = export_float(fam, hf, args, shards, opts, root, rel, log,
                                        fp16_residual_scale=scale)
            if recipe.activations is None:  # half the cache's DDR bytes a step (kvcast.py)
                if u8_v:  # before fp16_kv: it rewrites float32 I/O only
                    graphs = u8_values(root, graphs)
                graphs = fp16_kv(root, graphs, manifest.state)
            srcs = root / rel
            if not opts.verify:  # each compiled graph's check call, while the float graphs exist
                checked[key] = _capture(root, manifest, graphs, plan, recipe, opts, log)
            if recipe.weight_only:
                t = time.perf_counter()
                weight_only(plan, srcs, recipe, args.vocab_size)
                log(f"[{target.name}] weights {recipe.name}: MatMulNBits int{recipe.weight_bits}, "
                    f"blocks of {recipe.block_size}, fp16 activations "
                    f"({time.perf_counter() - t:.1f}s)")
            if recipe.activations:
                _calibrate_and_quantize(fam, hf, root, manifest, graphs, plan, recipe, opts,
                                        srcs, encoders, target, log)
            if recipe.weight_bits and not opts.keep_work:  # the quantized graphs are compiled:
                _drop_float_graphs(srcs)  # the float ones go before the binaries come (disk peak)
            prepared[key] = (graphs, plan, srcs)
        graphs, plan, srcs = prepared[key]
        suffix = recipe.compiled_suffix
        if recipe.weight_bits:  # the quantized graphs, judged on the CPU EP if the HTP fails
            qdq[target.name] = {g.name: (srcs / f"{g.name}{suffix}").relative_to(root).as_posix()
                                for g in graphs}
        soc = target.default_soc
        folder = root / target.name
        folder.mkdir()
        compiled = []
        with stage(f"compile {target.name}", len(graphs)) as advance:
            for g in graphs:
                res = compiler.compile_graph(srcs / f"{g.name}{suffix}",
                                             folder / f"{g.name}.ctx.onnx", target.htp_arch,
                                             soc.soc_model, fp16=recipe.activations is None,
                                             options=compiler.compile_options(g.role))
                log(f"[{target.name}] compiled {g.name}: {res['bin_bytes']:,} B "
                    f"({res['seconds']:.1f}s)")
                _warn_over_ceiling(g.name, res["bin_bytes"], target, log)
                compiled.append(g.model_copy(update={
                    "file": f"{target.name}/{g.name}.ctx.onnx",
                    "bytes": res["bin_bytes"] + res["ctx"].stat().st_size}))
                advance()
        if not opts.verify:  # no oracle (real sizes): each graph once on the HTP vs its float
            compiled = _check_compiled(root, manifest, graphs, plan, srcs, compiled, target, soc,
                                       sdk, recipe, checked[key], log)
        if opts.share_weights:
            compiled = _share(compiled, plan, srcs, folder, target, soc.soc_model, recipe, log)
        specs[target.name] = TargetSpec(
            name=target.name, htp_arch=target.htp_arch, soc_model=soc.soc_model, qnn_sdk=sdk,
            quant=recipe.name, mask_value=recipe.mask_value, graphs=compiled, plan=plan,
            weight_shared=opts.share_weights, hidden_scale=1.0 / (scale or 1.0))
        if opts.estimate:  # while the compiles' sources exist: the binaries cannot be estimated
            estimates[target.name] = _estimate(specs[target.name], srcs, recipe, manifest, log)
    if not opts.keep_work:
        _drop_float_graphs(root / "_work")  # fp16's, the compiles' sources, are done with now
    return specs, qdq, estimates


def _calibrate_and_quantize(fam, hf, root: Path, manifest: Manifest, graphs: list[GraphSpec],
                            plan: RunPlan, recipe: QuantRecipe, opts, srcs: Path,
                            encoders: list[GraphSpec], target: Target, log) -> None:
    """The float graphs' activation ranges from the calibration text (and the towers' media
    prompts), then each graph's QDQ twin ``srcs/<name>.qdq.onnx`` beside it."""
    t = time.perf_counter()
    text = calibration_text(opts.calib)
    with fam.float32_forward(hf):  # the towers run on the media prompts
        cal = calibrate(root, manifest, graphs, plan, recipe, text, hf,
                        work=srcs / "calib", log=log, encoders=encoders)
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
    log(f"[{target.name}] calibrated + quantized {recipe.name} "
        f"({time.perf_counter() - t:.1f}s)")


def _estimate(spec: TargetSpec, srcs: Path, recipe: QuantRecipe, manifest: Manifest, log) -> dict:
    """Each graph of one target compiled once more, for its arch's estimator SoC (the binary
    is not kept): hexforge/forge/compile/steptime.py."""
    from .steptime import estimate_line, estimate_target

    t = time.perf_counter()
    sources = {g.name: srcs / f"{g.name}{recipe.compiled_suffix}"
               for g in spec.graphs if g.role not in ("vision", "audio")}
    with stage(f"estimate {spec.name}", len(sources)) as advance:
        est = estimate_target(spec, sources, recipe.activations is None, manifest.context,
                              spec.qnn_sdk, log, advance)
    log(f"[{spec.name}] {estimate_line(est)} ({time.perf_counter() - t:.1f}s)")
    return est


def _drop_float_graphs(folder: Path) -> None:
    """Remove the float graphs (and their weights) under ``folder``; the quantized graphs stay
    for the oracle, which judges a target that fails its gate by them on the CPU."""
    keep = (".qdq.onnx", ".wo.onnx", ".wo.weights")
    for f in folder.rglob("*"):
        if f.is_file() and not f.name.endswith(keep):
            f.unlink()


def _capture(root: Path, manifest: Manifest, graphs: list[GraphSpec], plan: RunPlan,
             recipe: QuantRecipe, opts, log) -> dict[str, tuple[dict, dict]]:
    """The float graphs' check calls (graphcheck.capture_calls), once per float export: every
    target compiled from it is checked with them, after the float graphs are gone."""
    from . import graphcheck

    t = time.perf_counter()
    calls = graphcheck.capture_calls(root, manifest, graphs, plan, recipe.mask_value,
                                     calibration_text(opts.calib),
                                     lambda: _calibration_backend(prepack=False))
    log(f"  captured each float graph's check call on the CPU ({time.perf_counter() - t:.1f}s)")
    release_mapped_pages(root)
    return calls


def _check_compiled(root: Path, manifest: Manifest, graphs: list[GraphSpec], plan: RunPlan,
                    srcs: Path, compiled: list[GraphSpec], target: Target, soc, sdk: str,
                    recipe: QuantRecipe, calls: dict, log) -> list[GraphSpec]:
    """forge/compile/graphcheck.py on one target's compiled graphs (``calls``: the float graphs'
    captured calls, ``_capture``), each against the quantized graph in ``srcs`` it was compiled
    from (run on the CPU; fp16: the float graph's own outputs); -> the graphs with their
    ``htp_check``. A graph over the error bar fails the build."""
    from . import graphcheck

    spec = TargetSpec(name=target.name, htp_arch=target.htp_arch, soc_model=soc.soc_model,
                      qnn_sdk=sdk, quant=recipe.name, mask_value=recipe.mask_value,
                      graphs=compiled, plan=plan)
    suffix = recipe.compiled_suffix
    sources = {g.name: srcs / f"{g.name}{suffix}" for g in graphs} if recipe.weight_bits else None
    return graphcheck.gate(target.name, compiled,
                           graphcheck.check_target(root, spec, recipe, calls, log, sources))


def _warn_over_ceiling(name: str, bin_bytes: int, target: Target, log) -> None:
    """A context binary over the target's ceiling (the planner leaves room for the binary's
    overhead, ``graphs.CONTEXT_OVERHEAD``; --max-shard-bytes or an unusual graph can pass it)."""
    if bin_bytes > target.max_context_bytes:
        log(f"  warning: {name}'s context binary is {bin_bytes:,} B, over {target.name}'s "
            f"{target.max_context_bytes:,} B per context: a device may refuse to load it (QNN "
            "0x3ea); a smaller --max-shard-bytes splits it")


def weight_only(plan: RunPlan, folder: Path, recipe: QuantRecipe, vocab_size: int) -> None:
    """Every float graph ``X.onnx`` in ``folder`` -> ``X.wo.onnx``: each weight MatMul as
    MatMulNBits (int8 / int4 blocks, the head int8 under int4: ``nbits.cpu_head_format``),
    each weight group's into one ``<group>.wo.weights`` file (the caller drops the float graphs
    unless --keep-work keeps them for the probe). The QNN EP runs MatMulNBits on the HTP with
    fp16 activations; its activation input must be rank 3, as every projection's [1, T, K] is."""
    import onnx

    from ..export.graphs import weight_groups, weights_file
    from ..export.onnxexport import share_weights
    from ..quantize.nbits import quantize_cpu_graph

    groups = weight_groups(plan, cpu=False)
    with stage(f"quantize {recipe.name} weights", sum(map(len, groups))) as advance:
        for group in groups:
            for name in group:
                dst = folder / f"{name}{COMPILED_SUFFIX['weight-only']}"
                onnx.save(onnx.load(str(folder / f"{name}.onnx"), load_external_data=False),
                          str(dst))
                quantize_cpu_graph(dst, recipe.weight_bits, recipe.block_size, vocab_size,
                                   whole_blocks=True)
                advance()
            share_weights([folder / f"{n}{COMPILED_SUFFIX['weight-only']}" for n in group],
                          weights_file(group).replace(".weights", ".wo.weights"), None)



def fp16_scale(fam, residual_peak: float, log) -> float:
    """The residual scale s of fp16 graphs (``blocks.residual_scale``), 1 where the family cannot
    carry its residual scaled (``residual_scaling``) or the stream fits fp16 as it is."""
    from ...families.blocks import residual_scale

    s = residual_scale(residual_peak)
    if s != 1.0 and not getattr(fam, "residual_scaling", False):
        log(f"  warning: the residual stream peaks at {residual_peak:.4g}, near fp16's 65504, and "
            "this family cannot carry it scaled: fp16 graphs may overflow")
        return 1.0
    if s != 1.0:
        log(f"  fp16 graphs carry the residual stream at 1/{s:g} (its peak |x| {residual_peak:.4g})")
    return s


def _share(compiled: list[GraphSpec], plan: RunPlan, srcs: Path, folder: Path, target: Target,
           soc_model: int, recipe: QuantRecipe, log) -> list[GraphSpec]:
    """Recompile each shard's prefill + decode into one weight-shared context for the device.

    The x86 simulator cannot load shared contexts (libQnnHtp segfaults; ORT runs them on ARM only),
    so the unshared twins just compiled from the same sources are what the oracle runs: they are
    kept under ``<target>/verify/`` until the build's oracle is done, then removed."""
    twins = folder / "verify"
    twins.mkdir()
    shared = {n for shard in plan.shards for n in (shard.prefill, shard.decode)}
    for name in shared:  # move the unshared twins aside; the oracle reads them from there
        ctx = folder / f"{name}.ctx.onnx"
        for f in (ctx, ctx.with_name(ctx.stem + "_qnn.bin")):
            f.rename(twins / f.name)
    suffix = recipe.compiled_suffix
    for shard in plan.shards:
        group = [(srcs / f"{n}{suffix}", folder / f"{n}.ctx.onnx") for n in (shard.prefill, shard.decode)]
        res = compiler.compile_shared(group, target.htp_arch, soc_model,
                                      fp16=recipe.activations is None,
                                      options=compiler.compile_options("decode"))
        log(f"[{target.name}] weight-shared {shard.prefill} + {shard.decode}: {res['bin_bytes']:,} B")
        _warn_over_ceiling(shard.prefill, res["bin_bytes"], target, log)
    out = []
    for g in compiled:  # the head shares nothing: its context is its own twin
        ctx = folder / f"{g.name}.ctx.onnx"
        binary = qnn.context_binary_of(ctx)
        twin = f"{target.name}/verify/{g.name}.ctx.onnx" if g.name in shared else g.file
        out.append(g.model_copy(update={"bytes": ctx.stat().st_size + binary.stat().st_size,
                                        "verify_file": twin}))
    return out
