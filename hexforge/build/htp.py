"""HTP targets: float graphs ─calibrate─▶ QDQ (w8a16 / w4a16) or fp16 ─compile per arch─▶ binaries.

    plan (per target ceiling, recipe bytes/weight)
      └─ float graphs in _work/ (same export modules as cpu)
           └─ calibration: the float graphs run on the CPU EP over CALIB_TEXT (prefill chunks +
              greedy decode steps) with the target's bounded mask; every graph's feeds recorded
                └─ QDQ per graph (quantize.py), arch-independent: made once, shared by v79/v81/..
                     └─ compile per arch -> <target>/<graph>.ctx.onnx + .ctx_qnn.bin

The calibration text is not the oracle's text, so the oracle's numbers are calibration-independent.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..manifest import GraphSpec, Manifest, RunPlan, TargetSpec, confine
from ..runtime import qnn
from ..runtime.backends import Backend
from ..runtime.engine import Engine
from ..runtime.text import TextTokenizer
from ..targets import Target
from .calib import calibration_text
from .compile import compile_graph, compile_shared
from .graphs import export_float, plan_target
from .quantize import QuantRecipe, get_recipe, pooled_hessians, quantize_graph

CALIB_DECODE_STEPS = 64  # decode samples (each holds the whole KV cache: keep it bounded)


def calibrate(root: Path, manifest: Manifest, graphs: list[GraphSpec], plan: RunPlan,
              recipe: QuantRecipe, text: str, hf=None):
    """Run the float graphs on the CPU EP; -> ({graph: [feeds]}, {graph: {output: absmax}})."""
    encoders = [g for g in manifest.targets["cpu"].graphs if g.role in ("vision", "audio")]
    spec = TargetSpec(name="_calib", graphs=graphs + encoders, plan=plan,
                      mask_value=recipe.mask_value)
    m = manifest.model_copy(deep=True)
    m.targets = {"_calib": spec}
    engine = Engine(root, m, "_calib", Backend("cpu"))
    feeds: dict[str, list[dict[str, np.ndarray]]] = {g.name: [] for g in graphs}
    absmax: dict[str, dict[str, float]] = {g.name: {} for g in graphs}

    def record(graph: GraphSpec, f: dict, outputs: dict, _pos) -> None:
        feeds[graph.name].append({k: v.copy() for k, v in f.items()})
        seen = absmax[graph.name]
        for o in graph.outputs:
            seen[o.name] = max(seen.get(o.name, 0.0), float(np.abs(outputs[o.bind]).max()))

    tok = TextTokenizer(confine(root, manifest.tokenizer.dir))
    ids = tok.encode(text)[: manifest.context - 1]
    engine.observer = record
    # prefill graphs: the text in AR-N chunks; decode graphs + head: the text again, one token per
    # step (teacher-forced, so every token of the text is seen — greedy tokens of a model loop)
    engine.reset()
    engine.prefill(ids)
    engine.reset()
    engine.observer = lambda g, *a: record(g, *a) if g.role != "prefill" else None
    engine.prefill(ids[:CALIB_DECODE_STEPS], mode="decode")
    for media_ids, rows in _media_prompts(engine, m, ids, hf) if hf is not None else []:
        # soft tokens (and deepstack rows) have their own ranges: text alone would calibrate
        # the deepstack inputs on zeros and clip them (Qwen3-VL image logits cos 0.93 -> 0.999)
        engine.reset()
        engine.observer = record
        engine.prefill(media_ids, media=rows)
        engine.reset()
        engine.observer = lambda g, *a: record(g, *a) if g.role != "prefill" else None
        engine.prefill(media_ids[:CALIB_DECODE_STEPS], mode="decode", media=rows)
    return feeds, absmax


def _media_prompts(engine: Engine, manifest: Manifest, ids: list[int], hf):
    """One prompt per encoder: its example item (the family's synthetic image / clip) first,
    then calibration text; -> [(expanded ids, MediaRows)]."""
    from ..families.base import encoder_families
    from ..runtime.multimodal import encode_items, splice
    from .encoders import example_feeds

    out = []
    for enc, spec in zip(encoder_families(manifest.hf_config), manifest.encoders, strict=True):
        feeds = example_feeds(enc, spec)
        n = enc.reference(hf, feeds)["soft"].shape[0]  # the item's valid soft tokens
        encoded = {spec.placeholder_id: encode_items(engine, spec, [feeds], [n])}
        text = ids[: max(1, manifest.context - n - 2)]
        out.append(splice(manifest, [spec.placeholder_id, *text], encoded))
    return out


def build_htp_targets(fam, hf, args, targets: list[Target], opts, root: Path, manifest: Manifest,
                      log) -> dict[str, TargetSpec]:
    recipe = get_recipe(opts.quant)
    sdk = qnn.sdk_version()
    prepared: dict[tuple, tuple[list[GraphSpec], RunPlan, Path]] = {}
    specs: dict[str, TargetSpec] = {}
    for target in targets:
        shards = plan_target(fam, hf, target, opts, log)
        key = tuple(shards)
        if key not in prepared:  # float export + calibration + QDQ are arch-independent
            rel = f"_work/{recipe.name}-{len(prepared)}"
            graphs, plan = export_float(fam, hf, args, shards, opts, root, rel, log)
            srcs = root / rel
            if recipe.activations:
                t = time.perf_counter()
                text = calibration_text(opts.calib)
                feeds, absmax = calibrate(root, manifest, graphs, plan, recipe, text, hf)
                hessians = pooled_hessians([(root / g.file, feeds[g.name]) for g in graphs
                                            if g.role != "head"])
                for g in graphs:
                    quantize_graph(root / g.file, srcs / f"{g.name}.qdq.onnx", feeds[g.name],
                                   absmax[g.name], recipe, g.role, hessians)
                log(f"[{target.name}] calibrated + quantized {recipe.name} "
                    f"({time.perf_counter() - t:.1f}s)")
            prepared[key] = (graphs, plan, srcs)
        graphs, plan, srcs = prepared[key]
        soc = target.default_soc
        folder = root / target.name
        folder.mkdir()
        compiled = []
        for g in graphs:
            src = srcs / (f"{g.name}.qdq.onnx" if recipe.activations else f"{g.name}.onnx")
            res = compile_graph(src, folder / f"{g.name}.ctx.onnx", target.htp_arch, soc.soc_model,
                                fp16=recipe.activations is None)
            log(f"[{target.name}] compiled {g.name}: {res['bin_bytes']:,} B ({res['seconds']:.1f}s)")
            compiled.append(g.model_copy(update={
                "file": f"{target.name}/{g.name}.ctx.onnx",
                "bytes": res["bin_bytes"] + res["ctx"].stat().st_size}))
        if opts.share_weights:
            compiled = _share(compiled, plan, srcs, folder, target, soc.soc_model, recipe, log)
        specs[target.name] = TargetSpec(
            name=target.name, htp_arch=target.htp_arch, soc_model=soc.soc_model, qnn_sdk=sdk,
            quant=recipe.name, mask_value=recipe.mask_value, graphs=compiled, plan=plan,
            weight_shared=opts.share_weights)
    return specs


def _share(compiled: list[GraphSpec], plan: RunPlan, srcs: Path, folder: Path, target: Target,
           soc_model: int, recipe: QuantRecipe, log) -> list[GraphSpec]:
    """Recompile each shard's prefill + decode into one weight-shared context for the device.

    The x86 simulator cannot load shared contexts (libQnnHtp segfaults; ORT runs them on ARM only),
    so the unshared twins just compiled from the same sources are what the oracle runs: they are
    kept under ``<target>/verify/`` until the build's oracle is done, then removed."""
    twins = folder / "verify"
    twins.mkdir()
    by_name = {g.name: g for g in compiled}
    out = []
    for g in compiled:  # move the unshared twins aside; the oracle reads them from there
        ctx = folder / f"{g.name}.ctx.onnx"
        for f in (ctx, ctx.with_name(ctx.stem + "_qnn.bin")):
            f.rename(twins / f.name)
    suffix = ".qdq.onnx" if recipe.activations else ".onnx"
    for shard in plan.shards:
        group = [(srcs / f"{n}{suffix}", folder / f"{n}.ctx.onnx") for n in (shard.prefill, shard.decode)]
        res = compile_shared(group, target.htp_arch, soc_model, fp16=recipe.activations is None)
        log(f"[{target.name}] weight-shared {shard.prefill} + {shard.decode}: {res['bin_bytes']:,} B")
    head = by_name[plan.head]
    compile_graph(srcs / f"{head.name}{suffix}", folder / f"{head.name}.ctx.onnx", target.htp_arch,
                  soc_model, fp16=recipe.activations is None)
    for g in compiled:
        ctx = folder / f"{g.name}.ctx.onnx"
        binary = qnn.context_binary_of(ctx)
        out.append(g.model_copy(update={"bytes": ctx.stat().st_size + binary.stat().st_size,
                                        "verify_file": f"{target.name}/verify/{g.name}.ctx.onnx"}))
    return out
