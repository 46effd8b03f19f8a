"""Genie bundles of every decoder family, split over several contexts, on the x86 simulator.

Each family states its Genie mapping in its own file (``genie_spec`` / ``genie_step``); the
build's oracle drives the Genie binaries from the bundle alone (forge/genie/verify.py) and libGenie
drives them itself. Plumbing on tiny random models: libGenie's greedy tokens equal qnn-sim's on
the same weights, and Genie feeds every input each graph has (an input it does not know it
zero-fills, which a tiny random model can survive token for token: the log is the witness).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import first_difference_is_a_tie, prompt_ids

# family -> the build's options: splits where the family has something to pass between them
FAMILIES = {
    "llama": dict(max_shard_bytes={"v81": 160_000}),  # 3 splits: residual_<b> by name
    "gemma3": {},  # sliding + full layers, two ropes, two cache groups
    # 4 splits: the KV-shared layers' donors in an earlier split than their sharers
    "gemma4": dict(max_shard_bytes={"v81": 260_000}),
    "qwen3_5": dict(max_shard_bytes={"v81": 300_000}),  # linear-attention states, full layers
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def genie_family(request, htp_bundle):
    family = request.param
    return family, htp_bundle(family, "fp16", genie=True, **FAMILIES[family])


def _dialog_log(folder) -> list[str]:
    """Genie's verbose log of a dialog made from ``folder``'s config (and 4 tokens)."""
    from hexforge.runtime.genie import libgenie as genie
    from hexforge.runtime.genie.model import absolute_paths

    cfg = absolute_paths(json.loads((folder / "genie_config.json").read_text()), folder)
    cfg["dialog"]["engine"]["backend"]["QnnHtp"]["poll"] = False
    lines: list[str] = []
    with genie.Dialog(cfg, log_level="verbose", echo=lines.append) as d:
        list(d.generate(prompt_ids(20), 4))
    return lines


def test_genie_tokens_equal_qnn_sim_for_every_family(genie_family):
    """Equal greedy tokens, up to a tie: Genie runs its own binaries (and, for the families
    with Genie's 16-bit embedding LUT, rows rounded unlike the target's fp16 gather), so a pick
    where qnn-sim's top-2 fp16 logits tie may flip (the tiny Gemma-3: margin 0.0005 at its 10th
    token) and the tokens after it are not compared."""
    import hexforge
    from hexforge.runtime.genie.model import GenieModel

    family, bundle = genie_family
    ids = prompt_ids(40)  # past the tiny models' window (8) and the AR-16 prefill
    # Gemma-4's Genie reads its EOS row of the embedding LUT: EOS stays on, both ways
    ignore = family != "gemma4"
    want = hexforge.load(bundle, backend="qnn-sim").generate(
        ids, max_new_tokens=12, ignore_eos=ignore).token_ids
    model = GenieModel(bundle)
    try:
        got = model.generate(ids, max_new_tokens=12, ignore_eos=ignore).token_ids
    finally:
        model.close()
    assert got == want or first_difference_is_a_tie(bundle, ids, got, want), (got, want)


def test_ignore_eos_with_an_embedding_lut_pads_with_a_real_row_not_a_segfault(htp_bundle):
    """Genie pads the last prompt chunk with pad-token, which falls back to eos-token: -1 (how
    EOS is turned off) made libGenie read the LUT's row before the table and segfault, so
    --ignore-eos was refused with a LUT. With pad-token set to a real row it runs: qnn-sim's
    tokens, EOS or not."""
    import hexforge
    from hexforge.runtime.genie.model import GenieModel

    bundle = htp_bundle("gemma4", "fp16", genie=True, **FAMILIES["gemma4"])
    ids = prompt_ids(9)  # one chunk, 7 pad rows
    want = hexforge.load(bundle, backend="qnn-sim").generate(
        ids, max_new_tokens=6, ignore_eos=True).token_ids
    model = GenieModel(bundle)
    try:
        assert model.generate(ids, max_new_tokens=6, ignore_eos=True).token_ids == want
    finally:
        model.close()


def test_genie_feeds_every_input_of_every_split(genie_family):
    """Splits in order by their QNN graph names (renamed after the compile, forge/genie/ctxname.py),
    nothing zero-filled for want of a name Genie knows, no error."""
    _, bundle = genie_family
    folder = bundle / "genie-v81"
    bins = json.loads((folder / "genie_config.json").read_text())[
        "dialog"]["engine"]["model"]["binary"]["ctx-bins"]
    n = len(bins) // 2
    assert bins == [f"{k}_ar{a}_cl128_{i}_of_{n}.bin" for i in range(1, n + 1)
                    for k, a in (("prompt", 16), ("token", 1))]
    log = _dialog_log(folder)
    inserted = [ln for ln in log if "Inserting graph" in ln]
    assert len(inserted) == len(bins)
    for line in inserted:  # "Inserting graph prompt_ar16_cl128_<filler>_2_of_3 as idx 1 ..."
        m = re.search(r"_(\d+)_of_(\d+) as idx (\d+)", line)
        assert m and int(m.group(1)) - 1 == int(m.group(3)) and int(m.group(2)) == n, line
    # Genie logs a linear-attention state as unconnected, then registers it and carries it from
    # _out to _in (measured with dump-tensors): those are fed
    carried = {int(m.group(1)) for ln in log
               if (m := re.search(r"Registered linear attention tensors for layer (\d+)", ln))}
    unfed = [ln for ln in log if "Unconnected input" in ln and not (
        (m := re.search(r'"(?:conv|recurrent)_state_(\d+)_in"', ln)) and int(m.group(1)) in carried)]
    assert not unfed and not [ln for ln in log if ln.startswith("[ERROR]")], unfed


def test_the_oracle_judges_every_familys_genie_binaries(genie_family):
    """The build scores the Genie binaries fed as Genie feeds them, from the bundle's own
    config: the same arithmetic as the v81 target's graphs, so the same KL to a few tens of %."""
    _, bundle = genie_family
    r = json.loads((bundle / "report.json").read_text())
    genie, v81 = r["genie-v81"], r["v81"]
    assert genie["passed"], genie["failures"]
    assert genie["text"]["tokens"] == v81["text"]["tokens"]
    assert genie["text"]["kl_mean"] == pytest.approx(v81["text"]["kl_mean"], rel=0.5, abs=1e-7)


