"""Genie conformance across each family's configuration space, not one fixture a family: the
fixed matrix of bench/genie_conformance.py (several tiny configurations per family: head dims and
KV heads, windows shorter and longer than the prompt, rotary fractions and M-RoPE sections, tied
and untied heads, KV-sharing counts, per-layer inputs or none, splits, square and non-square
images, a recording; prompts through the AR-1 graphs alone), each
built with --genie and asked prompts around the prefill length and the longest one Genie's
prefill takes: libGenie's greedy tokens equal qnn-sim's on the same bundle (a media prompt's
picks are checked on Genie's own prefix, a near-tie flip being rounding). Plumbing on random
weights (both run the same weights); bench/genie_conformance.py draws new configurations at
random for longer runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "genie_conformance.py"


def _bench():
    spec = importlib.util.spec_from_file_location("genie_conformance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


@pytest.mark.parametrize("variant", BENCH.MATRIX, ids=[v.name for v in BENCH.MATRIX])
def test_genie_equals_qnn_sim_on_each_configuration(variant, tmp_path):
    bundle = BENCH.build_variant(variant, tmp_path)
    assert BENCH.compare(bundle, variant, tmp_path) == []


def test_the_matrix_covers_each_genie_family_several_times():
    from collections import Counter

    per = Counter(v.family if v.family != "qwen3" else "llama" for v in BENCH.MATRIX)
    assert all(per[f] >= 2 for f in ("llama", "gemma3", "gemma4", "qwen3_5")), per
    assert per["qwen3_vl"] >= 1 and per["gemma4_mm"] >= 1


def test_a_media_pick_a_step_or_two_below_is_rounding_one_far_below_is_a_fault():
    """The media prompts' rule (``runtime.compare.departs_on_own_prefix``): each Genie pick
    seen by qnn-sim on Genie's own prefix. A tiny Gemma-4 pipeline (seed 3, a 60 x 150 image)
    picked 0.0039 below qnn-sim's top at 3.36 (two fp16 steps: its image rows in the 16-bit
    LUT's encoding) and qnn-sim's top at every other step; a row read wrong puts a pick far
    below."""
    from hexforge.runtime.compare import departs_on_own_prefix

    step = 2.0 ** -9  # one fp16 step for logits in [2, 4)
    measured = [(0.0, 1, step)] * 3 + [(0.00391, 2, step)] + [(0.0, 1, step)] * 6
    assert departs_on_own_prefix(measured) is None
    assert departs_on_own_prefix([*measured, (0.07, 2, step)]) == 10
    assert departs_on_own_prefix([(0.0, 1, step), (1.3, 118_266, step)]) == 1
