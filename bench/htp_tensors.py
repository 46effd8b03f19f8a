"""Which op of an HTP target loses the accuracy? Per-tensor relative error vs the float graph, of
the QDQ graph on the CPU EP (the quantization alone) and compiled for the HTP (simulator on x86),
for one graph call on the oracle prompt (hexforge/forge/compile/probe.py).

    hexforge build CKPT -o B --target v81 --quant w8a16 --keep-work [--no-verify]
    python bench/htp_tensors.py B [--target v81] [--graph s0.decode] [--step 8] [--worst 20]

Prints the rows in graph order (or the ``--worst`` N by HTP / CPU ratio), then the graph outputs;
``--json F`` writes them all.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--target", default="v81")
    ap.add_argument("--graph", default=None, help="default: the first decode graph")
    ap.add_argument("--step", type=int, default=8, help="which call of the graph (0-based)")
    ap.add_argument("--worst", type=int, default=0, help="only the N highest HTP / CPU ratios")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from hexforge.forge.compile.probe import tensor_errors

    rows = tensor_errors(a.bundle, a.target, a.graph, a.step)
    ops = [r for r in rows if r.op != "output"]
    outs = [r for r in rows if r.op == "output"]
    if a.worst:
        ops = sorted(ops, key=lambda r: -r.ratio)[:a.worst]
    print(f"{'op':<10} {'tensor':<56} {'qdq-cpu':>9} {'htp':>9} {'htp/cpu':>8}")
    for r in ops + outs:
        print(f"{r.op:<10} {r.tensor[-56:]:<56} {r.cpu:9.5f} {r.htp:9.5f} {r.ratio:8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
