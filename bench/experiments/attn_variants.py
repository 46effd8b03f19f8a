"""Decode-graph attention variants on the CPU EP, same weights, interleaved:

    concat  (families/blocks.py today) keys = Concat(past_k, k_new); softmax(q keys^T + mask) values
            -> the Concat copies the whole static cache (2 x KVH x C x D per layer) every token
    split   scores = Concat(q past_k^T, q k_new^T) (small); out = p[:, :C] past_v + p[:, C:] v_new
            -> no cache copy; same math (fp32 sums in a different order)

    python bench/experiments/attn_variants.py CKPT [--layers 8] [--context 1024] [--runs 15]

Exports the first --layers decoder layers of the checkpoint as one AR-1 graph per variant (the
per-layer cost ratio is what matters), checks they agree, times session.run alternately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def attend_split(self, x, cos, sin, mask, past_k, past_v, k, v):
    import torch

    T, g, D = x.shape[1], self.n_heads // self.n_kv, self.head_dim
    q, gate = self._query(x, cos, sin)  # [1, nH, T, D] after the head norm and rope
    q = q.reshape(1, self.n_kv, g * T, D)
    S = past_k.shape[2]
    scores = torch.cat((torch.matmul(q, past_k.transpose(2, 3)),
                        torch.matmul(q, k.transpose(2, 3))), dim=-1) * self.scaling
    if g > 1:
        mask = mask.repeat(1, 1, g, 1)
    probs = torch.softmax(scores + mask, dim=-1)
    out = torch.matmul(probs[..., :S], past_v) + torch.matmul(probs[..., S:], v)
    out = out.reshape(1, self.n_heads, T, D).transpose(1, 2).reshape(1, T, self.n_heads * D)
    if self.output_gate:
        out = out * torch.sigmoid(gate)
    return self.o_proj(out)


def forward_split(self, x, cos, sin, mask, past_k, past_v):
    k, v = self.project_kv(x, cos, sin)
    return attend_split(self, x, cos, sin, mask, past_k, past_v, k, v), k, v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=15)
    a = ap.parse_args()

    import onnxruntime as ort

    from hexforge.families import blocks, load_family
    from hexforge.forge.export.onnxexport import export_module
    from hexforge.forge.source.checkpoint import read_checkpoint
    from hexforge.runtime.backends import cpu_threads

    ckpt = read_checkpoint(a.checkpoint)
    fam = load_family(ckpt.model_type).FAMILY
    args = fam.Args.from_config(ckpt.config)
    hf = fam.load_hf(ckpt.dir)
    root = Path(tempfile.mkdtemp(prefix="hexforge-attn-"))
    original = blocks.StaticAttention.forward
    paths = {}
    for name, fwd in (("concat", original), ("split", forward_split)):
        blocks.StaticAttention.forward = fwd
        try:
            mod = fam.decoder_module(hf, args, (0, a.layers), 1, a.context)
            paths[name] = root / f"{name}.onnx"
            export_module(mod, paths[name], "torchscript")
        finally:
            blocks.StaticAttention.forward = original
    del hf
    so = ort.SessionOptions()
    so.intra_op_num_threads = cpu_threads()
    so.log_severity_level = 3
    sess = {n: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
            for n, p in paths.items()}
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess["concat"].get_inputs():
        feeds[i.name] = (rng.standard_normal(i.shape) * 0.5).astype(np.float32)
    mask = feeds["mask_full"]
    mask[...] = 0.0
    mask[..., a.context // 2:a.context] = -1e9  # half the cache held
    outs = {n: s.run(None, feeds) for n, s in sess.items()}
    max_diff = max(float(np.abs(x - y).max()) for x, y in zip(outs["concat"], outs["split"],
                                                                strict=True))
    times: dict[str, list[float]] = {n: [] for n in sess}
    for _ in range(a.runs):
        for n, s in sess.items():
            t = time.perf_counter()
            s.run(None, feeds)
            times[n].append(1e3 * (time.perf_counter() - t))
    med = {n: statistics.median(v) for n, v in times.items()}
    print(json.dumps({
        "checkpoint": a.checkpoint, "layers": a.layers, "context": a.context,
        "max_abs_diff": max_diff,
        "ms_per_step": {n: {"median": round(med[n], 1), "min": round(min(v), 1),
                            "max": round(max(v), 1)} for n, v in times.items()},
        "split_speedup": round(med["concat"] / med["split"], 3)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
