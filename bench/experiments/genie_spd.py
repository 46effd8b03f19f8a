"""Genie's speculative dialog (``spd``: a draft engine proposes, the target verifies) on two
hexforge Genie folders of one tokenizer, read off Genie's own tensor dump: whether its tokens are
``basic``'s, and which row of each verify step lands in which cache slot (issue 77's fallback).

    python bench/experiments/genie_spd.py TARGET DRAFT [--draft-len 3] [--tokens 40]
                                          [--text "..."] [--dump DIR]

TARGET and DRAFT are bundles (or Genie folders) built with ``--genie``; the config is the
target's with ``type: spd``, ``spd: {version 1, draft-len K}`` and ``engine`` the pair [target's
engine with ``role: target``, draft's with ``role: draft``] (libGenie 1.21's own schema, read
from the library's strings). What libGenie 1.21 requires of it, measured here:

- a token query on an ``spd`` dialog fails at once (``GenieDialog_tokenQuery`` error -6): a
  text query runs, so the tokens are read off the dump (the target's verify calls' input ids
  and each call's accepted count from Genie's ``spec-dec: ... n_accepted`` log line);
- a greedy sampler aborts the process (``QUALLA_ASSERT ... sampler-utils.hpp: temp > 0.f``):
  temperature 1 with top-k 1 is greedy in effect.

The check: the target's committed tokens (each verify call's first ``n_accepted`` input ids)
against ``basic``'s greedy tokens on the same prompt (its AR-1 calls' input ids, the same dump
reading), and, per verify call, which earlier call's row fills each slot its row 0 attends
(layer 0's keys matched exactly: a key carries its token and its rope position).
Findings (tiny llama, AR-16 / CL 128): docs/notes/genie-record.md ("spd").
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

GRAPH = re.compile(r"_ar(\d+)_cl\d+_1_of_\d+$")  # split 1 of a Genie graph's QNN name


def config_of(bundle: Path) -> dict:
    """A folder's genie_config.json made runnable here, sampling greedy in effect (Genie's spd
    asserts temp > 0)."""
    from hexforge.runtime.genie.model import absolute_paths, find_folder

    folder = find_folder(bundle)
    cfg = absolute_paths(json.loads((folder / "genie_config.json").read_text()), folder)
    d = cfg["dialog"]
    d["context"]["eos-token"] = -1  # no early end
    d["context"].setdefault("pad-token", 0)
    d["engine"]["backend"]["QnnHtp"]["poll"] = False  # the simulator needs the core
    d["sampler"] = {"version": 1, "seed": 42, "temp": 1.0, "top-k": 1, "top-p": 1.0,
                    "greedy": False}
    return cfg


def spd_config(target: Path, draft: Path, draft_len: int) -> dict:
    cfg = config_of(target)
    d = cfg["dialog"]
    d["type"] = "spd"
    d["spd"] = {"version": 1, "draft-len": draft_len}
    drafter = config_of(draft)["dialog"]["engine"]
    d["engine"] = [dict(d["engine"], role="target"), dict(drafter, role="draft")]
    return cfg


def text_query(cfg: dict, text: str, tokens: int, dump: Path) -> list[str]:
    """One text query with ``debug.dump-tensors`` into ``dump``; -> Genie's log lines."""
    from hexforge.runtime.genie import libgenie as genie

    cfg = json.loads(json.dumps(cfg))
    cfg["dialog"]["max-num-tokens"] = tokens
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    cfg["dialog"]["debug"] = {"path": str(dump), "dump-tensors": True}
    lines: list[str] = []
    with genie.Dialog(cfg, log_level="verbose", echo=lines.append) as d:
        d.query(text, lambda _s: None)
    return lines


def target_calls(dump: Path) -> list[dict]:
    """The target's (``text_primary``) split-1 calls in order: {"AR", "ids", "mask", "keys"
    (layer 0's past keys [KVH, D, S]), "new" (its new keys [KVH, D, AR])}."""
    found: dict[int, Path] = {}
    for graph in (dump / "text_primary").iterdir():
        if graph.is_dir() and GRAPH.search(graph.name):
            for f in graph.glob("*_in_input_ids"):
                found[int(f.name[:3])] = graph
    out = []
    for k in sorted(found):
        g, AR = found[k], int(GRAPH.search(found[k].name).group(1))
        new = np.fromfile(g / f"{k:03d}_out_past_key_0_out", np.float32)
        past = np.fromfile(g / f"{k:03d}_in_past_key_0_in", np.float32)
        kvh_d = new.size // AR
        out.append({"AR": AR, "ids": np.fromfile(g / f"{k:03d}_in_input_ids", np.int32).tolist(),
                    "mask": np.fromfile(g / f"{k:03d}_in_attention_mask",
                                        np.float32).reshape(AR, -1),
                    "new": new.reshape(kvh_d, AR), "keys": past.reshape(kvh_d, -1)})
    return out


def slot_sources(calls: list[dict], k: int, last: int = 4) -> list[tuple[int, list]]:
    """For call k: the last ``last`` past slots its row 0 attends, each with the (call, row)
    whose new key it holds (several where one token sat at one position twice)."""
    c = calls[k]
    S = c["keys"].shape[1]
    attended = [int(s) for s in np.where(c["mask"][0] > -1)[0] if s < S]
    return [(s, [(j, r) for j in range(k) for r in range(calls[j]["AR"])
                 if np.array_equal(c["keys"][:, s], calls[j]["new"][:, r])])
            for s in attended[-last:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--draft-len", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--text", default="hello world this is a test")
    ap.add_argument("--dump", type=Path, default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

    root = a.dump or Path(tempfile.mkdtemp(prefix="genie-spd-"))
    text_query(config_of(a.target), a.text, a.tokens, root / "basic")
    basic = target_calls(root / "basic")
    n_prompt = sum(1 for c in basic if c["AR"] > 1)
    basic_ids = [c["ids"][0] for c in basic[n_prompt:]]
    lines = text_query(spd_config(a.target, a.draft, a.draft_len), a.text, a.tokens, root / "spd")
    accepted = [int(m.group(1)) for ln in lines
                if (m := re.search(r"spec-dec: .* n_accepted (\d+)", ln))]
    spd = target_calls(root / "spd")
    # the dump holds the first calls only (21 a graph here): zip stops at the shorter
    spd_ids = [t for c, n in zip(spd[n_prompt:], accepted, strict=False) for t in c["ids"][:n]]
    for k in range(n_prompt, min(len(spd), n_prompt + 8)):
        print(f"verify call {k - n_prompt + 1}: ids {spd[k]['ids'][:a.draft_len + 1]}, "
              f"accepted {accepted[k - n_prompt] if k - n_prompt < len(accepted) else '?'}; "
              f"row 0's last past slots <- (call, row): {slot_sources(spd, k)}")
    n = min(len(basic_ids), len(spd_ids))
    first = next((i for i in range(n) if basic_ids[i] != spd_ids[i]), None)
    print(f"basic: {basic_ids[:n]}\nspd:   {spd_ids[:n]}")
    print(f"accepted a call: {accepted} ({sum(accepted) / max(1, len(accepted)):.2f} tokens a "
          "target call)")
    print(f"spd = basic over {n} tokens" if first is None
          else f"spd != basic from token {first} (of the {n} both dumps hold)")


if __name__ == "__main__":
    main()