def test_a_wrong_rope_for_genie_is_refused_at_build_time(tmp_path):
    """Genie computes the rope tables from the config: a rope it would compute otherwise than
    HF's inv_freq is refused when the bundle is written, not found as wrong tokens on a phone."""
    import numpy as np
    from safetensors.numpy import save_file

    from hexforge.bundle.errors import BuildError
    from hexforge.families.base import GenieCache, GenieRope, GenieSpec
    from hexforge.forge.genie.decoder import check_ropes

    host = tmp_path / "host.safetensors"
    inv = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    save_file({"rope.default.inv_freq": inv.astype(np.float32)}, str(host))
    good = GenieSpec(caches=(GenieCache("past_", 16),), ropes=(GenieRope("", 8, 10000.0),))
    check_ropes(good, host)
    bad = GenieSpec(caches=(GenieCache("past_", 16),), ropes=(GenieRope("", 8, 500000.0),))
    with pytest.raises(BuildError, match="is not HF's"):
        check_ropes(bad, host)


def test_a_genie_folder_is_no_larger_than_the_target_within_a_stated_margin(genie_family):
    """Genie's contexts hold what the target's graphs hold, once per pass: the AR-N set the
    prefill shards and the head (and, where its graphs gather input_ids, the fp16 token table;
    never a float table: the LUT holds it once, outside), within 10 % and 256 KB a context of
    a compiled graph's own overhead (tiny graphs: ~130 KB). Qwen3.5-4B's real-width cut once
    carried its 2.5 GB fp32 table in each context (3.48 GB against 0.94)."""
    family, bundle = genie_family
    genie, target = bundle / "genie-v81", bundle / "v81"
    manifest = json.loads((bundle / "manifest.json").read_text())
    dialog = json.loads((genie / "genie_config.json").read_text())["dialog"]
    table = 0 if "embedding" in dialog else 2 * manifest["vocab_size"] * manifest["hidden_size"]
    allowed = sum(p.stat().st_size for p in target.glob("*prefill*.bin"))
    allowed += sum(p.stat().st_size for p in target.glob("head*.bin")) + table
    for kind in ("prompt", "token"):
        contexts = list(genie.glob(f"{kind}_*.bin"))
        got = sum(p.stat().st_size for p in contexts)
        assert contexts and got <= 1.1 * allowed + 256 * 1024 * len(contexts), (family, kind, got, allowed)
