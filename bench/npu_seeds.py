"""The seeds' three models under Hextimate at their published widths, from two layer cuts.

    python bench/npu_seeds.py --work W [--models qwen3-vl-2b,qwen3.5-4b,gemma-4-e4b]
                              [--quant fp16,w8-fp16,w4-fp16] [--context 1024] [--json FILE]

A full-depth estimate of a 2-4 B model compiles every shard once more for SA8797 (about an hour a
precision on this 2-core machine). A decoder is one unit of layers repeated, and Hextimate costs a
graph op by op, so the decoder graphs of two real-width cuts (the first A and the first B layers:
``bench/realshape.py make_checkpoint(layers=...)``, random weights, which do not change a graph's
time) give the unit's cost, and the full depth N is on their line:

    decoder(N) = decoder(A) + (N - A) * (decoder(B) - decoder(A)) / (B - A)

for the decode graphs, the prefill graphs, their DDR bytes and their ops without a cost alike;
the head does not depend on the depth and is estimated as it is. The cuts are a whole number of
units (Qwen3-VL: 1 layer; Qwen3.5: 3 Gated DeltaNet + 1 full attention; Gemma-4: 5 sliding + 1
full). Gemma-4-E4B's last 18 of 42 layers read another layer's KV (no K / V projection of their
own); the 12-layer cut has 5 such layers, so its second unit holds 5 of them, and the line costs
about 10 of the full depth's 24 own-cache layers as shared ones: an underestimate by at most their
K / V projections (0.7 % of the decoder's weights). The real build splits the full depth into
several shards: each adds a host hand-off a step, counted apart in every hexforge estimate.

Each cut is estimated the way ``bench/experiments/npu_levers.py`` does (the graphs
``hexforge build --target v81`` exports, each estimated on SA8797), cached as
W/est-<model>-L<n>-<quant>-c<context>.json. Labelled "Hextimate, SA8797 (v81), from A- and B-layer
cuts": never a phone's figure. The seeds' tok/s are their own device measurements, as their
documents state them (Qwen3-VL-2B on v79, the others on v81).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "experiments"))

# model -> the realshape shape, its depth, the two cuts and the repeating unit (layers), the seed
# bundle's measured decode tok/s and issue 62's goal for it
SEEDS: dict[str, dict] = {
    "qwen3-vl-2b": dict(shape="qwen3-vl-2b-vl", layers=28, cuts=(2, 4), unit=1, seed_tok_s=9.0,
                        goal_tok_s=25.0),
    "qwen3.5-4b": dict(shape="qwen3.5-4b-vl", layers=32, cuts=(4, 8), unit=4, seed_tok_s=5.5,
                       goal_tok_s=14.0),
    "gemma-4-e4b": dict(shape="gemma-4-e4b", layers=42, cuts=(6, 12), unit=6, seed_tok_s=4.4,
                        goal_tok_s=12.0),
}


def cut_estimate(model: str, layers: int, quant: str, context: int, prefill_len: int,
                 work: Path) -> dict:
    """npu_levers' estimate of the first ``layers`` layers (cached in ``work``)."""
    cache = work / f"est-{model}-L{layers}-{quant}-c{context}.json"
    if cache.is_file():
        est = json.loads(cache.read_text())
        if est["prefill_len"] == prefill_len:
            return est
    from npu_levers import graphs_estimate
    from realshape import make_checkpoint

    ckpt = work / f"{model}-L{layers}"
    if not (ckpt / "config.json").is_file():
        make_checkpoint(SEEDS[model]["shape"], ckpt, layers=layers)
    est = graphs_estimate(str(ckpt), quant, context, prefill_len, work,
                          lambda m: print(m, file=sys.stderr))
    cache.write_text(json.dumps(est, indent=1))
    return est


