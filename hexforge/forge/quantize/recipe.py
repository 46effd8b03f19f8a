"""A quantization recipe (``--quant``) and its kinds, each a class owning what differs between them,
so a new kind is one class (the named recipes: recipes.py):

    kind (class)        activations  the graph the HTP compiles   prepared by (``prepare``)
    FloatRecipe         fp16         X.onnx (the float graph)     nothing (here)
    WeightOnlyRecipe    fp16         X.wo.onnx (MatMulNBits)      quantize/weightonly.py
    FixedPointRecipe    uint16       X.qdq.onnx (Q/DQ pairs)      quantize/fixedpoint.py -> calibrate.py

The planner reads ``bytes_per_weight``; the stage (forge/compile/stage.py) asks the recipe's kind
for the rest: the residual scale, how a shard's graphs are prepared, the file each compile reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..context import StageContext


@dataclass
class ShardJob:
    """One float export of the HTP stage, as a recipe's ``prepare`` needs it: the build's
    context (model, options, ``ctx.root`` holding ``graphs`` / ``plan``, log), the folder the
    quantized twins go to (``srcs``), the towers' graphs and the target."""

    ctx: StageContext
    manifest: Any
    graphs: list
    plan: Any
    srcs: Path
    encoders: list
    target: Any


@dataclass(frozen=True)
class QuantRecipe:
    name: str
    activations: str | None  # "uint16" or None (float graph, fp16 on the HTP)
    weight_bits: int | None  # 8 / 4 / None
    block_size: int | None = None  # int4 blocks along the input dim
    head_bits: int | None = None  # the lm_head's weight bits if not weight_bits (mixed recipe)
    bytes_per_weight: float = 2.0  # for the planner and the roofline
    mask_value: float = -30000.0  # additive mask; bounded so 16-bit activations keep resolution
    # calibrated activation ranges widened x this: unseen prompts exceed MinMax ranges, and
    # clipping, not 16-bit resolution, dominated the error (docs/notes/measurements.md)
    range_margin: float = 3.0
    # GPTQ with the calibration Hessians (validated per weight on held-out calibration rows,
    # weightquant.validated_gptq), else round to nearest. Not for int8: with a few hundred
    # calibration rows per graph (H of rank << K at real widths) it fits those rows and loses on
    # others (docs/notes/measurements.md)
    gptq: bool = True
    # input 1 of activation x activation MatMuls (QK^T keys, probs.V values) as symmetric int16:
    # the HTP holds a dynamic uint16 input 1 at 8 bits (qdq.int16_matmul_rhs)
    rhs_int16: bool = True

    # what the kind decides (its class), not the recipe's data
    fp16_activations: ClassVar[bool] = True  # the graphs compute in fp16 on the HTP
    compiled_suffix: ClassVar[str] = ".onnx"  # the file the HTP compiles for graph X
    quantized: ClassVar[bool] = False  # compiled from quantized twins of the float graphs
    # the x86 simulator emulates its weights' ops (MatMulNBits: minutes a step at real size)
    emulated_on_simulator: ClassVar[bool] = False

    def residual_scale(self, fam, residual_peak: float, log) -> float | None:
        """The scale the fp16 graphs carry the residual stream at (None: not fp16)."""
        return fp16_scale(fam, residual_peak, log) if self.fp16_activations else None

    def prepare(self, job: ShardJob) -> None:
        """The graphs the HTP compiles, beside the float ones in ``job.srcs``."""

    def head_bytes_per_weight(self) -> float:
        """The head's bytes a weight as the recipe writes it."""
        return self.bytes_per_weight

    def genie_graphs(self, paths: list[Path], vocab_size: int, split: int, splits: int
                     ) -> list[Path]:
        """A Genie split's graphs in the recipe's weights (forge/genie/decoder.py)."""
        return paths

    def check_genie(self) -> None:
        """Refuse ``--genie`` where Genie cannot take the recipe's graphs."""


@dataclass(frozen=True)
class FloatRecipe(QuantRecipe):
    """Float graphs, fp16 on the HTP."""


def fp16_scale(fam, residual_peak: float, log) -> float:
    """The residual scale s of fp16 graphs (``blocks.residual_scale``), 1 where the family cannot
    carry its residual scaled (``residual_scaling``) or the stream fits fp16 as it is."""
    from ...families.blocks import residual_scale

    s = residual_scale(residual_peak)
    if s != 1.0 and not getattr(fam, "residual_scaling", False):
        log(f"  warning: the residual stream peaks at {residual_peak:.4g}, near fp16's 65504, and "
            "this family cannot carry it scaled: fp16 graphs may overflow")
        return 1.0
    if s != 1.0:
        log(f"  fp16 graphs carry the residual stream at 1/{s:g} (its peak |x| {residual_peak:.4g})")
    return s
