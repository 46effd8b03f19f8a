"""Genie's lookahead dialog (``lade``) on a bundle built with ``--genie-kv scatter``, from its own
tensor dump: what it writes into ``cache_index`` and the mask each step, which rows the next step
attends, and whether its tokens are ``basic``'s.

    python bench/experiments/genie_lade_scatter.py BUNDLE [--ids 5,6,7,8,9,10,11,12 --repeat 2]
                                                   [--lade 3,3,3] [--tokens 40] [--dump DIR]

One text query through a ``lade`` dialog with ``debug.dump-tensors`` (a token query on a ``lade``
dialog ends the process, docs/notes/genie-record.md), then ``basic`` (token query) on the same prompt ids. In
the scatter form Genie writes row i of a step at slot ``cache_index[i]`` (n, n + 1, ... in row
order, a pad row at CL - 1), and the next step's mask attends the slots of the rows it accepted
only, so the context a step's row 0 attends is read off the dump: the ids written to the slots
it attends, in slot order (``contexts``). Two checks:

- lade = basic: the context lade committed, past the prompt, against basic's greedy tokens;
- after lade's first step: its tokens against basic's continuation of the context lade had
  committed by its second step (the check of the scatter form alone, ``continuation``).

Findings (libGenie 1.21, tiny llama, AR-16 / CL 128): docs/notes/genie-record.md ("lade").
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


def run_lade(folder: Path, text: str, lade: tuple[int, int, int], tokens: int, dump: Path
             ) -> None:
    """``lade_query`` in a child process: a lade dialog made after other dialogs and QNN EP
    sessions in one process (the test suite's) aborted it ("Fatal Python error: Aborted" in
    GenieDialog_query), alone it runs."""
    import os
    import subprocess

    cmd = [sys.executable, __file__, "--child", str(folder), str(dump),
           ",".join(map(str, lade)), str(tokens)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=900, env=env)
    if p.returncode:
        raise RuntimeError(f"lade query: exit {p.returncode}: {p.stderr[-2000:]}")


def lade_query(folder: Path, text: str, lade: tuple[int, int, int], tokens: int, dump: Path
               ) -> list[str]:
    """One lade text query with ``debug.dump-tensors`` into ``dump``; -> Genie's log lines."""
    from hexforge.runtime.genie import libgenie as genie
    from hexforge.runtime.genie.model import absolute_paths

    cfg = absolute_paths(json.loads((folder / "genie_config.json").read_text()), folder)
    cfg["dialog"]["engine"]["backend"]["QnnHtp"]["poll"] = False  # the simulator needs the core
    cfg["dialog"]["context"]["eos-token"] = -1  # no early end
    cfg["dialog"]["context"].setdefault("pad-token", 0)
    W, N, G = lade
    cfg["dialog"].update(type="lade", lade={"version": 1, "window": W, "ngram": N, "gcap": G})
    cfg["dialog"]["max-num-tokens"] = tokens
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    cfg["dialog"]["debug"] = {"path": str(dump), "dump-tensors": True}
    lines: list[str] = []
    with genie.Dialog(cfg, log_level="info", echo=lines.append) as d:
        d.query(text, lambda _s: None)
    return lines


def run_basic(folder: Path, ids: list[int], tokens: int) -> list[int]:
    """``basic``'s greedy tokens after ``ids`` (BOS included, as given), through libGenie."""
    from hexforge.runtime.genie import libgenie as genie
    from hexforge.runtime.genie.model import absolute_paths

    cfg = absolute_paths(json.loads((folder / "genie_config.json").read_text()), folder)
    cfg["dialog"]["engine"]["backend"]["QnnHtp"]["poll"] = False
    cfg["dialog"]["context"]["eos-token"] = -1
    cfg["dialog"]["context"]["bos-token"] = -1  # the ids carry their BOS
    with genie.Dialog(cfg, log_level="error") as d:
        return list(d.generate(ids, tokens))


def steps(dump: Path) -> list[dict]:
    """Every graph call of split 1 in order: {"AR", "ids", "index" (cache_index), "mask" [AR,
    CL]}."""
    calls: dict[int, Path] = {}
    for graph in dump.rglob("*"):
        if graph.is_dir() and re.search(r"_ar\d+_cl\d+_1_of_\d+$", graph.name):
            for f in graph.iterdir():
                calls.setdefault(int(f.name[:3]), graph)
    out = []
    for k in sorted(calls):
        g = calls[k]
        AR = int(re.search(r"_ar(\d+)_", g.name).group(1))
        index = g / f"{k:03d}_in_cache_index"
        out.append({"AR": AR,
                    "ids": np.fromfile(g / f"{k:03d}_in_input_ids", np.int32).tolist(),
                    "index": np.fromfile(index, np.int32).tolist() if index.exists() else None,
                    "mask": np.fromfile(g / f"{k:03d}_in_attention_mask",
                                        np.float32).reshape(AR, -1)})
    return out


