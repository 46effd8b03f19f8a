"""How an export module writes its graph: one frozen value given to each block when it is made.

Every block (RMSNorm, attention, activation, layer, shard, head) takes the ``ExportForm`` in its
constructor and fixes its graph there; nothing flips it afterwards, so a family file read top
to bottom says which graph is exported for which target::

    target                 form                                   graphs
    cpu                    CPU                                    onnxruntime's fused nodes
    HTP, fixed point       PLAIN                                  decomposed ops (quantizable)
    HTP, fp16 activations  fp16(s, keys_transposed=True)          fused norms, stream at 1/s
    Genie, fp16            fp16(s)                                as above, Genie's cache layout

The oracle's and calibration's modules are PLAIN: HF's math, op for op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Kernels = Literal["plain", "cpu", "fp16"]


@dataclass(frozen=True)
class ExportForm:
    """``kernels``: "plain" — the decomposed chains every backend and quantizer takes; "cpu" —
    onnxruntime's fused contrib nodes (SimplifiedLayerNormalization, RotaryEmbedding, FastGelu,
    the GatedDeltaNet step); "fp16" — each RMSNorm one fused node on its prescaled input (the
    decomposed x*x overflows fp16 on trained models' massive activations, docs/htp.md).
    ``residual_scale`` s: the residual stream carried at 1/s, a power of two (fp16 graphs whose
    stream would pass fp16's 65,504; 1 = as HF). ``keys_transposed``: caches keep keys as
    [1, KVH, D, C], as QK^T reads them, in shards whose layout has it (dense shards; others
    keep [1, KVH, C, D] and say so in their GraphIO)."""

    kernels: Kernels = "plain"
    residual_scale: float = 1.0
    keys_transposed: bool = False

    def __post_init__(self) -> None:
        if self.kernels not in ("plain", "cpu", "fp16"):
            raise ValueError(f"unknown export kernels {self.kernels!r}")
        if self.residual_scale <= 0:
            raise ValueError(f"residual_scale must be > 0, got {self.residual_scale}")

    @property
    def cpu(self) -> bool:
        return self.kernels == "cpu"

    @property
    def fused_norm(self) -> bool:
        return self.kernels == "fp16"

    @property
    def stream(self) -> float:
        """The factor the residual stream is carried at (HF's times this): 1 / s."""
        return 1.0 / self.residual_scale

    def with_plain_keys(self) -> ExportForm:
        """This form for a shard whose caches keep keys as rows ([1, KVH, C, D])."""
        return replace(self, keys_transposed=False) if self.keys_transposed else self


PLAIN = ExportForm()
CPU = ExportForm(kernels="cpu")


def fp16(residual_scale: float = 1.0, keys_transposed: bool = False) -> ExportForm:
    """HTP graphs with fp16 activations: fused norms, the residual stream at 1/s."""
    return ExportForm("fp16", residual_scale, keys_transposed)
