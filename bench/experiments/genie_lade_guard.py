"""A prototype: Genie's lookahead dialog (``lade``) giving ``basic``'s tokens, by a graph that
undoes libGenie 1.21's warm-up commit itself (tiny llama, one split; not a build option).

    python bench/experiments/genie_lade_guard.py WORK [--lade 3,3,3] [--ids 5,6,7,8,9,332,12]

On the scatter form (``--genie-kv scatter``) libGenie keeps a lade step's rejected rows out of
the next step's mask, but commits its first (warm-up) step whole: window rows and placeholder
guesses stay in every later step's context, its first token fed again after them, rope
positions counted over them (docs/notes/genie-record.md, "lade"). The graph here (``GuardStep``):

- keeps metadata of every row in one more cache layer of the group (``past_key_<L>`` /
  ``past_value_<L>``, L = the layer count; Genie copies its rows to their slots like any
  layer's): the slot its step started at, the step's real rows, whether they form one chain
  (row r attends rows 0..r of the step), a written flag;
- masks as garbage every slot of a step whose rows are all attended while not forming a chain:
  accepted rows are a chain, so only the warm-up is ever attended whole with branches;
- computes the rope itself from its own positions (past slots kept + the rows of the step a row
  attends - 1), Genie's ``position_ids_cos/_sin`` read only to keep them inputs.

The check: the context the graph ran each lade call on (Genie's mask less the garbage, read off
the dump with the metadata), against the prompt + qnn-sim's greedy tokens, a difference at a
top-2 tie of qnn-sim's fp16 logits not counted (``runtime.compare``'s rule).
Open for a build option: several splits (the metadata and positions from split 1 to the
others), the oracle's emulator, the rope as an fp32 table gathered by position (``cos``/``sin``
of positions x inv_freq in the graph lose precision at long contexts in fp16).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from hexforge.families.genieio import MASKED, DenseGenieStep, GenieContract

THETA = 10000.0  # the tiny llama's rope theta


class GuardStep(DenseGenieStep):
    """The scatter-form dense step with the warm-up guard (the module docstring)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.L = self.shard.layer_ids[-1] + 1
        D = self.head_dim
        self.io.inputs += [(f"past_key_{self.L}_in", "meta.k"),
                           (f"past_value_{self.L}_in", "meta.v")]
        self.io.outputs += [(f"past_key_{self.L}_out", "meta.k"),
                            (f"past_value_{self.L}_out", "meta.v")]
        R = D // 2
        inv = THETA ** (-torch.arange(R, dtype=torch.float32) / R)
        self.register_buffer("inv", inv[None], persistent=False)
        self.register_buffer("tri", torch.tril(torch.ones(self.T, self.T)), persistent=False)

    def example_inputs(self):
        ex = list(super().example_inputs())
        D, S = self.head_dim, self.S
        return (*ex, torch.zeros(1, 1, D, S), torch.zeros(1, 1, S, D))

    def forward(self, tokens, mask, cos, sin, index, *rest):
        past, mk, mv = rest[:-2], rest[-2], rest[-1]
        T, D = self.T, self.head_dim
        meta = mv[0, 0]  # [CL, D]: start, count, chain, written
        start, count, chain, written = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3]
        onehot = (index.transpose(0, 1) == self.slots).to(torch.float32)  # [T, CL]
        taken = onehot.sum(0)  # [CL]
        # the past slots row 0 attends that hold metadata ((written > 0.5): a dirty slot's NaN
        # must not reach a product)
        A = ((mask[0, 0, 0] > -1.0).to(torch.float32) * (1.0 - taken.clamp(max=1.0))
             * (written > 0.5).to(torch.float32))  # [CL]
        same = (start[:, None] == start[None, :]).to(torch.float32)  # [CL, CL]
        cnt = torch.matmul(same, A[:, None])[:, 0]  # attended rows of each slot's step
        garbage = A * (cnt > count - 0.5).to(torch.float32) * (chain < 0.5).to(torch.float32) \
            * (count > 1.5).to(torch.float32)
        keep = A - garbage  # [CL]
        n_valid = keep.sum()
        # this step's rows
        real = ((mask[0, 0] > -1.0).to(torch.float32).sum(-1) > 0.5).to(torch.float32)  # [T]
        newm = (torch.matmul(mask[0, 0], onehot.transpose(0, 1)) > -1.0).to(torch.float32)  # [T, T]
        depth = newm.sum(-1)  # rows of this step each attends (itself included)
        pos = n_valid + depth - 1.0  # [T]
        ang = pos[:, None] * self.inv  # [T, R]
        cos2, sin2 = torch.cos(ang)[None, None], torch.sin(ang)[None, None]
        gmask = torch.where((garbage > 0.5)[None, None, None, :], torch.full_like(mask, MASKED),
                            mask)
        out = super().forward(tokens, gmask, cos2, sin2, index, *past)
        # metadata of this step's rows
        n_real = real.sum()
        first = index[0, 0].to(torch.float32)
        # chain: row r attends exactly rows 0..r (over real rows)
        chain_rows = self.tri * real[:, None] * real[None, :]
        is_chain = ((newm - chain_rows).abs().sum() < 0.5).to(torch.float32)
        row = torch.stack([first.expand(T), n_real.expand(T), is_chain.expand(T), torch.ones(T)],
                          -1)  # [T, 4]
        # Genie's rope and the metadata keys, read (an unread input is dropped at export)
        z = (cos.sum() + sin.sum() + (mk > 1e30).to(torch.float32).sum()) * 0.0
        row = torch.cat([row, torch.zeros(T, D - 4)], -1)[None, None] + z  # [1, 1, T, D]
        return (*out, row.transpose(2, 3) + 0.0, row)


