"""Genie's own lossless speculation: its lookahead dialog (``lade``, no draft model) against its
``basic`` dialog on one Genie bundle, per task of bench/speculative.py.

    python bench/genie_lade.py BUNDLE [--tasks repeat,edit,bugfix,quotes,open]
                               [--lade 4,3,4] [--json out.json]

Each task's chat-formatted prompt goes through libGenie twice, as text (``GenieDialog_query``: a
``lade`` dialog ends the process on a token query, docs/genie.md), greedy, EOS off. libGenie 1.21's
``lade`` dialog generates until the context is full whatever ``max-num-tokens`` says (and goes on
after ``GenieDialog_signal(ABORT)``, which returns success): so ``lade`` runs first, to the end of
the bundle's context — size it with ``--context`` at build time — and ``basic`` then makes as
many tokens as lade's answer holds (the bundle's tokenizer counts them). The answers must agree
(lookahead decoding is lossless): the shorter one a prefix of the other. The graph calls after the
prompt are counted from Genie's log — a ``basic`` dialog makes one AR-1 call a token, ``lade`` one
AR-N call a step — so tokens per call is what one step of the AR-N graph accepts. --lade W,N,G:
the lookahead window, n-gram size and guess-cache capacity. On the x86 simulator; its wall time
says nothing about a device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def run(folder: Path, config: dict, text: str, dialog: dict
        ) -> tuple[str, list[str], int, int]:
    """-> (the answer, every graph call of the query, the index of its first AR-1 call, Genie's
    status)."""
    from hexforge.runtime.genie import libgenie as genie
    from hexforge.runtime.genie.model import absolute_paths

    cfg = absolute_paths(config, folder)
    cfg["dialog"].update(dialog)
    lines: list[str] = []
    out: list[str] = []
    with genie.Dialog(cfg, log_level="verbose", echo=lines.append) as d:
        status = d.query(text, out.append)
    calls = [ln for ln in lines if "Executing graph 0 - " in ln]
    first_token = next(i for i, ln in enumerate(calls) if "token_ar1" in ln) if any(
        "token_ar1" in ln for ln in calls) else len(calls)
    # the prompt: AR-N chunks up to the first AR-1 call (basic) / its own chunks (lade: counted
    # as the basic dialog's, the same prompt in the same chunks)
    return "".join(out), calls, first_token, status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--tasks", default="repeat,edit,bugfix,quotes,open")
    ap.add_argument("--lade", default="4,3,4")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from speculative import TASKS
    from tokenizers import Tokenizer

    from hexforge.runtime.genie import libgenie as genie
    from hexforge.runtime.genie.model import find_folder
    from hexforge.runtime.text import ChatTemplate

    bundle = Path(a.bundle)
    folder = find_folder(bundle)
    config = json.loads((folder / "genie_config.json").read_text())
    config["dialog"]["engine"]["backend"]["QnnHtp"]["poll"] = False
    config["dialog"]["context"]["eos-token"] = -1  # the same number of tokens both ways
    config["dialog"]["context"].setdefault("pad-token", 0)
    template = ChatTemplate.load(bundle / "tokenizer")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    W, N, G = (int(x) for x in a.lade.split(","))
    lade = {"type": "lade", "lade": {"version": 1, "window": W, "ngram": N, "gcap": G}}
    results = {}
    for task in a.tasks.split(","):
        text = template.render([{"role": "user", "content": TASKS[task]}],
                               add_generation_prompt=True)
        fast, l_calls, _, l_status = run(folder, config, text, lade)
        n = len(tokenizer.encode(fast, add_special_tokens=False).ids)
        basic, b_calls, b_prompt, _ = run(folder, config, text, {"max-num-tokens": n})
        decode_basic = len(b_calls) - b_prompt  # = n, one AR-1 call a token
        decode_lade = len(l_calls) - b_prompt  # lade's prompt: the same AR-N chunks
        short, long = sorted((fast, basic), key=len)
        differ = next((i for i, (x, y) in enumerate(zip(short, long, strict=False))
                       if x != y), None)
        results[task] = {"equal": differ is None, "compared_chars": len(short),
                         "first_difference_char": differ,
                         "tokens": n, "lade_status": genie.STATUS_NAMES.get(l_status, l_status),
                         "basic_calls": decode_basic, "lade_calls": decode_lade,
                         "tokens_per_call": round(decode_basic / max(decode_lade, 1), 2),
                         "basic": basic, "lade": fast}
        print(task, json.dumps(results[task]), file=sys.stderr, flush=True)
    out = {"bundle": str(bundle), "lade": {"window": W, "ngram": N, "gcap": G},
           "context": config["dialog"]["context"]["size"], "tasks": results}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
