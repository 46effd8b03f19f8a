"""Genie's lookahead dialog (``lade``) on a ``--genie-kv lade`` bundle, checked call by call from
libGenie's own tensor dump: the context each lade call ran on is the prompt + qnn-sim's greedy
tokens (= basic's).

    python bench/genie_lade_guard.py WORK [--lade 3,3,3] [--ids 5,6,7,8,9,332,12] [--splits 2]
                                         [--family llama|gemma3]

The bundle is a tiny model's (seed 0) in the lade form (families/genielade.py): the scatter form
plus a meta layer in which the graph keeps each row's step, so that it masks the step lade's
warm-up leaves whole in the context and computes its own rope positions. The context a call ran
on is read off the dump (``graph_contexts``): Genie's mask less the slots the graph's metadata
marks as the warm-up's. A difference at a top-2 tie of qnn-sim's fp16 logits is not counted
(``runtime.compare``'s rule). The tiny model's tokenizer gives Genie's text callback no text, so
the ids are read this way; a real model's answers are compared as text by bench/genie_lade.py.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np

# per-split weight ceiling that cuts the tiny llama (6 layers, ~90 kB each) into splits
SPLIT_BYTES = {1: None, 2: 300_000, 3: 200_000}


def build(work: Path, splits: int = 2, family: str = "llama") -> Path:
    """The tiny ``family`` model (seed 0; forge/source/tiny.py) built with --genie-kv lade in
    ``splits`` Genie splits, judged by the oracle (its Genie graphs too) -> bundle."""
    from hexforge.forge.pipeline import BuildOptions
    from hexforge.forge.pipeline import build as build_bundle
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    ckpt = work / f"ckpt-{family}"
    if not (ckpt / "config.json").exists():
        make_tiny_checkpoint(family, ckpt)
    out = work / "lade"
    shutil.rmtree(out, ignore_errors=True)
    build_bundle(ckpt, out, BuildOptions(targets="v81", quant="fp16", context=128,
                                         prefill_len=16, genie=True, genie_kv="lade",
                                         verify_tokens=16, max_shard_bytes=SPLIT_BYTES[splits]),
                 log=lambda m: None)
    return out


def graph_contexts(dump: Path, layer: int) -> list[list[int]]:
    """Per call, the ids of the slots the graph kept for row 0 (Genie's mask less the garbage
    its metadata marks), row 0's own id last."""
    sys.path.insert(0, str(Path(__file__).parent / "experiments"))
    from genie_lade_scatter import steps

    calls = steps(dump)
    files: dict[int, Path] = {}
    for g in dump.rglob("*"):
        if g.is_dir() and re.search(r"_1_of_\d+$", g.name):
            for f in g.iterdir():
                files.setdefault(int(f.name[:3]), g)
    slot: dict[int, int] = {}
    out = []
    for k, c in enumerate(calls):
        CL = c["mask"].shape[1]
        meta = np.fromfile(files[k] / f"{k:03d}_in_past_value_{layer}_in", np.float32)
        start, count, chain, written, warm_lo, warm_hi = meta.reshape(CL, -1)[:, :6].T
        # the graph's rule (families/genielade.py), in numpy
        A = (c["mask"][0] > -1) & (written > 0.5)
        A[c["index"][0]] = False
        last = start[A].max(initial=0.0)
        of_last = A & (np.abs(start - last) < 0.5)
        found = (last > 0.5 and abs(of_last.sum() - count[of_last].max(initial=0)) < 0.5
                 and chain[of_last].max(initial=0) < 0.5 and count[of_last].max(initial=0) > 1.5)
        carried_lo = warm_lo[A].max(initial=0.0)
        hi = last if found else warm_hi[A].max(initial=0.0)
        lo = last if found and carried_lo < 0.5 else carried_lo
        garbage = A & (hi > 0.5) & (start > lo - 0.5) & (start < hi + 0.5)
        A, garbage = A.astype(np.float64), garbage.astype(np.float64)
        out.append([slot[s] for s in np.where(A - garbage > 0.5)[0]] + [c["ids"][0]])
        for r in range(c["AR"]):
            if (c["mask"][r] > -1).any():
                slot[c["index"][r]] = c["ids"][r]
    return out


def lade_against_qnn_sim(work: Path, ids: list[int], lade=(3, 3, 3), tokens: int = 40,
                         splits: int = 2, family: str = "llama") -> tuple[int, str | None]:
    """Build the lade-form bundle in ``work``, run one lade query on ``ids`` twice over, and
    compare each call's context with qnn-sim's greedy tokens -> (the generated ids compared
    equal, None or the first difference past a tie in words)."""
    sys.path.insert(0, str(Path(__file__).parent / "experiments"))
    from genie_lade_scatter import run_lade
    from tokenizers import Tokenizer

    import hexforge
    from hexforge.runtime.compare import greedy_margins

    work.mkdir(parents=True, exist_ok=True)
    bundle = build(work, splits, family)
    folder = bundle / "genie-v81"
    layers = json.loads((bundle / "manifest.json").read_text())["num_layers"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = tok.decode(ids * 2, skip_special_tokens=False)
    dump = work / "dump"
    run_lade(folder, text, lade, tokens, dump)
    ctx = graph_contexts(dump, layers)
    dialog = json.loads((folder / "genie_config.json").read_text())["dialog"]["context"]
    fed = [dialog["bos-token"], *tok.encode(text, add_special_tokens=False).ids]
    context = dialog["size"]
    want, margins = greedy_margins(hexforge.load(bundle, backend="qnn-sim"), fed,
                                   min(2 * tokens, context - len(fed)))
    ref = fed + want
    equal = 0
    for k in range(-(-len(fed) // 16), len(ctx)):
        got = ctx[k]
        if len(got) < len(ctx[k - 1]):  # past max-num-tokens Genie's mask retreats
            break
        i = next((j for j, (x, y) in enumerate(zip(got, ref, strict=False)) if x != y), None)
        if i is None:
            equal = len(got) - len(fed)
            continue
        m = margins[i - len(fed)]
        if m <= 1e-3:  # a tie of qnn-sim's top-2 fp16 logits: not compared further
            print(f"call {k}: a top-2 tie of qnn-sim's at generated id {i - len(fed)} "
                  f"(margin {m:.4f})", file=sys.stderr)
            return i - len(fed), None
        return equal, (f"call {k}: lade {got[i]} != qnn-sim {ref[i]} at generated id "
                       f"{i - len(fed)} (qnn-sim's top-2 margin {m:.4f})")
    return equal, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work")
    ap.add_argument("--lade", default="3,3,3")
    ap.add_argument("--ids", default="5,6,7,8,9,332,12", help="the prompt, repeated twice")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--splits", type=int, default=2, choices=sorted(SPLIT_BYTES))
    ap.add_argument("--family", default="llama", choices=("llama", "gemma3"))
    a = ap.parse_args()
    equal, differ = lade_against_qnn_sim(Path(a.work), [int(x) for x in a.ids.split(",")],
                                         tuple(int(x) for x in a.lade.split(",")), a.tokens,
                                         a.splits, a.family)
    print(f"lade = qnn-sim's greedy tokens for {equal} generated ids"
          + (f"; then {differ}" if differ else " (up to the end or a tie)"))


if __name__ == "__main__":
    main()
