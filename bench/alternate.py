"""Decode speed of several contenders, each alone in a fresh process, rounds alternated: the
protocol behind the README's hexforge-vs-genai ratios at 2 threads.

    python bench/alternate.py hexforge:BUNDLE genai:FOLDER [hexforge:BUNDLE2 ...]
        [--rounds 12] [--prompt 32] [--tokens 63] [--reps 5] [--genai-threads 2]
        [--context 1024] [--json out.json]

Why processes: in one process the model loaded first decodes 3.5-8 % slower, whatever the model
(compare.py's docstring has the numbers), and an A/B inside one process measures that as much as
the contenders. A user runs one model a process; so does this script.

Each round starts every contender once, in a rotated order (round r begins with contender r mod
n), as `python bench/alternate.py --worker KIND PATH ...`. A worker prefills a --prompt-token
prompt (seeded random ids, the same for every contender), decodes 8 tokens untimed, then --reps
times prefills the prompt again and times --tokens greedy decode tokens; it prints the median ms a
token. Reported: each contender's median / min / max over the rounds, and for each pair the
per-round speed ratio (B's ms / A's ms, > 1: A is faster) as a geometric mean, median and range.
Speed varies by the hour on a shared machine; contenders of one round ran minutes apart, so the
per-round ratio is the number to read.

Contender kinds: hexforge (a bundle, run by hexforge's engine as compare.Hexforge does: IO-bound,
logits as the graph's own buffer, numpy argmax) and genai (an onnxruntime-genai model folder,
compare.GenAI: its own greedy search; --genai-threads sets its decoder's intra-op threads, as
`compare.py --genai-threads`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # bench/ is not a package: found through the path above

KINDS = ("hexforge", "genai")
WARMUP_TOKENS = 8


def parse_contender(spec: str) -> tuple[str, Path]:
    kind, sep, path = spec.partition(":")
    if not sep or kind not in KINDS or not path:
        raise SystemExit(f"contender {spec!r}: expected KIND:PATH with KIND one of {KINDS}")
    if not Path(path).is_dir():
        raise SystemExit(f"contender {spec!r}: {path} is not a folder")
    return kind, Path(path)


def labels(contenders: list[tuple[str, Path]]) -> list[str]:
    """kind:folder, or kind:parent/folder where two different folders share a name; #2, #3 ...
    on a contender named again (an A/A run)."""
    def base(kind: str, path: Path) -> str:
        clash = any(k == kind and p.name == path.name and p.resolve() != path.resolve()
                    for k, p in contenders)
        return f"{kind}:{path.parent.name}/{path.name}" if clash else f"{kind}:{path.name}"

    out: list[str] = []
    for kind, path in contenders:
        name = base(kind, path)
        seen = sum(o == name or o.startswith(f"{name}#") for o in out)
        out.append(f"{name}#{seen + 1}" if seen else name)
    return out


def rotation(n: int, r: int) -> list[int]:
    """Round r's order of n contenders: each starts a round in turn, and each comes after each
    other one as often as before it over n rounds."""
    return [(i + r) % n for i in range(n)]


def prompt_ids(vocab: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(0).integers(3, vocab, n)]


def worker(kind: str, path: Path, args) -> dict:
    """One contender in this process: median ms a decode token over --reps runs."""
    if kind == "hexforge":
        c = compare.Hexforge(path)
        vocab = c.eng.vocab_size
    else:
        c = compare.GenAI(path, args.context, "", args.genai_threads or None)
        vocab = json.loads((path / "genai_config.json").read_text())["model"]["vocab_size"]
    ids = prompt_ids(vocab, args.prompt)
    c.decode_timed(c.prefill(ids), WARMUP_TOKENS)
    ms = [c.decode_timed(c.prefill(ids), args.tokens) / args.tokens * 1e3
          for _ in range(args.reps)]
    return {"ms": statistics.median(ms), "reps_ms": [round(x, 4) for x in ms]}


def run_worker(kind: str, path: Path, args) -> float:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(path),
           "--prompt", str(args.prompt), "--tokens", str(args.tokens), "--reps", str(args.reps),
           "--context", str(args.context), "--genai-threads", str(args.genai_threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"{kind}:{path} failed (exit {r.returncode}):\n{tail}")
    return json.loads(r.stdout.strip().splitlines()[-1])["ms"]


def pair_ratio(a_ms: list[float], b_ms: list[float]) -> dict:
    """Per-round speed of A relative to B (b_ms / a_ms): geometric mean, median, range."""
    rs = [b / a for a, b in zip(a_ms, b_ms, strict=True)]
    return {"geomean": round(math.exp(sum(map(math.log, rs)) / len(rs)), 4),
            **compare.stats(rs, 4)}


def summarize(names: list[str], per_round: list[dict[str, float]]) -> dict:
    ms = {n: [r[n] for r in per_round] for n in names}
    return {
        "ms_a_token": {n: compare.stats(v, 3) for n, v in ms.items()},
        "speed_ratio": {f"{a} vs {b}": pair_ratio(ms[a], ms[b])
                        for i, a in enumerate(names) for b in names[i + 1:]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("contenders", nargs="*", help="KIND:PATH (hexforge:BUNDLE, genai:FOLDER)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=63)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context", type=int, default=1024, help="genai's max_length")
    ap.add_argument("--genai-threads", type=int, default=2, help="0: genai's own default")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.rounds, args.prompt, args.tokens, args.reps) < 1:
        raise SystemExit("--rounds, --prompt, --tokens and --reps must be at least 1")
    if args.worker:
        print(json.dumps(worker(args.worker[0], Path(args.worker[1]), args)))
        return
    if not args.contenders:
        raise SystemExit("name at least one contender (KIND:PATH)")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise SystemExit(f"--json {args.json}: its folder does not exist")
    contenders = [parse_contender(s) for s in args.contenders]
    names = labels(contenders)
    per_round: list[dict[str, float]] = []
    for r in range(args.rounds):
        row = {names[i]: run_worker(*contenders[i], args)
               for i in rotation(len(contenders), r)}
        per_round.append(row)
        print(f"round {r + 1}/{args.rounds}: "
              + "  ".join(f"{n} {row[n]:.2f} ms" for n in names), file=sys.stderr)
    result = {"prompt": args.prompt, "tokens": args.tokens, "reps": args.reps,
              "genai_threads": args.genai_threads, "rounds": per_round,
              **summarize(names, per_round)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("ms_a_token", "speed_ratio")}, indent=1))


if __name__ == "__main__":
    main()
