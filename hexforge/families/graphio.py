"""The names and binds of an export module's graph inputs and outputs (``GraphIO``).

Torch-free, and imported by the export blocks and the families alike: it is the one piece of the
family contract the blocks need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..bundle.manifest import TensorSpec


@dataclass
class GraphIO:
    """Names + binds of an export module's inputs/outputs, in forward-argument order.

    Attached to the export module (ExecuTorch-style export metadata); build turns it into the
    manifest's TensorSpecs after export, reading shapes/dtypes from the example inputs.
    """

    inputs: list[tuple[str, str]] = field(default_factory=list)  # (onnx name, bind)
    outputs: list[tuple[str, str]] = field(default_factory=list)
    keys_transposed: set[str] = field(default_factory=set)  # names of caches' keys as [.., D, C]

    def specs(self, arrays: list[Any], which: str) -> list[TensorSpec]:
        pairs = self.inputs if which == "inputs" else self.outputs
        return [
            TensorSpec(name=n, bind=b, shape=list(a.shape), dtype=str(a.dtype).replace("torch.", ""),
                       keys_transposed=n in self.keys_transposed)
            for (n, b), a in zip(pairs, arrays, strict=True)
        ]
