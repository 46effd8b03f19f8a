"""A graph form's speed under Hextimate, without a build: the HTP target's graphs exported as
`hexforge build --target v81` exports them, then each estimated on SA8797 — no phone compile, no
simulator check, no bundle. For trying speed levers quickly (minutes, not a build); a lever's
number for the docs is then the real build's (bench/npu_estimate.py).

    python bench/experiments/npu_levers.py --work W [--model smollm2 | CHECKPOINT] [--quant fp16]
                                           [--context 1024] [--prefill-len 64] [--json FILE]
                                           [--optrace s0.decode] [--option KEY=VALUE ...]

``--optrace GRAPH``: that graph's per-op breakdown as well (bench/npu_estimate.py
``optrace_report``). ``--baseline``: the graphs as hexforge made them before the levers of
docs/notes/htp-speed.md (fp32 KV cache, keys as rows, the compiler's default
finalization), the "before" of each ratio. ``--block-size``: a weight-only recipe's
blocks along K. ``--option``: a QNN EP provider option for the estimates (e.g.
``htp_graph_finalization_optimization_mode=3``), to try the compiler's own levers.

The stages mirror the build's for an fp16-activation recipe: the norms' prescales and the
residual peak (families/blocks.calibrate_norm_scales), the plan, the float export with the fp16
form, the KV cache's fp16 I/O (forge/compile/kvcast.py), the weight-only pass for w8a16 / w4a16.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: npu_estimate's gguf()


def graphs_estimate(model: str, quant: str, context: int, prefill_len: int, work: Path,
                    log=print, optrace: str | None = None, options: dict | None = None,
                    keep: bool = False, baseline: bool = False, kv_values: str = "fp16",
                    block_size: int | None = None) -> dict:
    options = options or {}
    from npu_estimate import MODELS, gguf, optrace_report

    from hexforge.bundle.targets import TARGETS
    from hexforge.families import load_family
    from hexforge.families.blocks import calibrate_norm_scales
    from hexforge.forge.compile.contexts import compile_options
    from hexforge.forge.compile.hextimate import estimate_graph
    from hexforge.forge.compile.kvcast import fp16_kv, u8_value_state, u8_values
    from hexforge.forge.compile.steptime import target_estimate
    from hexforge.forge.context import StageContext
    from hexforge.forge.export.graphs import export_float, plan_target
    from hexforge.forge.pipeline import BuildOptions
    from hexforge.forge.quantize.calibtext import calibration_text
    from hexforge.forge.quantize.recipe import fp16_scale
    from hexforge.forge.quantize.recipes import get_recipe
    from hexforge.forge.quantize.weightonly import weight_only
    from hexforge.forge.source.checkpoint import read_checkpoint
    from hexforge.runtime import qnn
    from hexforge.runtime.text import TextTokenizer

    recipe = get_recipe(quant)
    if block_size:  # a weight-only recipe's blocks along K (its scales: one per block)
        recipe = replace(recipe, block_size=block_size)
    if not recipe.fp16_activations:
        raise SystemExit("fixed-point recipes calibrate first: use a build (bench/npu_estimate.py)")
    # a real model by name, or a checkpoint folder (bench/realsize.py's random-weight ones at
    # the seeds' published shapes: speed does not depend on the weights' values)
    src = gguf(model, work) if model in MODELS else Path(model)
    ckpt = read_checkpoint(src)
    model = model if model in MODELS else src.name
    fam = load_family(ckpt.model_type).FAMILY
    args = fam.Args.from_config(ckpt.config)
    hf = fam.load_hf(ckpt.dir)
    opts = BuildOptions(targets="v81", quant=quant, context=context, prefill_len=prefill_len,
                        verify_len=0, verify=False)
    ids = TextTokenizer(ckpt.dir).encode(calibration_text(None))[:context]
    with fam.float32_forward(hf):
        peak = calibrate_norm_scales(hf, ids, fam.reference_layers(hf))
    target = TARGETS["v81"]
    root = work / f"levers-{model}-{quant}-c{context}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t = time.perf_counter()
    shards = plan_target(fam, hf, target, opts, log)
    ctx = StageContext(fam, hf, args, opts, root, log)
    graphs, plan = export_float(ctx, shards, "g", fp16_residual_scale=fp16_scale(fam, peak, log),
                                keys_transposed=not baseline)  # baseline: keys as rows
    state = fam.state_spec(args, context)
    if kv_values == "u8" and not baseline:  # the build's --kv-values u8
        graphs, state = u8_values(root, graphs), u8_value_state(state)
    if not baseline:
        graphs = fp16_kv(root, graphs, state)
    if recipe.quantized:  # weight-only (fixed point refused above)
        weight_only(plan, root / "g", recipe, args.vocab_size)
    def role_options(role: str) -> dict:
        return {} if baseline else compile_options(role)

    per_graph = {}
    for g in graphs:
        src = root / "g" / f"{g.name}{recipe.compiled_suffix}"
        # the build's compile options for the graph's role, --option over them
        per_graph[g.name] = e = estimate_graph(src, 81, target.estimator, True,
                                               options={**role_options(g.role), **options})
        log(f"  {g.name}: {e.us:,} us, {e.fill_bytes / 1e6:.2f} MB, {e.missing_ops} missing")
        if g.name == optrace:
            print(optrace_report(src, True, f"{model} {quant} c{context} {g.name}", 30,
                                 {**role_options(g.role), **options}))
    est = target_estimate(plan, graphs, per_graph, target.estimator, 81, qnn.sdk_version(),
                          context)
    est["seconds"] = round(time.perf_counter() - t, 1)
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return est


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True)
    p.add_argument("--model", default="smollm2", help="smollm2, gemma3 or a checkpoint folder")
    p.add_argument("--quant", default="fp16")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-len", type=int, default=64)
    p.add_argument("--json", default=None)
    p.add_argument("--optrace", default=None, metavar="GRAPH")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--keep", action="store_true", help="keep the graphs (W/levers-*/g/)")
    p.add_argument("--baseline", action="store_true", help="the graphs before the levers")
    p.add_argument("--kv-values", default="fp16", choices=("fp16", "u8"),
                   help="the value cache's form (build --kv-values)")
    p.add_argument("--block-size", type=int, default=None,
                   help="w8-fp16 / w4-fp16: the weights' block length along K (the recipe's: 32)")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    est = graphs_estimate(a.model, a.quant, a.context, a.prefill_len, work,
                          lambda m: print(m, file=sys.stderr), a.optrace,
                          dict(o.split("=", 1) for o in a.option), a.keep, a.baseline, a.kv_values,
                          a.block_size)
    from hexforge.forge.compile.steptime import estimate_line

    print(estimate_line(est))
    if a.json:
        Path(a.json).write_text(json.dumps(est, indent=1))


if __name__ == "__main__":
    main()
