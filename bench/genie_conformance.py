"""Genie conformance beyond the suite's fixtures: many tiny configurations per family, each built
with ``--genie`` and run through libGenie and ``--backend qnn-sim`` on the same bundle; their
greedy tokens must be equal (both run the same weights, so this is plumbing, never numerics).

    python bench/genie_conformance.py WORK [--draws 20] [--seed 0] [--family gemma4 ...]
    python bench/genie_conformance.py WORK --fixed       # the suite's matrix (MATRIX below)

Each configuration varies the axes a family's Genie mapping depends on — head dims and KV heads,
windows shorter and longer than the prompt, rotary fractions and M-RoPE sections, tied and
untied heads, KV-sharing counts, per-layer inputs, splits, image sizes (square and not),
recording lengths, the AR-1 graphs alone (``--prefill-mode decode``) — and each bundle is
asked prompts around the prefill length and up to the most Genie's prefill takes
(CL - N + 1, ``runtime/genie/checks.check_prompt_fits``). tests/test_genie_conformance.py runs
MATRIX; this script draws new configurations at random for longer runs and prints each one's
overrides, so a failing draw is a command to rerun.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTEXT, PREFILL = 128, 16
NEW_TOKENS = 10


@dataclass(frozen=True)
class Variant:
    """One tiny configuration: ``family`` (a hexforge.forge.source.tiny TINY_CONFIGS key), its seed, config
    overrides and build options beyond the fixed ones (fp16, v81, --genie, --no-verify,
    --device-only)."""

    name: str
    family: str
    seed: int = 0
    config: dict = field(default_factory=dict)
    build: dict = field(default_factory=dict)
    image: tuple[int, int] | None = None  # (H, W) of a PNG asked about (pipeline families)
    audio: float | None = None  # seconds of a 44.1 kHz chirp asked about (families with audio)
    # "decode": both sides run the AR-1 graphs alone (the Genie dialog its AR-1 contexts, qnn-sim
    # no prefill graph), the road of a model whose two graph sets pass the x86 simulator's room
    prefill_mode: str = "chunked"


def _qwen35_rope(partial: float, section: list[int], theta: float = 1e7) -> dict:
    return dict(rope_type="default", rope_theta=theta, partial_rotary_factor=partial,
                mrope_interleaved=True, mrope_section=section)


# The suite's matrix: several configurations per family, each varying several axes at once
# (a tiny fp16 build is 6-20 s here; each bundle answers 4 prompts both ways)
MATRIX: tuple[Variant, ...] = (
    Variant("llama-mqa-hd32-3splits", "llama", 1,
            dict(num_key_value_heads=1, head_dim=32), dict(max_shard_bytes={"v81": 160_000})),
    Variant("llama-llama3-rope", "llama", 2,
            dict(num_attention_heads=8, num_key_value_heads=8, rope_theta=500000.0,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=64))),
    Variant("qwen3-tied-mha-hd16", "qwen3", 1, dict(num_key_value_heads=4, head_dim=16)),
    Variant("gemma3-window64-kv2", "gemma3", 1,
            dict(sliding_window=64, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32)),
    Variant("gemma3-window4-2splits", "gemma3", 2, dict(sliding_window=4),
            dict(max_shard_bytes={"v81": 200_000})),
    # seed 1: Genie truncated Gemma-4's fractional rope theta (31.62 -> 31) and left qnn-sim's
    # tokens at the first one (the regression this matrix was started for)
    Variant("gemma4-seed1", "gemma4", 1),
    Variant("gemma4-noPLE-noshare-window512-ghd64", "gemma4", 2,
            dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, sliding_window=512,
                 global_head_dim=64)),
    Variant("gemma4-share2-kv2-2splits", "gemma4", 3,
            dict(num_kv_shared_layers=2, num_key_value_heads=2),
            dict(max_shard_bytes={"v81": 400_000})),
    Variant("qwen3_5-full-rotary", "qwen3_5", 2, dict(rope_parameters=_qwen35_rope(1.0, [8, 4, 4]))),
    Variant("qwen3_5-4x4-linear-heads-2splits", "qwen3_5", 3,
            dict(linear_num_key_heads=4, linear_num_value_heads=4, head_dim=16,
                 rope_parameters=_qwen35_rope(0.5, [2, 1, 1])),
            dict(max_shard_bytes={"v81": 300_000})),
    Variant("qwen3_vl-seed1-64x96-image", "qwen3_vl", 1, build=dict(image_size=(64, 96)),
            image=(45, 83)),
    # one soft token: Genie left the deepstack inputs' text rows unwritten (up to 2e34) and the
    # tokens differed from the first, until the graph gated them by the LUT's media flag
    Variant("qwen3_vl-seed1-32x32-one-soft-token", "qwen3_vl", 1,
            build=dict(image_size=(32, 32)), image=(45, 83)),
    # 40 image rows over AR-32 chunks, deepstack layers in splits 1 and 2 (the flag rides the
    # residual); deepstack inputs of one image's rows (16) made libGenie abort the process
    # ("Requested tensor segment of 45 entries, which exceeds ... 16") until they took AR rows
    Variant("qwen3_vl-4splits-ar32-40-row-image", "qwen3_vl", 1,
            build=dict(image_size=(128, 320), prefill_len=32, max_shard_bytes={"v81": 110_000}),
            image=(90, 150)),
    # image and audio rows in the 16-bit LUT's encoding (a node's converted by Genie, the
    # host's quantized: a float32 row set on it read as codes, audio differed from token 1)
    Variant("gemma4_mm-seed2-tall-image-2.6s-audio", "gemma4_mm", 2,
            build=dict(audio_seconds=4.0), image=(150, 60), audio=2.6),
    # the AR-1 graphs alone, as Gemma-4-E4B and Qwen3.5-4B run on the simulator (issue 75):
    # prompts (up to the context's end) a token a step, Genie given the AR-1 contexts only
    Variant("gemma4-ar1-only-share2-2splits", "gemma4", 4, dict(num_kv_shared_layers=2),
            dict(max_shard_bytes={"v81": 400_000}), prefill_mode="decode"),
    Variant("qwen3_5-ar1-only", "qwen3_5", 4, prefill_mode="decode"),
    Variant("gemma4_mm-ar1-only-wide-image", "gemma4_mm", 3, image=(60, 150),
            prefill_mode="decode"),
)


def draw(family: str, rng: random.Random, index: int) -> Variant:
    """A random configuration of ``family`` (the axes its Genie mapping depends on)."""
    seed = rng.randrange(1000)
    kv = rng.choice([1, 2, 4])
    build: dict = {}
    if rng.random() < 0.4:
        build["max_shard_bytes"] = {"v81": rng.choice([150_000, 250_000, 400_000])}
    if family in ("llama", "qwen3", "qwen2"):
        cfg = dict(num_key_value_heads=kv, head_dim=rng.choice([16, 32]),
                   tie_word_embeddings=rng.random() < 0.5)
    elif family == "gemma3":
        cfg = dict(num_key_value_heads=kv, head_dim=rng.choice([16, 32]),
                   sliding_window=rng.choice([4, 8, 24, 64, 512]))
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    elif family == "gemma4":
        layers = 10
        cfg = dict(num_key_value_heads=rng.choice([1, 2]), head_dim=rng.choice([16, 32]),
                   global_head_dim=rng.choice([32, 64]),
                   hidden_size_per_layer_input=rng.choice([0, 8]),
                   num_kv_shared_layers=rng.choice([0, 2, 4]),
                   sliding_window=rng.choice([4, 8, 24, 512]), num_hidden_layers=layers)
    elif family == "qwen3_5":
        partial = rng.choice([0.25, 0.5, 1.0])
        cfg = dict(num_key_value_heads=rng.choice([1, 2, 4]), head_dim=rng.choice([16, 32]),
                   linear_num_key_heads=rng.choice([1, 2]), linear_num_value_heads=4,
                   rope_parameters=_qwen35_rope(partial, [2, 1, 1]))
        rot = int(cfg["head_dim"] * partial) // 2
        cfg["rope_parameters"]["mrope_section"] = [rot - 2 * (rot // 4), rot // 4, rot // 4]
    elif family == "gemma4_mm":
        return Variant(f"{family}-draw{index}-seed{seed}", family, seed,
                       build=dict(audio_seconds=rng.choice([2.0, 4.0, 6.0])),
                       image=(rng.randrange(20, 200), rng.randrange(20, 200)),
                       audio=round(rng.uniform(0.3, 2.0), 2))
    elif family == "qwen3_vl":
        h, w = rng.choice([(32, 32), (64, 96), (96, 64), (128, 160)])
        return Variant(f"{family}-draw{index}-seed{seed}", family, seed,
                       build=dict(image_size=(h, w)),
                       image=(rng.randrange(20, 200), rng.randrange(20, 200)))
    else:
        raise SystemExit(f"no drawer for {family}")
    return Variant(f"{family}-draw{index}-seed{seed}", family, seed, cfg, build)


def build_variant(v: Variant, folder: Path) -> Path:
    """The variant's checkpoint and bundle under ``folder`` -> the bundle."""
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    ckpt = folder / "ckpt"
    if not (ckpt / "config.json").exists():
        make_tiny_checkpoint(v.family, ckpt, seed=v.seed, **v.config)
    # device-only: both sides run the HTP's binaries, no cpu graphs are read
    opts = BuildOptions(**(dict(targets="v81", quant="fp16", context=CONTEXT, prefill_len=PREFILL,
                                genie=True, verify=False, device_only=True) | v.build))
    build(ckpt, folder / "b", opts, log=lambda m: None)
    return folder / "b"


