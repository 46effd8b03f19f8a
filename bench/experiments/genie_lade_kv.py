"""What libGenie 1.21's lookahead dialog (``lade``) does with a hexforge Genie bundle's KV cache,
step by step, from its own tensor dump: which rows of a step each row attends, how many cache
slots, and which of the step's output rows Genie copies into which cache slots before the next.

    python bench/experiments/genie_lade_kv.py BUNDLE [--task repeat | --prompt TEXT]
                                              [--lade 4,3,4] [--tokens 24] [--steps 12] [--dump DIR]

One text query (``GenieDialog_query``; ``--task``: a bench/speculative.py task, chat-formatted
with the bundle's template) through a ``lade`` dialog with ``debug.dump-tensors`` on; then, for
each step k of the AR-N graph (split 1, layer 0's keys), the cache slots whose contents changed
between step k's ``past_key_0_in`` and step k+1's, each matched to the row of step k's
``past_key_0_out`` it equals. A correct lookahead commits the rows of the accepted n-gram; the
dump says which rows Genie commits. Findings: docs/notes/genie-record.md ("lade").
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np


def run_lade(folder: Path, prompt: str, lade: tuple[int, int, int], tokens: int,
             dump: Path) -> str:
    from hexforge.runtime.genie import libgenie as genie
    from hexforge.runtime.genie.model import absolute_paths

    cfg = absolute_paths(json.loads((folder / "genie_config.json").read_text()), folder)
    cfg["dialog"]["engine"]["backend"]["QnnHtp"]["poll"] = False  # the simulator needs the core
    cfg["dialog"]["context"]["eos-token"] = -1  # as bench/genie_lade.py: no early end
    cfg["dialog"]["context"].setdefault("pad-token", 0)
    W, N, G = lade
    cfg["dialog"].update(type="lade", lade={"version": 1, "window": W, "ngram": N, "gcap": G})
    cfg["dialog"]["max-num-tokens"] = tokens
    cfg["dialog"]["debug"] = {"path": str(dump), "dump-tensors": True}
    out: list[str] = []
    with genie.Dialog(cfg, log_level="warn") as d:
        d.query(prompt, out.append)
    return "".join(out)


def steps_report(dump: Path, context: int, limit: int) -> list[str]:
    graph = next(p for p in dump.rglob("*") if p.is_dir() and re.search(r"_ar(\d+)_", p.name)
                 and "_1_of_" in p.name and not p.name.startswith("token_ar1"))
    AR = int(re.search(r"_ar(\d+)_", graph.name).group(1))
    S = context - AR

    def read(step: int, name: str, cols: int) -> np.ndarray:
        return np.fromfile(graph / f"{step:03d}_{name}", np.float32).reshape(-1, cols)

    steps = sorted({int(p.name[:3]) for p in graph.iterdir()})
    lines = [f"{graph.name}: AR-{AR}, {S} cache slots"]
    for k in steps[:-1][:limit]:
        past, new = read(k, "in_past_key_0_in", S), read(k, "out_past_key_0_out", AR)
        nxt = read(k + 1, "in_past_key_0_in", S)
        mask = read(k, "in_attention_mask", context)
        ids = np.fromfile(graph / f"{k:03d}_in_input_ids", np.int32)
        rows = [r for r in range(AR) if (mask[r] > -1).any()]
        written = {s: [r for r in range(AR) if np.allclose(nxt[:, s], new[:, r], atol=1e-3)]
                   for s in range(S) if not np.allclose(past[:, s], nxt[:, s])}
        lines.append(f"step {k}: ids {[int(ids[r]) for r in rows]}")
        lines.append("  row: past slots attended / rows of this step attended: " + ", ".join(
            f"{r}: {int((mask[r, :S] > -1).sum())} / {[int(x) for x in np.where(mask[r, S:] > -1)[0]]}"
            for r in rows))
        lines.append(f"  cache slot <- the step's output rows equal to it: {written}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--task", default="repeat", help="a bench/speculative.py task")
    ap.add_argument("--prompt", default=None, help="raw text instead of --task")
    ap.add_argument("--lade", default="4,3,4", help="window, n-gram, guess capacity")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dump", default=None, help="keep Genie's dump here (default: a temp dir)")
    a = ap.parse_args()
    folder = next(Path(a.bundle).glob("genie-v*"))
    context = int(json.loads((folder / "genie_config.json").read_text())["dialog"]["context"]
                  ["size"])
    dump = Path(a.dump) if a.dump else Path(tempfile.mkdtemp(prefix="lade-dump-"))
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    W, N, G = (int(x) for x in a.lade.split(","))
    prompt = a.prompt
    if prompt is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from speculative import TASKS

        from hexforge.runtime.text import ChatTemplate

        prompt = ChatTemplate.load(Path(a.bundle) / "tokenizer").render(
            [{"role": "user", "content": TASKS[a.task]}], add_generation_prompt=True)
    answer = run_lade(folder, prompt, (W, N, G), a.tokens, dump)
    print(f"lade answer: {answer!r}")
    print("\n".join(steps_report(dump, context, a.steps)))
    if not a.dump:
        shutil.rmtree(dump, ignore_errors=True)


if __name__ == "__main__":
    main()
