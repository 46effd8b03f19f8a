"""Speculative decoding with prompt lookup on a real model: decode tok/s with and without, per
task, in one run (the two interleaved, their order alternating by round), greedy tokens checked
identical; and the expected ratio on the HTP from the roofline and, given the graphs' Hextimate
estimates (``--hextimate``: docs/speculative.md has SmolLM2's), from those.

    python bench/speculative.py BUNDLE [--rounds 5] [--k 7] [--new 256] [--json out.json]
                                [--hextimate HTP_BUNDLE | us.json]

Tasks: input-grounded ones (repeat a paragraph, lightly edit it, fix a bug in a given function,
answer with quotes from a given text), where the output copies spans of the prompt, and one
open-ended prompt, where drafts rarely hit.

HTP roofline: decode there is bound by reading the weights, and a call of a few rows costs about
one weight read (compute is far from binding at k <= 8). So the expected decode speedup is the
weight reads saved: generated tokens / weight reads, where a plain decode step or an AR-k verify
step is one read. Without verify graphs (a build without --htp-verify) the runtime verifies on
HTP targets through the AR-N prefill graph and runs the head graph once per row it reads: that
path's estimate counts a body read per verify call and a head read per row read
(``htp_prefill_path``). ``--hextimate`` takes the graph times from an HTP bundle built with
``--htp-verify --estimate``: its AR-k verify graphs and the head on k rows, against that path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PARAGRAPH = (
    "The lighthouse at Port Aven was built in 1874 from granite quarried two miles inland. Its "
    "lamp, first fuelled by whale oil and later by kerosene, was electrified in 1931, and the "
    "keeper's cottage was turned into a small museum after the last keeper retired in 1968. "
    "Visitors can climb the 112 steps to the gallery on weekends between April and October."
)

BUGGY = '''def moving_average(values, window):
    """Return the averages of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    for i in range(len(values) - window):
        chunk = values[i:i + window]
        averages.append(sum(chunk) / window)
    return averages'''

STORY = (
    "Mara Quill ran the only bakery in the village of Hollin. Every morning at four she lit the "
    "wood oven her grandfather had built, and by six the smell of rye bread reached the harbour. "
    "\"Bread is patience you can eat,\" she liked to say to the apprentices. When the flood of 1952 "
    "closed the road for three weeks, she baked for the whole valley and refused to take payment. "
    "The village still celebrates Quill Day on the first Sunday of March."
)

TASKS = {
    "repeat": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "edit": "Rewrite the following paragraph, changing only 'Port Aven' to 'Kerlouan' and "
            f"'granite' to 'sandstone'. Keep everything else the same.\n\n{PARAGRAPH}",
    "bugfix": "This function skips the last window. Fix the bug and return the whole corrected "
              f"function in a Python code block.\n\n```python\n{BUGGY}\n```",
    "quotes": f"Text: {STORY}\n\nWhat did Mara do during the flood? Answer by quoting the text.",
    "open": "Write a short story about a robot who learns to paint.",
}
GROUNDED = ["repeat", "edit", "bugfix", "quotes"]


def run(model, prompt: str, new: int, k: int | None):
    return model.chat([{"role": "user", "content": prompt}], max_new_tokens=new, temperature=0.0,
                      prompt_lookup=k)


def htp_estimate(spec: dict, tokens: int, head_share: float) -> dict:
    """Weight reads of the speculative run per generated token after the first, vs plain decode's
    one; an AR-k call = one read. head_share: the head's fraction of a decode step's weights."""
    calls = spec["verify_calls"] + spec["decode_calls"]
    rows = spec["tokens_per_verify"] * spec["verify_calls"]
    prefill_path = (spec["decode_calls"] + spec["verify_calls"] * (1 - head_share)
                    + rows * head_share)
    return {"ar_k": round(tokens / calls, 2) if calls else 1.0,
            "htp_prefill_path": round(tokens / prefill_path, 2) if calls else 1.0}


def hextimate_speedup(spec: dict, tokens: int, us: dict) -> dict:
    """The same run's decode time on the HTP by Hextimate's per-graph estimates (us: "decode",
    "head" — a decode step is both —, "verify" the AR-k decoder graph, "head_k" a head graph of k
    rows, "prefill" the AR-N graph) against plain decode's tokens x step:

        plain     tokens x (decode + head)
        ar_k      decode_calls x (decode + head) + verify_calls x (verify + head_k)
        prefill   decode_calls x (decode + head) + verify_calls x prefill + rows x head

    ar_k: the AR-k verify graphs and the head on k rows (--htp-verify: every row's logits from
    one read of the head's weights); prefill: the path without them (the AR-N graph, the head
    once per row read)."""
    step = us["decode"] + us["head"]
    rows = spec["tokens_per_verify"] * spec["verify_calls"]
    base = spec["decode_calls"] * step
    ar_k = base + spec["verify_calls"] * (us["verify"] + us["head_k"])
    prefill = base + spec["verify_calls"] * us["prefill"] + rows * us["head"]
    return {"ar_k": round(tokens * step / ar_k, 2), "prefill_path": round(tokens * step / prefill, 2)}


def bundle_hextimate(bundle: Path) -> dict:
    """hextimate_speedup's graph times from an HTP bundle built with ``--htp-verify --estimate``
    (its report.json): each role's graphs summed over the shards, of its first HTP target
    that has verify graphs."""
    from hexforge.bundle.manifest import load_manifest
    from hexforge.commands.estimate import stored_estimates

    m = load_manifest(bundle)
    for name, est in stored_estimates(bundle, m).items():
        plan, g = m.targets[name].plan, est.get("graphs", {})
        if plan.verify_head and all(n in g for n in plan.graph_names()):
            def us(names: list[str], g: dict = g) -> float:
                return sum(g[n]["us"] for n in names)
            return {"target": name, "estimator": est["estimator"],
                    "decode": us([s.decode for s in plan.shards]), "head": us([plan.head]),
                    "verify": us([s.verify for s in plan.shards]),  # type: ignore[misc]
                    "head_k": us([plan.verify_head]), "prefill": us([s.prefill for s in plan.shards]),
                    "verify_len": plan.verify_len, "prefill_len": plan.prefill_len}
    raise SystemExit(f"{bundle}: no HTP target with verify graphs and their estimate (build it "
                     "with --htp-verify --estimate)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--k", type=int, default=7, help="draft tokens per verify step")
    ap.add_argument("--new", type=int, default=256, help="max new tokens")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--hextimate", default=None, metavar="BUNDLE|JSON", help="Hextimate us of "
                    "the HTP graphs: an HTP bundle built with --htp-verify --estimate, or a JSON "
                    "{decode, head, verify, head_k, prefill} (docs/speculative.md)")
    a = ap.parse_args()
    us = None
    if a.hextimate:
        src = Path(a.hextimate)
        us = bundle_hextimate(src) if src.is_dir() else json.loads(src.read_text())

    import hexforge
    from hexforge.commands.inspect import decode_bytes_per_token

    model = hexforge.load(a.bundle)
    m, t = model.manifest, model.manifest.targets[model.target]
    head_share = m.vocab_size * m.hidden_size * 4 / decode_bytes_per_token(Path(a.bundle), t)
    model.engine.load_verify_sessions()  # opened now, not in the first timed run
    run(model, "Hi", 4, a.k)  # warm both paths
    out = {"bundle": a.bundle, "date": time.strftime("%Y-%m-%d %H:%M"), "k": a.k,
           "command": " ".join(sys.argv),
           "verify_len": model.engine.verify_len, "rounds": a.rounds,
           "head_share": round(head_share, 3), "hextimate_us": us, "tasks": {}}
    for name in a.tasks.split(","):
        plain_tps, spec_tps, spec = [], [], None
        for r in range(a.rounds):
            for k in ((None, a.k) if r % 2 == 0 else (a.k, None)):
                res = run(model, TASKS[name], a.new, k)
                if k is None:
                    plain_tps.append(res.decode_tok_s)
                    plain = res.token_ids
                else:
                    spec_tps.append(res.decode_tok_s)
                    spec, spec_ids = res.speculation, res.token_ids
        same = plain == spec_ids
        med_p, med_s = statistics.median(plain_tps), statistics.median(spec_tps)
        row = {"tokens": len(plain), "identical": same,
               "acceptance": round(spec["acceptance"], 3),
               "tokens_per_verify": round(spec["tokens_per_verify"], 2),
               "verify_calls": spec["verify_calls"], "decode_calls": spec["decode_calls"],
               "plain_tok_s": round(med_p, 2), "spec_tok_s": round(med_s, 2),
               "ratio": round(med_s / med_p, 3),
               "ratio_range": [round(min(spec_tps) / max(plain_tps), 3),
                               round(max(spec_tps) / min(plain_tps), 3)],
               "htp_estimate": htp_estimate(spec, len(plain) - 1, head_share)}
        if us:
            row["hextimate_speedup"] = hextimate_speedup(spec, len(plain) - 1, us)
        out["tasks"][name] = row
        print(name, json.dumps(row), file=sys.stderr, flush=True)
    out["verify_over_decode_s"] = round(model.engine.step_costs.ratio, 3)
    grounded = [out["tasks"][n]["ratio"] for n in GROUNDED if n in out["tasks"]]
    if grounded:
        out["grounded_median_ratio"] = statistics.median(grounded)
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