def prompt_lengths(context: int, prefill: int) -> list[int]:
    """Short, around the prefill length, and the longest prompt Genie's prefill takes (CL - N + 1),
    whose answer runs on towards the context's end."""
    return [5, prefill, prefill + 1, context - prefill + 1]


def ids_of(n: int, vocab: int, seed: int = 0) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed + n)
    return [int(t) for t in rng.integers(3, vocab, size=n)]


def compare(bundle: Path, v: Variant, work: Path) -> list[str]:
    """libGenie vs qnn-sim on the bundle -> a line for each prompt whose tokens differ.

    The two run different binaries of the same weights (the target's graphs, the Genie ones),
    so a greedy pick may flip where qnn-sim's top two logits tie in fp16 (measured: margin 0.0
    at the flip); such a flip is reported as a tie, not a difference, and the tokens after it
    are not compared (their prefixes differ)."""
    import hexforge
    from hexforge.runtime.compare import (
        departs_on_own_prefix,
        differs_past_ties,
        greedy_margins,
        pick_gaps,
    )
    from hexforge.runtime.genie.model import GenieModel

    sim = hexforge.load(bundle, backend="qnn-sim", prefill_mode=v.prefill_mode)
    bad = []
    media = ([("images", v.image, _png(work, v.image))] if v.image is not None else []) + \
        ([("audios", v.audio, _wav(work, v.audio))] if v.audio is not None else [])
    if media:
        from hexforge.runtime.genie.pipelinemodel import open_genie

        model = open_genie(bundle, log_level="error", prefill_mode=v.prefill_mode)
        try:
            for kind, size, item in media:
                ask = {kind: [str(item)]}
                want = sim.generate("Describe it.", max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                    **ask).token_ids
                got = model.generate("Describe it.", max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                     **ask).token_ids
                if got == want:
                    continue
                # qnn-sim's view of each Genie pick on Genie's own prefix: a flip at a near-tie
                # is rounding, a pick far below is a contract fault
                gaps = pick_gaps(sim, "Describe it.", got, **ask)
                i = departs_on_own_prefix(gaps)
                if i is not None:
                    bad.append(f"{v.name} {kind} {size}: genie {got} != qnn-sim {want} (Genie's "
                               f"pick {i} is {gaps[i][0]:.4f} below qnn-sim's top on its prefix, "
                               f"rank {gaps[i][1]})")
        finally:
            model.close()
        return bad
    genie = GenieModel(bundle, log_level="error", prefill_mode=v.prefill_mode)
    # a Genie embedding LUT reads its EOS row: EOS stays on there (GenieModel refuses
    # ignore_eos), and both answers end before it
    ignore = not (bundle / "genie-v81" / "embedding.u16").exists()
    try:
        lengths = prompt_lengths(CONTEXT, v.build.get("prefill_len", PREFILL))
        if v.prefill_mode == "decode":  # no AR-N limit: a prompt up to its answer's room
            lengths[-1] = CONTEXT - NEW_TOKENS
        for n in lengths:
            ids = ids_of(n, 384)  # the tiny tokenizers' vocabulary
            want, margins = greedy_margins(sim, ids, NEW_TOKENS, None if ignore else genie.eos)
            got = genie.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=ignore).token_ids
            i = differs_past_ties(got, want, margins)  # a flip at a top-2 tie is no difference
            if i is not None:
                bad.append(f"{v.name} prompt {n}: genie {got} != qnn-sim {want} (from token "
                           f"{i}, qnn-sim's top-2 margin there "
                           f"{margins[i] if i < len(margins) else None})")
    finally:
        genie.close()
    return bad


