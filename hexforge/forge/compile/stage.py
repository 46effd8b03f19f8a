"""HTP targets: float graphs ─the recipe's prepare─▶ the graphs the HTP compiles ─compile per
arch─▶ binaries. The recipe's kind (forge/quantize/recipes.py) decides what a shard's graphs
become: fp16 as they are, MatMulNBits twins (weight-only: quantize/weightonly.py), or QDQ twins
calibrated on the CPU (fixed point: quantize/calibrate.py).

    plan (per target ceiling, recipe bytes/weight)
      └─ float graphs in _work/ (same export modules as cpu)
           └─ recipe.prepare: arch-independent, made once, shared by v79/v81/..
                │   (then the float graphs go: fp32, the disk peak of a real-size build;
                │    --no-verify captured each graph's check call from them first)
                └─ compile per arch -> <target>/<graph>.ctx.onnx + .ctx_qnn.bin

The calibration text is not the oracle's text, so the oracle's numbers are calibration-independent.
"""

from __future__ import annotations

import time
from pathlib import Path

from ...bundle.manifest import GraphSpec, Manifest, RunPlan, TargetSpec
from ...bundle.targets import Target
from ...runtime import qnn
from ..context import StageContext
from ..export.graphs import export_float, plan_target
from ..heap import release_mapped_pages
from ..progress import stage
from ..quantize.calibrate import calibration_backend
from ..quantize.calibtext import calibration_text
from ..quantize.recipe import QuantRecipe, ShardJob
from . import contexts as compiler  # through the module: tests swap compiler.compile_graph
from .kvcast import fp16_kv, u8_value_state, u8_values


def build_htp_targets(ctx: StageContext, targets: list[Target], manifest: Manifest,
                      encoders: list[GraphSpec], residual_peak: float
                      ) -> tuple[dict[str, TargetSpec], dict[str, dict[str, str]], dict[str, dict]]:
    """-> (target specs, per target: graph name -> the QDQ graph it was compiled from, under
    ``root/_work``: the oracle runs those on the CPU EP when a target fails its gate; per target
    its Hextimate estimate under ``opts.estimate``, else none: report.json's sections).
    ``encoders``: the towers' float graphs (calibration's media prompts run them).
    ``residual_peak``: the calibrated peak |x| of the residual stream; graphs with fp16
    activations carry it scaled into fp16's range where the family can (``fp16_scale``)."""
    fam, hf, opts, root, log = ctx.fam, ctx.hf, ctx.opts, ctx.root, ctx.log
    recipe = opts.recipe
    scale = recipe.residual_scale(fam, residual_peak, log)
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
            graphs, plan = export_float(ctx, shards, rel, fp16_residual_scale=scale)
            if recipe.fp16_activations:  # half the cache's DDR bytes a step (kvcast.py)
                if u8_v:  # before fp16_kv: it rewrites float32 I/O only
                    graphs = u8_values(root, graphs)
                graphs = fp16_kv(root, graphs, manifest.state)
            srcs = root / rel
            if not opts.verify:  # each compiled graph's check call, while the float graphs exist
                checked[key] = _capture(root, manifest, graphs, plan, recipe, opts, log)
            recipe.prepare(ShardJob(ctx, manifest, graphs, plan, srcs, encoders, target))
            if recipe.quantized and not opts.keep_work:  # the quantized graphs are compiled:
                _drop_float_graphs(srcs)  # the float ones go before the binaries come (disk peak)
            prepared[key] = (graphs, plan, srcs)
        graphs, plan, srcs = prepared[key]
        suffix = recipe.compiled_suffix
        if recipe.quantized:  # the quantized graphs, judged on the CPU EP if the HTP fails
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
                                             soc.soc_model, fp16=recipe.fp16_activations,
                                             options=compiler.compile_options(g.role))
                log(f"[{target.name}] compiled {g.name}: {res['bin_bytes']:,} B "
                    f"({res['seconds']:.1f}s)")
                _warn_over_ceiling(g.name, res["bin_bytes"], target, log)
                compiled.append(g.model_copy(update={
                    "file": f"{target.name}/{g.name}.ctx.onnx",
                    "bytes": res["bin_bytes"] + res["ctx"].stat().st_size}))
                advance()
        spec = TargetSpec(
            name=target.name, htp_arch=target.htp_arch, soc_model=soc.soc_model, qnn_sdk=sdk,
            quant=recipe.name, mask_value=recipe.mask_value, graphs=compiled, plan=plan,
            weight_shared=opts.share_weights, hidden_scale=1.0 / (scale or 1.0))
        # before the checks, so a recipe the HTP computes wrong still shows its speed in the
        # log; while the compiles' sources exist (the binaries cannot be estimated)
        if opts.estimate:
            estimates[target.name] = _estimate(spec, srcs, recipe, manifest, log)
        if not opts.verify:  # no oracle (real sizes): each graph once on the HTP vs its float
            compiled = _check_compiled(ctx, manifest, prepared[key], compiled, target, sdk,
                                       checked[key])
        if opts.share_weights:
            compiled = _share(ctx, compiled, plan, srcs, target)
        specs[target.name] = spec.model_copy(update={"graphs": compiled})
    if not opts.keep_work:
        _drop_float_graphs(root / "_work")  # fp16's, the compiles' sources, are done with now
    return specs, qdq, estimates