def contexts(calls: list[dict]) -> list[list[int]]:
    """Per call (scatter form), the ids in the slots its row 0 attends, in slot order: the
    context it runs on, its own id last."""
    slot: dict[int, int] = {}
    out = []
    for c in calls:
        if c["index"] is None:
            raise RuntimeError("no cache_index in the dump: a concat-form bundle (build it with "
                             "--genie-kv scatter)")
        row0 = np.where(c["mask"][0] > -1)[0]
        out.append([slot[int(s)] for s in row0 if s != c["index"][0]] + [c["ids"][0]])
        for r in range(c["AR"]):
            if (c["mask"][r] > -1).any():
                slot[c["index"][r]] = c["ids"][r]
    return out


def ranges(xs) -> str:
    xs, out = [int(x) for x in xs], []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def lade_vs_basic(folder: Path, prompt: list[int], lade=(3, 3, 3), tokens: int = 40,
                  dump: Path | None = None) -> dict:
    """The lade query on ``prompt`` (ids, BOS first) and basic's tokens on it -> {"prompt",
    "lade" (the ids lade committed past the prompt), "basic", "first_difference", "calls",
    "continuation": (basic's continuation of lade's committed context after its first step,
    lade's own), "report": lines}."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = tok.decode(prompt[1:], skip_special_tokens=False)
    own = tempfile.mkdtemp(prefix="lade-scatter-") if dump is None else None
    dump = Path(own or dump)
    try:
        run_lade(folder, text, lade, tokens, dump)
        calls = steps(dump)
    finally:
        if own:
            shutil.rmtree(own, ignore_errors=True)
    ctx = contexts(calls)
    # the prompt as Genie tokenizes it (its BOS, then the text without the post-processor), in
    # chunks of the AR-N graph: lade's first step is the call after them
    fed = [prompt[0], *tok.encode(text, add_special_tokens=False).ids]
    n_prompt = -(-len(fed) // calls[0]["AR"])
    if ctx[n_prompt][:-1] != fed:
        raise RuntimeError(f"the first lade step's context is not the prompt: {ctx[n_prompt]}")
    # lade's last call before its context shrinks (past max-num-tokens Genie goes on and its
    # mask retreats: docs/notes/genie-record.md)
    last = n_prompt
    for i in range(n_prompt + 1, len(ctx)):
        if len(ctx[i]) < len(ctx[last]):
            break
        last = i
    committed = ctx[last]
    lade_ids = committed[len(fed):]
    basic = run_basic(folder, fed, len(lade_ids))
    differ = next((i for i, (a, b) in enumerate(zip(lade_ids, basic, strict=False)) if a != b),
                  None)
    cut = len(ctx[n_prompt + 1]) if n_prompt + 1 <= last else len(committed)
    cont_ctx = [min(t, int(json.loads((folder / "genie_config.json").read_text())
                           ["dialog"]["context"]["n-vocab"]) - 1) for t in committed[:cut]]
    lade_cont = committed[cut:]
    basic_cont = run_basic(folder, cont_ctx, len(lade_cont)) if lade_cont else []
    report = []
    for i, c in enumerate(calls[:last + 1]):
        rows = [r for r in range(c["AR"]) if (c["mask"][r] > -1).any()]
        report.append(f"call {i} AR-{c['AR']}: ids {[c['ids'][r] for r in rows]} cache_index "
                      f"{[c['index'][r] for r in rows]}; row 0 attends slots "
                      f"{ranges(np.where(c['mask'][0] > -1)[0])}")
    return {"prompt": fed, "lade": lade_ids, "basic": basic, "first_difference": differ,
            "calls": last + 1 - n_prompt, "continuation": (basic_cont, lade_cont),
            "report": report}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # run_lade's child: folder, dump, W,N,G, tokens; text on stdin
        folder, dump, lade, tokens = sys.argv[2:6]
        lade_query(Path(folder), sys.stdin.read(), tuple(int(x) for x in lade.split(",")),
                   int(tokens), Path(dump))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--ids", default="5,6,7,8,9,10,11,12", help="the prompt's ids (BOS added)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--lade", default="3,3,3", help="window, n-gram, guess capacity")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--dump", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from hexforge.runtime.genie.model import find_folder

    folder = find_folder(Path(a.bundle))
    bos = json.loads((folder / "genie_config.json").read_text())["dialog"]["context"]["bos-token"]
    prompt = [bos] + [int(x) for x in a.ids.split(",")] * a.repeat
    r = lade_vs_basic(folder, prompt, tuple(int(x) for x in a.lade.split(",")), a.tokens,
                      Path(a.dump) if a.dump else None)
    print("\n".join(r["report"]))
    print(f"prompt ({len(r['prompt'])}): {r['prompt']}")
    print(f"lade  ({len(r['lade'])} ids in {r['calls']} calls): {r['lade']}")
    print(f"basic: {r['basic']}")
    print("lade = basic" if r["first_difference"] is None
          else f"lade != basic from id {r['first_difference']}")
    basic_cont, lade_cont = r["continuation"]
    print(f"after lade's first step: lade {lade_cont}\n                  basic's continuation "
          f"{basic_cont}: {'equal' if basic_cont == lade_cont else 'differ'}")


if __name__ == "__main__":
    main()
