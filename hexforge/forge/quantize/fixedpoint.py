"""The fixed-point recipe kind: uint16 activations (calibrated Q/DQ pairs) and int8 / int4 weights,
prepared by calibration (calibrate.py) and the QDQ pass (qdq.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...bundle.errors import BuildError
from .recipe import QuantRecipe, ShardJob


@dataclass(frozen=True)
class FixedPointRecipe(QuantRecipe):
    """uint16 activations (calibrated Q/DQ pairs) and int8 / int4 weights."""

    fp16_activations: ClassVar[bool] = False
    compiled_suffix: ClassVar[str] = ".qdq.onnx"
    quantized: ClassVar[bool] = True

    def prepare(self, job: ShardJob) -> None:
        from .calibrate import calibrate_and_quantize  # the CPU runtime: imported when it runs

        calibrate_and_quantize(job, self)

    def check_genie(self) -> None:
        raise BuildError(f"--genie: --quant {self.name} (fixed-point activations) is not built "
                         "for Genie; use fp16, w8-fp16 or w4-fp16")