def _estimate(spec: TargetSpec, srcs: Path, recipe: QuantRecipe, manifest: Manifest, log) -> dict:
    """Each graph of one target compiled once more, for its arch's estimator SoC (the binary
    is not kept): hexforge/forge/compile/steptime.py."""
    from .steptime import estimate_line, estimate_target

    t = time.perf_counter()
    sources = {g.name: srcs / f"{g.name}{recipe.compiled_suffix}"
               for g in spec.graphs if g.role not in ("vision", "audio")}
    with stage(f"estimate {spec.name}", len(sources)) as advance:
        est = estimate_target(spec, sources, recipe.fp16_activations, manifest.context,
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
                                     lambda: calibration_backend(prepack=False))
    log(f"  captured each float graph's check call on the CPU ({time.perf_counter() - t:.1f}s)")
    release_mapped_pages(root)
    return calls


def _check_compiled(ctx: StageContext, manifest: Manifest,
                    prepared: tuple[list[GraphSpec], RunPlan, Path], compiled: list[GraphSpec],
                    target: Target, sdk: str, calls: dict) -> list[GraphSpec]:
    """forge/compile/graphcheck.py on one target's compiled graphs (``calls``: the float graphs'
    captured calls, ``_capture``), each against the quantized graph in ``srcs`` it was compiled
    from (run on the CPU; fp16: the float graph's own outputs); -> the graphs with their
    ``htp_check``. A graph over the error bar fails the build. ``prepared``: (float graphs, their
    plan, the folder of the graphs the compiles read)."""
    from . import graphcheck

    graphs, plan, srcs = prepared
    recipe, soc = ctx.opts.recipe, target.default_soc

    spec = TargetSpec(name=target.name, htp_arch=target.htp_arch, soc_model=soc.soc_model,
                      qnn_sdk=sdk, quant=recipe.name, mask_value=recipe.mask_value,
                      graphs=compiled, plan=plan)
    suffix = recipe.compiled_suffix
    sources = {g.name: srcs / f"{g.name}{suffix}" for g in graphs} if recipe.quantized else None
    return graphcheck.gate(target.name, compiled,
                           graphcheck.check_target(ctx.root, spec, recipe, calls, ctx.log, sources))


def _warn_over_ceiling(name: str, bin_bytes: int, target: Target, log) -> None:
    """A context binary over the target's ceiling (the planner leaves room for the binary's
    overhead, ``graphs.CONTEXT_OVERHEAD``; --max-shard-bytes or an unusual graph can pass it)."""
    if bin_bytes > target.max_context_bytes:
        log(f"  warning: {name}'s context binary is {bin_bytes:,} B, over {target.name}'s "
            f"{target.max_context_bytes:,} B per context: a device may refuse to load it (QNN "
            "0x3ea); a smaller --max-shard-bytes splits it")


def _share(ctx: StageContext, compiled: list[GraphSpec], plan: RunPlan, srcs: Path,
           target: Target) -> list[GraphSpec]:
    """Recompile each shard's prefill + decode into one weight-shared context for the device.

    The x86 simulator cannot load shared contexts (libQnnHtp segfaults; ORT runs them on ARM only),
    so the unshared twins just compiled from the same sources are what the oracle runs: they are
    kept under ``<target>/verify/`` until the build's oracle is done, then removed."""
    folder, recipe, log = ctx.root / target.name, ctx.opts.recipe, ctx.log
    soc_model = target.default_soc.soc_model
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
                                      fp16=recipe.fp16_activations,
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
