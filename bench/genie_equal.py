"""One built bundle's greedy tokens through libGenie and through ``--backend qnn-sim``: the phone
contract's check at any size (the two run the same weights; plumbing, not accuracy).

    python bench/genie_equal.py BUNDLE [--tokens 4] [--prompt-ids 8 | --image PNG | --audio WAV]
                                [--prefill-mode decode] [--gaps-of ID,ID,...]

For the seeds' models at real width, build first with bench/realsize.py (``--genie
--device-only``, ``--layers N`` for a cut), e.g. the Qwen3.5-4B text decoder cut to 4 layers:

    python bench/realsize.py qwen3.5-4b-text W --quant w4-fp16 --device-only --genie \\
        --context 256 --prefill-len 32 --layers 4
    python bench/genie_equal.py W/qwen3.5-4b-text-L4-w4-fp16 --tokens 4

``--prefill-mode decode``: both run the prompt through the AR-1 graphs alone (libGenie is given
the AR-1 contexts only, qnn-sim opens no prefill graph): the road of a model whose two graph sets
pass what one HTP process domain of the simulator holds (~3.3 GB).

Prints one JSON object: both token lists, whether they are equal, the wall time of each (the
simulator's: it emulates MatMulNBits, minutes a step at these widths) and the Genie folder's
bytes against the target's graphs. libGenie runs in a child process beside qnn-sim (each
simulator takes a core). Results: docs/genie.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def folder_bytes(bundle: Path) -> dict[str, int]:
    """The Genie folder's context binaries and LUT, the v81 target's compiled graphs."""
    genie = next(bundle.glob("genie-v*"))
    target = bundle / genie.name.removeprefix("genie-")
    return {"genie_contexts": sum(p.stat().st_size for p in genie.glob("*.bin")),
            "genie_lut": sum(p.stat().st_size for p in genie.glob("embedding.*")),
            "largest_genie_context": max(p.stat().st_size for p in genie.glob("*.bin")),
            "target_graphs": sum(p.stat().st_size for p in target.glob("*.bin"))}


def genie_tokens(a: argparse.Namespace, prompt: str | list[int], media: dict) -> list[int]:
    """The greedy tokens of the bundle's Genie folder through libGenie (its pipeline with media)."""
    if media:
        from hexforge.runtime.genie.pipelinemodel import open_genie

        model = open_genie(a.bundle, prefill_mode=a.prefill_mode)
    else:
        from hexforge.runtime.genie.model import GenieModel

        model = GenieModel(a.bundle, prefill_mode=a.prefill_mode)
    try:
        return model.generate(prompt, max_new_tokens=a.tokens, ignore_eos=True,
                              **media).token_ids
    finally:
        model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--prompt-ids", type=int, default=8, help="a prompt of this many token ids")
    ap.add_argument("--image", type=Path, default=None,
                    help="ask about this picture instead (the Genie pipeline: its image node)")
    ap.add_argument("--audio", type=Path, default=None, help="or about this recording")
    ap.add_argument("--prefill-mode", choices=("chunked", "decode"), default="chunked",
                    help="decode: the AR-1 graphs alone, through both")
    ap.add_argument("--gaps-of", default=None, metavar="ID,ID,...",
                    help="no generation: where these tokens (an earlier run's libGenie side) "
                         "rank in qnn-sim's logits, each on its own prefix")
    ap.add_argument("--genie-only", action="store_true", help=argparse.SUPPRESS)  # the child
    a = ap.parse_args()

    media = dict(images=[str(a.image)] if a.image else None,
                 audios=[str(a.audio)] if a.audio else None) if a.image or a.audio else {}
    from hexforge.bundle.manifest import load_manifest

    # a text prompt with the medium (the Genie pipeline), or ids in every seed's vocabulary
    # (a tiny fixture's 384 too)
    vocab = load_manifest(a.bundle, check_files=False).vocab_size
    prompt: str | list[int] = ("Describe it." if media
                               else [(1000 + 37 * i) % vocab for i in range(a.prompt_ids)])
    if a.genie_only:
        t = time.perf_counter()
        tokens = genie_tokens(a, prompt, media)
        print(json.dumps({"genie": tokens, "genie_s": round(time.perf_counter() - t)}))
        # said at once too: a run cut short (hours at 4 B) keeps the side that ended
        print(f"libGenie: {tokens} in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
        return

    import hexforge

    if a.gaps_of:  # a run cut short after both sides ended: its gaps alone (the AR-1 steps)
        from hexforge.runtime.compare import pick_gaps

        model = hexforge.load(a.bundle, backend="qnn-sim", prefill_mode=a.prefill_mode)
        tokens = [int(t) for t in a.gaps_of.split(",")]
        gaps = pick_gaps(model, prompt, tokens)
        print(json.dumps({"bundle": str(a.bundle), "tokens": tokens, "gap_rank_fp16_step": [
            [round(g, 5), r, round(step, 5)] for g, r, step in gaps]}, indent=1))
        return
    # libGenie in a child process beside qnn-sim in this one: each simulator takes a core
    child = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--genie-only"],
                             stdout=subprocess.PIPE, text=True)
    try:
        t = time.perf_counter()
        model = hexforge.load(a.bundle, backend="qnn-sim", prefill_mode=a.prefill_mode)
        sim = model.generate(prompt, max_new_tokens=a.tokens, ignore_eos=True,
                             **media).token_ids
        sim_s = time.perf_counter() - t
        print(f"qnn-sim: {sim} in {sim_s:.0f}s", file=sys.stderr, flush=True)
    except BaseException:
        child.kill()
        raise
    out, _ = child.communicate()
    if child.returncode:
        raise SystemExit(f"libGenie's side failed (exit {child.returncode})")
    side = json.loads(out.strip().splitlines()[-1])
    genie = side["genie"]
    steps = None
    if genie != sim and not media:  # how far below qnn-sim's top Genie's picks sit (a tie?)
        from hexforge.runtime.compare import pick_gaps

        steps = [[round(g, 5), r] for g, r, _ in pick_gaps(model, prompt, genie)]
    print(json.dumps({"bundle": str(a.bundle), "prefill_mode": a.prefill_mode, "genie": genie,
                      "qnn_sim": sim, "equal": genie == sim,
                      "genie_picks_in_qnn_sim_gap_rank": steps, "genie_s": side["genie_s"],
                      "qnn_sim_s": round(sim_s), **folder_bytes(a.bundle)}, indent=1))


if __name__ == "__main__":
    main()