def build(work: Path) -> Path:
    """The tiny llama (seed 0) with ``GuardStep`` as its scatter-form Genie step -> bundle."""
    import hexforge.forge.genie.decoder as forge_genie
    from hexforge.forge.pipeline import BuildOptions
    from hexforge.forge.pipeline import build as build_bundle
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    contract = GenieContract(cache_index=True)

    def step(fam):
        return lambda hf, args, host, layers, seq_len, context, scale: GuardStep.make(
            fam, hf, args, host, layers, seq_len, context, contract, scale)

    ckpt = work / "ckpt"
    if not (ckpt / "config.json").exists():
        make_tiny_checkpoint("llama", ckpt)
    out = work / "guard"
    shutil.rmtree(out, ignore_errors=True)
    plain, forge_genie.scatter_step = forge_genie.scatter_step, step
    try:
        build_bundle(ckpt, out, BuildOptions(targets="v81", quant="fp16", context=128,
                                             prefill_len=16, genie=True, verify=False,
                                             genie_kv="scatter"), log=lambda m: None)
    finally:
        forge_genie.scatter_step = plain
    return out


def graph_contexts(dump: Path, layer: int) -> list[list[int]]:
    """Per call, the ids of the slots the graph kept for row 0 (Genie's mask less the garbage
    its metadata marks), row 0's own id last."""
    sys.path.insert(0, str(Path(__file__).parent))
    from genie_lade_scatter import steps

    calls = steps(dump)
    files: dict[int, Path] = {}
    for g in dump.rglob("*"):
        if g.is_dir() and g.name.endswith("_1_of_1"):
            for f in g.iterdir():
                files.setdefault(int(f.name[:3]), g)
    slot: dict[int, int] = {}
    out = []
    for k, c in enumerate(calls):
        CL = c["mask"].shape[1]
        meta = np.fromfile(files[k] / f"{k:03d}_in_past_value_{layer}_in", np.float32)
        start, count, chain, written = meta.reshape(CL, -1)[:, :4].T
        A = (c["mask"][0] > -1).astype(np.float64) * (written > 0.5)
        A[c["index"][0]] = 0
        group = np.array([(A * (np.abs(start - start[s]) < 0.5)).sum() for s in range(CL)])
        garbage = A * (group > count - 0.5) * (chain < 0.5) * (count > 1.5)
        out.append([slot[s] for s in np.where(A - garbage > 0.5)[0]] + [c["ids"][0]])
        for r in range(c["AR"]):
            if (c["mask"][r] > -1).any():
                slot[c["index"][r]] = c["ids"][r]
    return out


def lade_against_qnn_sim(work: Path, ids: list[int], lade=(3, 3, 3), tokens: int = 40
                         ) -> tuple[int, str | None]:
    """Build the guarded bundle in ``work``, run one lade query on ``ids`` twice over, and
    compare each call's context with qnn-sim's greedy tokens -> (the generated ids compared
    equal, None or the first difference past a tie in words)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from genie_lade_scatter import run_lade
    from tokenizers import Tokenizer

    import hexforge
    from hexforge.runtime.compare import greedy_margins

    work.mkdir(parents=True, exist_ok=True)
    bundle = build(work)
    folder = bundle / "genie-v81"
    layers = json.loads((bundle / "manifest.json").read_text())["num_layers"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = tok.decode(ids * 2, skip_special_tokens=False)
    dump = work / "dump"
    run_lade(folder, text, lade, tokens, dump)
    ctx = graph_contexts(dump, layers)
    fed = [1, *tok.encode(text, add_special_tokens=False).ids]
    context = json.loads((folder / "genie_config.json").read_text())["dialog"]["context"]["size"]
    want, margins = greedy_margins(hexforge.load(bundle, backend="qnn-sim"), fed,
                                   min(2 * tokens, context - len(fed)))
    ref = fed + want
    equal = 0
    for k in range(-(-len(fed) // 16), len(ctx)):
        got = ctx[k]
        if len(got) < len(ctx[k - 1]):  # past max-num-tokens Genie's mask retreats
            break
        i = next((j for j, (x, y) in enumerate(zip(got, ref, strict=False)) if x != y), None)
        if i is None:
            equal = len(got) - len(fed)
            continue
        m = margins[i - len(fed)]
        if m <= 1e-3:  # a tie of qnn-sim's top-2 fp16 logits: not compared further
            return i - len(fed), None
        return equal, (f"call {k}: lade {got[i]} != qnn-sim {ref[i]} at generated id "
                       f"{i - len(fed)} (qnn-sim's top-2 margin {m:.4f})")
    return equal, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work")
    ap.add_argument("--lade", default="3,3,3")
    ap.add_argument("--ids", default="5,6,7,8,9,332,12", help="the prompt, repeated twice")
    ap.add_argument("--tokens", type=int, default=40)
    a = ap.parse_args()
    equal, differ = lade_against_qnn_sim(Path(a.work), [int(x) for x in a.ids.split(",")],
                                         tuple(int(x) for x in a.lade.split(",")), a.tokens)
    print(f"lade = qnn-sim's greedy tokens for {equal} generated ids"
          + (f"; then {differ}" if differ else " (up to the end or a tie)"))


if __name__ == "__main__":
    main()
