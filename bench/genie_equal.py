"""One built bundle's greedy tokens through libGenie and through ``--backend qnn-sim``: the phone
contract's check at any size (the two run the same weights; plumbing, not accuracy).

    python bench/genie_equal.py BUNDLE [--tokens 4] [--prompt-ids 8 | --image PNG | --audio WAV]

For the seeds' models at real width, build first with bench/realsize.py (``--genie
--device-only``, ``--layers N`` for a cut), e.g. the Qwen3.5-4B text decoder cut to 4 layers:

    python bench/realsize.py qwen3.5-4b-text W --quant w4-fp16 --device-only --genie \\
        --context 256 --prefill-len 32 --layers 4
    python bench/genie_equal.py W/qwen3.5-4b-text-L4-w4-fp16 --tokens 4

Prints one JSON object: both token lists, whether they are equal, the wall time of each (the
simulator's: it emulates MatMulNBits, minutes a step at these widths) and the Genie folder's
bytes against the target's graphs. Results: docs/genie.md.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--prompt-ids", type=int, default=8, help="a prompt of this many token ids")
    ap.add_argument("--image", type=Path, default=None,
                    help="ask about this picture instead (the Genie pipeline: its image node)")
    ap.add_argument("--audio", type=Path, default=None, help="or about this recording")
    a = ap.parse_args()

    import hexforge

    t = time.perf_counter()
    if a.image or a.audio:  # a text prompt with the medium, through GeniePipeline
        from hexforge.runtime.genie.pipelinemodel import open_genie

        media = dict(images=[str(a.image)] if a.image else None,
                     audios=[str(a.audio)] if a.audio else None)
        prompt: str | list[int] = "Describe it."
        model = open_genie(a.bundle)
    else:
        from hexforge.runtime.genie.model import GenieModel

        media = {}
        prompt = [1000 + 37 * i for i in range(a.prompt_ids)]  # in every seed's vocabulary
        model = GenieModel(a.bundle)
    try:
        genie = model.generate(prompt, max_new_tokens=a.tokens, ignore_eos=True,
                               **media).token_ids
    finally:
        model.close()
    genie_s = time.perf_counter() - t
    t = time.perf_counter()
    model = hexforge.load(a.bundle, backend="qnn-sim")
    sim = model.generate(prompt, max_new_tokens=a.tokens, ignore_eos=True, **media).token_ids
    sim_s = time.perf_counter() - t
    steps = None
    if genie != sim and not media:  # how far below qnn-sim's top Genie's picks sit (a tie?)
        from hexforge.runtime.compare import pick_gaps

        steps = [[round(g, 5), r] for g, r in pick_gaps(model, prompt, genie)]
    print(json.dumps({"bundle": str(a.bundle), "genie": genie, "qnn_sim": sim,
                      "equal": genie == sim, "genie_picks_in_qnn_sim_gap_rank": steps,
                      "genie_s": round(genie_s), "qnn_sim_s": round(sim_s),
                      **folder_bytes(a.bundle)}, indent=1))


if __name__ == "__main__":
    main()
