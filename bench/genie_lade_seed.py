"""A seed model's phone decode with Genie's lookahead dialog, by Hextimate, SA8797 (v81): the
Genie graphs of a real-width cut in the lade form and in the default (concat) form, taken to the
model's depth, and the tokens a lade step accepts as bench/genie_lade.py measured them on a
real model (random weights accept nothing worth measuring).

    python bench/realsize.py qwen3-vl-2b-as-qwen3 W/lade --quant w4-fp16 --device-only --genie \
        --genie-kv lade --context 1024 --prefill-len 16 --layers 2 --keep-work
    (the same with --genie-kv concat into W/concat)
    python bench/genie_lade_seed.py W/lade/<cut> W/concat/<cut> --layers 28 \
        --tokens-per-call lade_smollm2.json

A cut of k layers holds the token gather, k layers and the head; the model's other L - k layers
cost what the target's own decoder graphs of the cut say a layer costs (``_work/<recipe>-0/
s0.decode`` / ``s0.prefill``: k layers, no gather, no head), at AR-1 and AR-N. So the step of
AR-n = cut's Genie graphs + (L - k) / k x the target's k-layer graph: an extrapolation, said as
such. lade's decode = tokens per call / its AR-N step; basic's = 1 / the concat form's AR-1
step (what a default Genie bundle runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def target_layers_us(bundle: Path, arch: int = 81) -> dict[int, int]:
    """AR -> Hextimate us of the target's decoder graph(s) of the cut (its layers alone)."""
    from genie_lade import compiled

    from hexforge.bundle.targets import get_target
    from hexforge.forge.compile.hextimate import estimate_graph

    manifest = json.loads((bundle / "manifest.json").read_text())
    soc = get_target(f"v{arch}").estimator
    plan = manifest["targets"][f"v{arch}"]["plan"]
    out = {}
    for kind, ar in (("decode", 1), ("prefill", plan["prefill_len"])):
        graphs = compiled(sorted((bundle / "_work").glob(f"*-0/s*.{kind}*.onnx")))
        if not graphs:
            raise SystemExit(f"{bundle}: no target {kind} graphs in _work/ (--keep-work)")
        out[ar] = sum(estimate_graph(g, arch, soc, fp16=True).us for g in graphs)
    return out


def main() -> int:
    from genie_lade import genie_step_us

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lade_cut")
    ap.add_argument("concat_cut")
    ap.add_argument("--layers", type=int, required=True, help="the whole model's decoder layers")
    ap.add_argument("--tokens-per-call", required=True, metavar="JSON",
                    help="bench/genie_lade.py --json of a real model")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    lade_cut, concat_cut = Path(a.lade_cut), Path(a.concat_cut)
    k = json.loads((lade_cut / "manifest.json").read_text())["num_layers"]
    per = target_layers_us(lade_cut)
    scale = (a.layers - k) / k

    def whole(cut: Path) -> dict[int, float]:
        return {ar: v["us"] + scale * per[ar] for ar, v in genie_step_us(cut).items()}
    lade, concat = whole(lade_cut), whole(concat_cut)
    ar = max(lade)
    measured = json.loads(Path(a.tokens_per_call).read_text())
    rows = {}
    for task, r in measured["tasks"].items():
        tpc = r["tokens_per_call"]
        rows[task] = {"tokens_per_call": tpc, "basic_tok_s": round(1e6 / concat[1], 1),
                      "lade_tok_s": round(tpc * 1e6 / lade[ar], 1)}
    out = {"cut_layers": k, "layers": a.layers, "target_layers_us": per,
           "step_us": {"lade": {n: round(v) for n, v in lade.items()},
                       "concat": {n: round(v) for n, v in concat.items()}},
           "tokens_per_call_from": measured["bundle"], "tasks": rows}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