def decoder_sums(est: dict) -> dict:
    """The decoder's share of a cut's estimate: its decode graphs (every one but the head), its
    prefill graphs; us, DDR bytes, ops without a cost."""
    graphs = est["graphs"]
    head = est["decode_graphs"][-1]
    decode = [graphs[n] for n in est["decode_graphs"][:-1]]
    prefill = [g for n, g in graphs.items() if n.endswith(".prefill")]
    return {"decode_us": sum(g["us"] for g in decode),
            "decode_ddr": sum(g["fill_bytes"] + g["spill_bytes"] for g in decode),
            "decode_missing": sum(g["missing_ops"] for g in decode),
            "prefill_us": sum(g["us"] for g in prefill),
            "head_us": graphs[head]["us"],
            "head_ddr": graphs[head]["fill_bytes"] + graphs[head]["spill_bytes"],
            "head_missing": graphs[head]["missing_ops"]}


def extrapolate(model: str, quant: str, a: dict, b: dict) -> dict:
    """The full depth's row from the cuts' estimates ``a`` (A layers) and ``b`` (B layers)."""
    spec = SEEDS[model]
    n, (la, lb) = spec["layers"], spec["cuts"]
    sa, sb = decoder_sums(a), decoder_sums(b)

    def line(key: str) -> float:
        return sa[key] + (n - la) * (sb[key] - sa[key]) / (lb - la)

    decode, prefill = line("decode_us"), line("prefill_us")
    step = decode + sa["head_us"]
    ddr = line("decode_ddr") + sa["head_ddr"]
    bound = ddr / (a["bound"]["gbps"] * 1e3)
    prefill_len, prompt = a["prefill_len"], a["ttft_prompt_tokens"]
    ttft = -(-prompt // prefill_len) * prefill + sa["head_us"]
    return {"model": model, "quant": quant, "layers": n, "cuts": [la, lb],
            "estimator": f"{a['estimator']}, from {la}- and {lb}-layer cuts",
            "unit_decode_us": round((sb["decode_us"] - sa["decode_us"]) / (lb - la) * spec["unit"], 1),
            "decoder_us": round(decode), "head_us": sa["head_us"], "decode_step_us": round(step),
            "decode_tok_s": round(1e6 / step, 1),
            "decode_missing_ops": round(line("decode_missing") + sa["head_missing"]),
            "ddr_mb_per_step": round(ddr / 1e6, 1), "bound_us": round(bound),
            "bound_fraction": round(bound / step, 3),
            "prefill_len": prefill_len, "prefill_tok_s": round(prefill_len * 1e6 / prefill, 1),
            "ttft_prompt_tokens": prompt, "ttft_ms": round(ttft / 1e3, 1),
            "seed_tok_s": spec["seed_tok_s"], "goal_tok_s": spec["goal_tok_s"],
            "vs_seed": round(1e6 / step / spec["seed_tok_s"], 2)}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | precision | decoder + head us | decode tok/s (seeds' measured) | "
             "estimator's bound (DDR MB a step) | AR-N prefill tok/s | TTFT 512 ms | "
             "ops without a cost |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['quant']} | {r['decoder_us']:,} + {r['head_us']:,} | "
            f"{r['decode_tok_s']} ({r['seed_tok_s']}: {r['vs_seed']}x) | "
            f"{r['bound_us']:,} us ({r['ddr_mb_per_step']:,} MB): {r['bound_fraction']:.0%} | "
            f"AR-{r['prefill_len']} {r['prefill_tok_s']:,} | {r['ttft_ms']:,} | "
            f"{r['decode_missing_ops']:,} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="cut checkpoints and their estimates")
    p.add_argument("--models", default=",".join(SEEDS))
    p.add_argument("--quant", default="fp16,w8-fp16,w4-fp16")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-len", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in a.models.split(","):
        if model not in SEEDS:
            sys.exit(f"unknown model {model!r}; choose from {', '.join(SEEDS)}")
        for quant in a.quant.split(","):
            la, lb = SEEDS[model]["cuts"]
            cuts = [cut_estimate(model, n, quant, a.context, a.prefill_len, work)
                    for n in (la, lb)]
            rows.append(extrapolate(model, quant, *cuts))
            print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
