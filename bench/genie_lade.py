"""Genie's own lossless speculation: its lookahead dialog (``lade``, no draft model) against its
``basic`` dialog on one Genie bundle, per task of bench/speculative.py.

    python bench/genie_lade.py BUNDLE [--tasks repeat,edit,bugfix,open] [--tokens 64]
                               [--lade W,N,G] [--hextimate] [--json out.json]
                               [--basic-from earlier.json] [--basic-ar-n]

Each task's prompt (chat-formatted where the bundle has a template) goes through libGenie twice, as
text (``GenieDialog_query``: a ``lade`` dialog ends the process on a token query, docs/genie.md),
greedy, EOS off, each query in a child process. libGenie 1.21's ``lade`` dialog generates until the
context is full whatever ``max-num-tokens`` says (and goes on after ``GenieDialog_signal(ABORT)``,
which returns success; each step takes as many slots as it feeds rows, accepted or not: size
``--context`` at build time for it), so its child is ended once ``--tokens`` + 8 pieces came, its
graph calls counted up to there; ``basic`` makes ``--tokens`` tokens. The answers must agree
(lookahead decoding is lossless on a bundle built with ``--genie-kv lade``): basic's text a prefix
of lade's. The graph calls after the prompt are counted from Genie's log -- ``lade`` one AR-N call
a step -- so tokens per call is lade's answer's tokens (the bundle's tokenizer counts them) over
its calls. --lade W,N,G: the lookahead window, n-gram size and guess-cache capacity (default: the
folder's lade.json). --hextimate: the Genie graphs' step times by Hextimate, SA8797 (v81) (a bundle
built with --keep-work: the graphs' ONNX in _work/), and what they make of each dialog's decode:
the AR-N step (every split) / tokens per call, against the AR-1 step. On the x86 simulator; its
wall time says nothing about a device. --basic-from: basic's answers from an earlier --json of
the same bundle and --tokens (basic's tokens do not depend on the lade block: a sweep of lade
blocks runs basic once). --basic-ar-n: basic runs its tokens through the AR-N graphs too (the
folder's AR-1 binaries left out of its config), each step one real row of N: the same graphs as
lade's verify, so where the two differ it is not the AR-1 graph's rounding."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def run(folder: Path, config: dict, text: str, dialog: dict, stop_after: int | None = None
        ) -> tuple[str, list[str], int, int | str]:
    """One text query in a child process (``child``) -> (the answer, every graph call of the
    query up to its end, the index of its first AR-1 call, Genie's status). ``stop_after``:
    the child is ended once that many pieces came (a lade dialog would run on to the context's
    end; what came by then is what it made by then, its calls counted up to there), status
    "stopped"."""
    import subprocess

    from hexforge.runtime.genie.model import absolute_paths

    cfg = absolute_paths(config, folder)
    cfg["dialog"].update(dialog)
    p = subprocess.Popen([sys.executable, __file__, "--child"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    p.stdin.write(json.dumps({"config": cfg, "text": text}) + "\n")
    p.stdin.close()
    out: list[str] = []
    calls: list[str] = []
    status: int | str = "stopped"
    try:
        for line in p.stdout:
            if not line.startswith("{"):  # the native libraries print to stdout too
                continue
            msg = json.loads(line)
            if "call" in msg:
                calls.append(msg["call"])
            elif "piece" in msg:
                out.append(msg["piece"])
                if stop_after is not None and len(out) >= stop_after:
                    break
            elif "status" in msg:
                status = msg["status"]
    finally:  # stopped early, or this process failing: the child goes too
        if p.poll() is None:
            p.kill()
        p.wait()
    # the graphs' names carry Genie's letters (token<letters>_ar1_cl..): the AR-1 ones by _ar1_
    first_token = next((i for i, ln in enumerate(calls) if "_ar1_cl" in ln), len(calls))
    # the prompt: AR-N chunks up to the first AR-1 call (basic) / its own chunks (lade: counted
    # as the basic dialog's, the same prompt in the same chunks)
    return "".join(out), calls, first_token, status


def child() -> int:
    """The query of ``run``, its pieces and graph calls as JSON lines on stdout as they come."""
    from hexforge.runtime.genie import libgenie as genie

    job = json.loads(sys.stdin.readline())

    def say(**kw) -> None:
        print(json.dumps(kw), flush=True)

    def log(line: str) -> None:
        if "Executing graph 0 - " in line:
            say(call=line)
    with genie.Dialog(job["config"], log_level="verbose", echo=log) as d:
        status = d.query(job["text"], lambda s: say(piece=s))
    say(status=status)
    return 0


def compiled(graphs: list[Path]) -> list[Path]:
    """The graphs the build compiled: a weight-only recipe's ``X.wo.onnx`` in place of ``X.onnx``."""
    names = {g.name for g in graphs}
    return [g for g in graphs if g.name.endswith(".wo.onnx")
            or g.name.replace(".onnx", ".wo.onnx") not in names]


def genie_step_us(bundle: Path, arch: int = 81) -> dict[int, dict]:
    """AR -> {"us": every split's Hextimate us summed, "missing_ops"} of the bundle's Genie graphs
    (``_work/genie/onnx*/``: a build with --keep-work), on the arch's estimator SoC."""
    from hexforge.bundle.targets import get_target
    from hexforge.forge.compile.hextimate import estimate_graph

    target = get_target(f"v{arch}")
    soc = target.estimator
    out: dict[int, dict] = {}
    graphs = compiled(sorted((bundle / "_work" / "genie").glob("onnx*/*_ar*_cl*_of_*.onnx")))
    if not graphs:
        raise SystemExit(f"{bundle}: no Genie ONNX graphs in _work/ (build it with --keep-work)")
    for g in graphs:
        ar = int(re.search(r"_ar(\d+)_", g.name).group(1))
        est = estimate_graph(g, arch, soc, fp16=True)
        cell = out.setdefault(ar, {"us": 0, "missing_ops": 0})
        cell["us"] += est.us
        cell["missing_ops"] += est.missing_ops
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--tasks", default="repeat,edit,bugfix,open")
    ap.add_argument("--tokens", type=int, default=64, help="basic's tokens, compared")
    ap.add_argument("--lade", default=None, help="W,N,G (default: the folder's lade.json)")
    ap.add_argument("--hextimate", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--basic-from", default=None, metavar="JSON")
    ap.add_argument("--basic-ar-n", action="store_true")
    a = ap.parse_args()

    from speculative import TASKS
    from tokenizers import Tokenizer

    from hexforge.bundle.lade import LADE
    from hexforge.runtime.genie import libgenie as genie
    from hexforge.runtime.genie.checks import prefill_len
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
    if a.lade:
        W, N, G = (int(x) for x in a.lade.split(","))
        block = {"version": 1, "window": W, "ngram": N, "gcap": G}
    else:
        block = json.loads((folder / LADE).read_text())
    lade = {"type": "lade", "lade": block}
    basic_config = config
    if a.basic_ar_n:
        basic_config = json.loads(json.dumps(config))
        binary = basic_config["dialog"]["engine"]["model"]["binary"]
        binary["ctx-bins"] = [b for b in binary["ctx-bins"] if "_ar1_" not in b]
    steps = genie_step_us(bundle) if a.hextimate else None
    earlier = json.loads(Path(a.basic_from).read_text()) if a.basic_from else None
    if earlier and (earlier["bundle"], earlier["tokens"]) != (str(bundle), a.tokens):
        raise SystemExit(f"{a.basic_from}: another bundle or --tokens")
    results = {}
    for task in a.tasks.split(","):
        # a base model (Gemma-3-270M) has no chat template: the task's text as it is
        text = (template.render([{"role": "user", "content": TASKS[task]}],
                                add_generation_prompt=True) if template else TASKS[task])
        fast, l_calls, _, l_status = run(folder, config, text, lade, a.tokens + 8)
        n = len(tokenizer.encode(fast, add_special_tokens=False).ids)
        if earlier:
            basic, b_prompt = earlier["tasks"][task]["basic"], earlier["tasks"][task]["prompt_calls"]
        else:
            basic, _calls, b_prompt, _ = run(folder, basic_config, text,
                                             {"max-num-tokens": a.tokens})
            if a.basic_ar_n:  # no AR-1 call marks the prompt's end: its AR-N chunks
                b_prompt = -(-len(tokenizer.encode(text, add_special_tokens=False).ids)
                             // prefill_len(config))
        decode_lade = len(l_calls) - b_prompt  # lade's prompt: the same AR-N chunks
        differ = next((i for i, (x, y) in enumerate(zip(basic, fast, strict=False))
                       if x != y), None)
        tpc = n / max(decode_lade, 1)
        results[task] = {
            "equal": differ is None and len(fast) >= len(basic),
            "basic_tokens": len(tokenizer.encode(basic, add_special_tokens=False).ids),
            "compared_chars": min(len(basic), len(fast)), "first_difference_char": differ,
            "lade_tokens": n, "lade_calls": decode_lade,
            "lade_status": genie.STATUS_NAMES.get(l_status, l_status),  # type: ignore[arg-type]
            "tokens_per_call": round(tpc, 2), "prompt_calls": b_prompt,
            "basic": basic, "lade": fast}
        if steps:
            ar = max(steps)
            results[task] |= {"basic_tok_s": round(1e6 / steps[1]["us"], 1),
                              "lade_tok_s": round(tpc * 1e6 / steps[ar]["us"], 1)}
        print(task, json.dumps({k: v for k, v in results[task].items()
                                if k not in ("basic", "lade")}), file=sys.stderr, flush=True)
        if a.json:  # each task as it ends: a sweep's partial results survive a stop
            Path(a.json).write_text(json.dumps({"bundle": str(bundle), "lade": block,
                                                "tokens": a.tokens, "tasks": results}, indent=1))
    out = {"bundle": str(bundle), "lade": block, "tokens": a.tokens,
           "context": config["dialog"]["context"]["size"], "step_us": steps, "tasks": results}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0 if all(r["equal"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(child() if sys.argv[1:] == ["--child"] else main())