def _png(work: Path, hw: tuple[int, int]) -> Path:
    import numpy as np
    from PIL import Image

    path = work / f"image-{hw[0]}x{hw[1]}.png"
    if not path.exists():
        rng = np.random.default_rng(hw[0] * 1000 + hw[1])
        Image.fromarray((rng.random((*hw, 3)) * 255).astype(np.uint8)).save(path)
    return path


def _wav(work: Path, seconds: float) -> Path:
    import numpy as np
    import soundfile as sf

    path = work / f"chirp-{seconds}s.wav"
    if not path.exists():
        t = np.arange(int(44100 * seconds)) / 44100
        sf.write(path, 0.4 * np.sin(2 * np.pi * (300 + 400 * t) * t), 44100, subtype="PCM_16")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--fixed", action="store_true", help="the suite's MATRIX, not random draws")
    ap.add_argument("--draws", type=int, default=10, help="random configurations a family")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", action="append",
                    help="llama, qwen3, gemma3, gemma4, qwen3_5, qwen3_vl, gemma4_mm (default: all)")
    a = ap.parse_args()
    from hexforge.bundle.errors import BuildError

    families = a.family or ["llama", "qwen3", "gemma3", "gemma4", "qwen3_5", "qwen3_vl",
                            "gemma4_mm"]
    rng = random.Random(a.seed)
    variants = (list(MATRIX) if a.fixed else
                [draw(f, rng, i) for i in range(a.draws) for f in families])
    failed = skipped = 0
    for v in variants:
        folder = a.work / v.name
        t0 = time.perf_counter()
        try:
            if not (folder / "ckpt" / "config.json").exists():
                from hexforge.forge.source.tiny import make_tiny_checkpoint

                make_tiny_checkpoint(v.family, folder / "ckpt", seed=v.seed, **v.config)
        except Exception as e:  # a draw HF's own model refuses (e.g. KV sharing without PLE)
            skipped += 1
            print(f"SKIP   {v.name}: HF refuses the config ({type(e).__name__}: {e})"[:300])
            continue
        try:
            bundle = build_variant(v, folder) if not (folder / "b").exists() else folder / "b"
        except BuildError as e:  # a one-line refusal (a split smaller than a layer ...)
            skipped += 1
            print(f"SKIP   {v.name}: the build refuses it ({e})"[:300])
            continue
        try:
            bad = compare(bundle, v, a.work)
        except Exception as e:  # an error running it is a finding: print it
            bad = [f"{v.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"]
        failed += bool(bad)
        status = "equal" if not bad else "DIFFER"
        print(f"{status:6s} {v.name} ({time.perf_counter() - t0:.0f} s) "
              f"config={json.dumps(v.config)} build={json.dumps(v.build, default=str)}",
              flush=True)
        for line in bad:
            print("   ", line, flush=True)
    print(f"{len(variants) - failed - skipped} of {len(variants) - skipped} configurations: "
          f"libGenie = qnn-sim ({skipped} draws refused by HF or the build)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
