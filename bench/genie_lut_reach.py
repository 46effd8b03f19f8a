"""How far into its embedding LUT libGenie reads right: a tiny Gemma-4 whose Genie LUT passes
2^31 bytes, asked prompts that end in ids whose rows start below and past that offset, through
libGenie and ``--backend qnn-sim`` on the same bundle (random weights: plumbing, not accuracy).

    python bench/genie_lut_reach.py WORK [--per-layer 416]

Gemma-4-E2B's LUT is 262,144 rows x 10,496 uint16 ([token embedding | 35 x 256 per-layer
inputs], 20,992 B a row: 5.5 GB), and there libGenie left qnn-sim's tokens for prompts holding
high ids. This rebuilds that reach in minutes: the tiny fixture (10 layers, hidden 64) with the
real vocabulary (262,144 rows, for the token and the per-layer tables) and per-layer inputs
``--per-layer`` wide, so a row is 64 + 10 x P values; at P = 416, 8,448 B, the LUT 2.2 GB and
the rows of ids >= 254,201 start past 2^31 bytes. Prints one JSON line per prompt.

Measured (libGenie 1.21, QNN 2.51): P = 416 (LUT 2.2 GB) every prompt equal, rows past 2^31
bytes too; P = 832 (4.4 GB at 16 bits) as E2B: the first token equal, then other tokens and
"T2E conversion overflow", a prompt ending in id 200000 refused (error -1) -- until the build
wrote such a LUT 8-bit with a scale a row (2.2 GB; forge/genie/folder.needs_row_lut). Built with
--genie-host-rows, so both backends run the same 8-bit rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB = 262_144  # Gemma-4's (token and per-layer tables)


def checkpoint(work: Path, per_layer: int) -> Path:
    """The tiny Gemma-4 at the real vocabulary, bf16 (its per-layer table is VOCAB x 10 x P)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hexforge.forge.source.tiny import make_tiny_checkpoint

    ckpt = work / "ckpt"
    if (ckpt / "model.safetensors").exists() and (ckpt / "wide").exists():
        return ckpt
    make_tiny_checkpoint("gemma4", ckpt, seed=5)  # its tokenizer and generation config
    cfg = AutoConfig.from_pretrained(ckpt)
    cfg.vocab_size = cfg.vocab_size_per_layer_input = VOCAB
    cfg.hidden_size_per_layer_input = per_layer
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(ckpt, safe_serialization=True)
    (ckpt / "wide").write_text(f"{per_layer}\n")
    return ckpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--per-layer", type=int, default=416, help="hidden_size_per_layer_input")
    ap.add_argument("--tokens", type=int, default=4)
    a = ap.parse_args()

    import hexforge
    from hexforge.forge.options import BuildOptions
    from hexforge.forge.pipeline import build
    from hexforge.runtime.compare import pick_gaps
    from hexforge.runtime.genie.model import GenieModel

    a.work.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(a.work, a.per_layer)
    bundle = a.work / "b"
    if not (bundle / "manifest.json").exists():
        build(ckpt, bundle, BuildOptions(targets="v81", quant="fp16", context=64, prefill_len=16,
                                         genie=True, verify=False, device_only=True,
                                         genie_host_rows=True), log=print)
    emb = json.loads((bundle / "genie-v81" / "genie_config.json").read_text())["dialog"]["embedding"]
    lut = bundle / "genie-v81" / emb["lut-path"]
    row = lut.stat().st_size // (VOCAB + 1)
    print(json.dumps({"lut": emb["lut-path"], "datatype": emb["datatype"],
                      "lut_bytes": lut.stat().st_size, "row_bytes": row}), flush=True)
    sim = hexforge.load(bundle, backend="qnn-sim")
    genie = GenieModel(bundle, log_level="error")
    try:
        for last in (1000, 200_000, (2**31) // row + 1, VOCAB - 100):
            prompt = [1000 + 37 * i for i in range(7)] + [last]
            want = sim.generate(prompt, max_new_tokens=a.tokens, ignore_eos=True).token_ids
            try:
                got = genie.generate(prompt, max_new_tokens=a.tokens, ignore_eos=True).token_ids
            except Exception as e:  # what libGenie said is the finding
                got = f"{type(e).__name__}: {e}"
            gaps = pick_gaps(sim, prompt, got) if isinstance(got, list) and got != want else []
            print(json.dumps({"last_id": last, "row_offset_bytes": last * row,
                              "past_2^31": last * row >= 2**31, "genie": got, "qnn_sim": want,
                              "equal": got == want,
                              "genie_picks_in_qnn_sim_gap_rank": [
                                  [round(g, 5), r] for g, r, _ in gaps]}), flush=True)
    finally:
        genie.close()


if __name__ == "__main__":
    main()
