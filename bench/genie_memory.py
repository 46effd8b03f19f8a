"""A phone's memory for the seeds' models as Genie folders, computed without building anything.

    python bench/genie_memory.py [--context 4096] [--prefill-len 64] [--json FILE]

For each seed model at its published shape (bench/realshape.py's SHAPES, the shape
bench/realsize.py's MODELS builds) and each recipe (w4-fp16, w8-fp16, fp16), the HF model is made
from its config on the meta device (no weight is allocated; the rotary modules and Gemma's
embedding scales, the only tensors the families read as numbers here, are remade on the cpu)
and hexforge's own code says what a ``--genie --target v81`` build of it would plan:

- splits: ``forge.graphs.plan_genie`` (each context holds its layers, the head on the last split,
  the token table on the first where the graphs gather ``input_ids``: none of these models,
  whose ``genie_spec`` names an embedding LUT), the v81 ceiling 1.8 GB per context.
- a context's bytes: its layers' weight bytes (``fam.layer_weight_bytes`` at the recipe's
  ``bytes_per_weight``) + the head's on the last split, x ``graphs.CONTEXT_OVERHEAD`` (1.04).
  The head is counted at the precision the Genie graph writes it (``QuantRecipe.head_bytes_per_weight``:
  int8 in blocks of 32 under w4-fp16), as the planner counts it.
- contexts without weight sharing: 2 per split (AR-N prefill and AR-1 decode, each holding the
  weights); with ``--share-weights``: 1 per split.
- the embedding LUT (``embedding.u16`` / ``.f32``): vocab + ``genie_bundle.NEVER_ROW`` rows x the
  widths of the host tables ``genie_spec(...).lut`` names (+1 for Qwen3-VL's media flag), the
  widths read from the meta model's tables (Gemma-4: hidden + layers x 256 per-layer inputs);
  2 bytes a value (1 past 4 GiB at 2: ``folder.needs_row_lut``),
  4 where a tower that becomes
  a Genie node proves no bound on its rows
  (``forge/genie/towers.lut_is_fixed_point``: Qwen3-VL's; Gemma-4's towers prove one).
- media nodes (towers that become Genie nodes): the towers' contexts as measured on the v81
  target (docs/notes/realsize.md: Qwen3-VL-2B's vision 829 MB; Gemma-4-E4B's vision + audio 1.48 GB,
  its 6.46 GB v81 target less the 4.98 GB decoder), not the Genie node binaries themselves;
  a shape without a measurement: ``fam.tower_parameters`` x 2 bytes (fp16) x 1.04. Qwen3.5's
  tower makes no node (forge/genie/towers.py leaves it out), so its LUT is 16-bit.
- KV / state at ``--context`` rows, fp16, one set (AR-N and AR-1 read the same buffers): from
  ``fam.state_spec`` -- each kv_full / kv_sliding layer 2 x kv_heads x head_dim x context x 2 B
  (Genie keeps the sliding layers' whole past: docs/genie.md), Gemma-4's KV-shared layers
  nothing (their donors' cache), Qwen3.5's GatedDeltaNet layers their conv fifo and recurrent
  state.

Resident on a phone = the weight-shared contexts + LUT + media nodes + KV (the LUT counted whole:
if Genie maps it from the file only the rows it reads are resident). "Fits" is judged against an
ASSUMPTION, not a measurement or a published figure: one app may hold the phone's RAM less 4 GB
(Android and the other apps), i.e. 8 GB of a 12 GB phone and 12 GB of a 16 GB one.

The largest context is held against v81's 1.8 GB (the planner's ceiling, device-validated on the
seed bundles: targets.py) and the 3.5 GB phones report as a per-context ceiling.

Then the same arithmetic at the shapes of builds that were measured (docs/genie.md), printed
beside the measured sizes; a difference past 10 % is flagged.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from realshape import SHAPES, TOWERS, _cut

GB = 1e9
RECIPES = ("w4-fp16", "w8-fp16", "fp16")
PHONE_RESERVED_GB = 4.0  # ASSUMPTION: Android and other apps hold 4 GB of a phone's RAM
PHONES_GB = (12, 16)
REPORTED_CEILING_GB = 3.5  # the low end of the 3.5-4 GB per-context ceiling phones report
# the towers' v81 contexts as measured (docs/notes/realsize.md), in GB
NODES_MEASURED_GB = {"qwen3-vl-2b-vl": 0.829, "gemma-4-e4b-mm": 6.46 - 4.98}

# (label, realshape shape): the seed models as bench/realsize.py builds them, and the decoders
# alone where realsize has a -text model (a Genie folder without towers: a 16-bit LUT)
MODELS = (
    ("gemma-4-e2b", "gemma-4-e2b"),
    ("gemma-4-e4b (image+audio)", "gemma-4-e4b-mm"),
    ("gemma-4-e4b-text", "gemma-4-e4b"),
    ("qwen3.5-4b (with tower)", "qwen3.5-4b-vl"),
    ("qwen3.5-4b-text", "qwen3.5-4b"),
    ("qwen3-vl-2b (image)", "qwen3-vl-2b-vl"),
)

# measured Genie folders (docs/genie.md "Results"): v81, context 256, AR-32, built before
# plan_genie (their splits: the target's plan), sizes in GB per context (AR-N and AR-1 alike)
MEASURED = (
    # (its LUT as rewritten 8-bit a row, 2,751,473,920 B; the w8 / fp16 builds predate that)
    dict(name="Gemma-4-E2B", shape="gemma-4-e2b", layers=None, quant="w4-fp16",
         contexts=[1.50], lut=2.75,
         cmd="python bench/realsize.py gemma-4-e2b W --quant w4-fp16 --device-only --genie "
             "--context 256 --prefill-len 32"),
    dict(name="Gemma-4-E2B", shape="gemma-4-e2b", layers=None, quant="w8-fp16",
         contexts=[1.03, 1.41], lut=None,
         cmd="python bench/realsize.py gemma-4-e2b W --quant w8-fp16 --device-only --genie "
             "--context 256 --prefill-len 32"),
    dict(name="Gemma-4-E2B", shape="gemma-4-e2b", layers=None, quant="fp16",
         contexts=[1.27, 1.31, 1.99], lut=None,
         cmd="python bench/realsize.py gemma-4-e2b W --quant fp16 --device-only --genie "
             "--context 256 --prefill-len 32"),
    dict(name="Qwen3.5-4B decoder, 4-layer cut", shape="qwen3.5-4b", layers=4, quant="w4-fp16",
         contexts=[0.94], lut=1.27,
         cmd="python bench/realsize.py qwen3.5-4b-text W --quant w4-fp16 --device-only --genie "
             "--context 256 --prefill-len 32 --layers 4"),
)


def meta_model(shape: str, layers: int | None = None):
    """(family, hf on the meta device, Args) for a realshape shape (its first ``layers`` layers)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    from hexforge.families import load_family

    hf_logging.set_verbosity_error()
    cfg = dict(SHAPES[shape])
    model_type = cfg.pop("model_type")
    if layers:
        cfg.update(_cut(cfg, layers))
    ids = dict(bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if shape in TOWERS:
        model_type, towers = TOWERS[shape]
        config = AutoConfig.for_model(model_type, text_config={**cfg, **ids}, **towers,
                                      tie_word_embeddings=cfg["tie_word_embeddings"], **ids)
        auto = AutoModelForImageTextToText
    else:
        config = AutoConfig.for_model(model_type, **ids, **cfg)
        auto = AutoModelForCausalLM
    with torch.device("meta"):
        hf = auto.from_config(config, dtype=torch.bfloat16)
    fam = load_family(config.model_type).FAMILY
    tm = fam.text_model(hf)
    # the only tensors read as numbers (genie_spec, host_tensors): the rotary inv_freq, remade
    # on the cpu, and Gemma's embedding scales (buffers of the float the module keeps)
    tm.rotary_emb = type(tm.rotary_emb)(tm.config)  # outside the meta device
    for m in hf.modules():
        if hasattr(m, "scalar_embed_scale"):
            m.embed_scale = torch.tensor(m.scalar_embed_scale)
    args = fam.Args.from_config(config.to_dict())
    return fam, hf, args


def options(quant: str, context: int, prefill_len: int):
    from hexforge.forge.options import BuildOptions

    return BuildOptions(targets="v81", quant=quant, context=context, prefill_len=prefill_len,
                        genie=True, device_only=True, verify=False)


def contexts(fam, hf, shards, bpw: float, hbpw: float, gather: int) -> list[int]:
    """Each split's context bytes: its layers (+ the head on the last, + the token table on the
    first where the graphs gather it) x CONTEXT_OVERHEAD."""
    from hexforge.forge.export.graphs import CONTEXT_OVERHEAD

    layers = fam.layer_weight_bytes(hf, bpw)
    head = fam.head_weight_bytes(hf, hbpw)
    out = []
    for i, (a, b) in enumerate(shards):
        w = sum(layers[a:b]) + (head if i == len(shards) - 1 else 0) + (gather if i == 0 else 0)
        out.append(int(w * CONTEXT_OVERHEAD))
    return out


def lut_bytes(fam, hf, args, towers: bool) -> tuple[int, int, int, int]:
    """(bytes, rows, width, bytes a value) of Genie's embedding LUT."""
    from hexforge.forge.genie.folder import NEVER_ROW, needs_row_lut

    spec = fam.genie_spec(hf, args)
    if not spec.lut:
        return 0, 0, 0, 0
    host = fam.host_tensors(hf, args)  # the tables are meta tensors: shapes only
    rows = {int(host[name].shape[0]) for name, _ in spec.lut}
    assert len(rows) == 1, rows
    width = sum(int(host[name].shape[1]) for name, _ in spec.lut) + int(spec.media_flag)
    nrows = rows.pop() + NEVER_ROW
    from hexforge.families import encoder_families
    from hexforge.forge.genie.towers import lut_is_fixed_point

    # towers become Genie nodes where the LUT has media rows (a per-layer or flag tail:
    # forge/genie/towers.media_row_tail; Qwen3.5's has none, so its tower makes no node)
    nodes = towers and (spec.media_flag or len(spec.lut) > 1)
    fixed = not nodes or lut_is_fixed_point(encoder_families(hf.config.to_dict()))
    # past 4 GiB at 16 bits, 8 bits a value with a scale a row (folder.needs_row_lut; the
    # scale / offset files, 8 bytes a row, left out)
    value = (1 if needs_row_lut(nrows - NEVER_ROW, width) else 2) if fixed else 4
    return nrows * width * value, nrows, width, value


def state_bytes(fam, args, context: int) -> int:
    """fp16 KV / linear-attention state of one Genie dialog at ``context`` rows."""
    total = 0
    for s in fam.state_spec(args, context):
        if s.kind == "kv_shared":
            continue  # reads its donor's cache
        shape = list(s.shape)
        if s.kind in ("kv_full", "kv_sliding"):
            shape[1] = context  # Genie keeps every layer's whole past (docs/genie.md)
        total += 2 * math.prod(shape)
    return total


def plan(fam, hf, args, quant: str, context: int, prefill_len: int, log=lambda m: None) -> dict:
    from hexforge.bundle.targets import get_target
    from hexforge.forge.export.graphs import plan_genie, plan_target

    target = get_target("v81")
    opts = options(quant, context, prefill_len)
    recipe = opts.recipe
    spec = fam.genie_spec(hf, args)
    gather = 0 if spec.lut else 2 * args.vocab_size * args.hidden_size  # as build_genie_bundles
    msgs: list[str] = []
    shards = plan_genie(fam, hf, target, opts, gather, msgs.append)
    old = plan_target(fam, hf, target, opts, lambda m: None)
    bpw, hbpw = recipe.bytes_per_weight, recipe.head_bytes_per_weight()
    return dict(
        target=target, shards=shards, target_shards=old, log=msgs,
        written=contexts(fam, hf, shards, bpw, hbpw, gather),
        written_target_plan=contexts(fam, hf, old, bpw, hbpw, gather),
    )


def row(label: str, shape: str, quant: str, context: int, prefill_len: int) -> dict:
    from hexforge.forge.export.graphs import CONTEXT_OVERHEAD

    fam, hf, args = meta_model(shape)
    towers = shape in TOWERS
    p = plan(fam, hf, args, quant, context, prefill_len)
    lut, rows, width, value = lut_bytes(fam, hf, args, towers)
    spec = fam.genie_spec(hf, args)
    # a tower becomes a node where a media row can reach the decoder's LUT whole
    # (genie_pipeline.media_row_tail: a media flag or the per-layer columns)
    nodes = 0
    if towers and (spec.media_flag or len(spec.lut) > 1):
        nodes = int(NODES_MEASURED_GB[shape] * GB if shape in NODES_MEASURED_GB
                    else 2 * fam.tower_parameters(hf) * CONTEXT_OVERHEAD)
    kv = state_bytes(fam, args, context)
    shared = sum(p["written"])
    resident = shared + lut + nodes + kv
    largest = max(p["written"])
    out = dict(
        model=label, shape=shape, quant=quant, context=context,
        splits=[list(s) for s in p["shards"]], target_splits=[list(s) for s in p["target_shards"]],
        contexts_gb=[round(b / GB, 3) for b in p["written"]],
        unshared_gb=round(2 * shared / GB, 3), shared_gb=round(shared / GB, 3),
        largest_context_gb=round(largest / GB, 3),
        under_ceiling=largest <= p["target"].max_context_bytes,
        under_reported=largest <= REPORTED_CEILING_GB * GB,
        lut_gb=round(lut / GB, 3), lut_shape=[rows, width], lut_bytes_per_value=value,
        nodes_gb=round(nodes / GB, 3), kv_gb=round(kv / GB, 3),
        resident_shared_gb=round(resident / GB, 3),
        resident_unshared_gb=round((resident + shared) / GB, 3),
        folder_gb=round((2 * shared + lut + nodes) / GB, 3),
        folder_shared_gb=round((shared + lut + nodes) / GB, 3),
        planner_log=p["log"],
    )
    for ram in PHONES_GB:
        out[f"fits_{ram}gb"] = resident <= (ram - PHONE_RESERVED_GB) * GB
    return out


def validate(context: int = 256, prefill_len: int = 32) -> list[dict]:
    out = []
    for m in MEASURED:
        fam, hf, args = meta_model(m["shape"], m["layers"])
        p = plan(fam, hf, args, m["quant"], context, prefill_len)
        lut = lut_bytes(fam, hf, args, m["shape"] in TOWERS)[0] / GB
        # the measured builds split as the target's plan did (they predate plan_genie)
        pred = [b / GB for b in p["written_target_plan"]]
        diffs = [(q - g) / g for q, g in zip(pred, m["contexts"], strict=False)]
        out.append(dict(
            name=m["name"], quant=m["quant"], cmd=m["cmd"],
            measured_contexts_gb=m["contexts"],
            predicted_contexts_gb=[round(x, 3) for x in pred],
            splits_then=[list(s) for s in p["target_shards"]],
            splits_now=[list(s) for s in p["shards"]],
            contexts_now_gb=[round(b / GB, 3) for b in p["written"]],
            same_split_count=len(pred) == len(m["contexts"]),
            diff=[round(d, 3) for d in diffs],
            measured_lut_gb=m["lut"], predicted_lut_gb=round(lut, 3),
            lut_diff=None if m["lut"] is None else round((lut - m["lut"]) / m["lut"], 3),
        ))
    return out


def gb(x: float) -> str:
    return f"{x:.2f}"


def table(rows: list[dict]) -> str:
    head = ("| model | quant | splits (plan_genie) | contexts, GB each | largest vs 1.8 / 3.5 GB "
            "| contexts in all: unshared / shared, GB | LUT, GB | media nodes, GB "
            "| folder: unshared / shared, GB | KV, GB | resident (shared), GB | fits 12 GB "
            "| fits 16 GB |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        spans = " ".join(f"[{a},{b})" for a, b in r["splits"])
        ctx = " / ".join(gb(x) for x in r["contexts_gb"])
        mark = ("under both" if r["under_ceiling"] else
                "over 1.8, under 3.5" if r["under_reported"] else "over both")
        lut = (f"{gb(r['lut_gb'])} ({r['lut_shape'][0]:,} x {r['lut_shape'][1]:,} x "
               f"{r['lut_bytes_per_value']})")
        lines.append(
            f"| {r['model']} | {r['quant']} | {len(r['splits'])}: {spans} | {ctx} "
            f"| {gb(r['largest_context_gb'])} {mark} | {gb(r['unshared_gb'])} / {gb(r['shared_gb'])} "
            f"| {lut} | {gb(r['nodes_gb'])} | {gb(r['folder_gb'])} / {gb(r['folder_shared_gb'])} "
            f"| {gb(r['kv_gb'])} | {gb(r['resident_shared_gb'])} "
            f"| {'yes' if r['fits_12gb'] else 'no'} | {'yes' if r['fits_16gb'] else 'no'} |")
    return "\n".join(lines)


def validation_text(vals: list[dict]) -> str:
    lines = ["| measured build (v81, context 256, AR-32) | splits then / now | contexts measured, "
             "GB | predicted | diff | LUT measured / predicted |",
             "|---|---|---|---|---|---|"]
    notes = []
    for v in vals:
        flag = [f"{d:+.0%}" + (" **>10 %**" if abs(d) > 0.10 else "") for d in v["diff"]]
        then = " ".join(f"[{a},{b})" for a, b in v["splits_then"])
        now = " ".join(f"[{a},{b})" for a, b in v["splits_now"])
        lines.append(
            f"| {v['name']} {v['quant']} | {then} / {now} "
            f"| {' / '.join(gb(x) for x in v['measured_contexts_gb'])} "
            f"| {' / '.join(gb(x) for x in v['predicted_contexts_gb'])} "
            f"| {' / '.join(flag)} | {v['measured_lut_gb'] or 'not rebuilt'} / "
            f"{gb(v['predicted_lut_gb'])}"
            + ("" if v["lut_diff"] is None else f" ({v['lut_diff']:+.0%})") + " |")
        if not v["same_split_count"]:
            notes.append(f"{v['name']} {v['quant']}: the target's plan gives "
                         f"{len(v['splits_then'])} splits, the build made "
                         f"{len(v['measured_contexts_gb'])}")
        if any(abs(d) > 0.10 for d in v["diff"]):
            notes.append(f"{v['name']} {v['quant']}: over 10 % apart ({' / '.join(flag)})")
        if v["lut_diff"] is not None and abs(v["lut_diff"]) > 0.10:
            notes.append(f"{v['name']} {v['quant']}: the LUT is {v['lut_diff']:+.0%} off")
    if not notes:
        notes.append("every prediction within 10 % of the measured size")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-validate", action="store_true")
    a = ap.parse_args()
    rows = [row(label, shape, q, a.context, a.prefill_len)
            for label, shape in MODELS for q in RECIPES]
    print(f"v81, context {a.context}; fits: RAM less {PHONE_RESERVED_GB:g} GB for Android and "
          "other apps (an assumption)\n")
    print(table(rows))
    for r in rows:
        for m in r["planner_log"]:
            print(f"  {r['model']} {r['quant']}: {m}")
    vals = [] if a.no_validate else validate()
    if vals:
        print("\nAgainst measured Genie folders (docs/genie.md; built before plan_genie, so "
              "split as the target's plan):\n")
        print(validation_text(vals))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "validation": vals}, indent=1))


if __name__ == "__main__":
    main()
