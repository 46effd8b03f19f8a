"""The named quantization recipes (``--quant``): data, one recipe of its kind (recipe.py) per name.

The planner reads ``bytes_per_weight``; the QDQ pass (qdq.py) and the weight-only pass
(weightonly.py) read the weight and activation formats.
"""

from __future__ import annotations

from dataclasses import replace

from ...bundle.errors import BuildError, BundleError
from .fixedpoint import FixedPointRecipe
from .recipe import FloatRecipe, QuantRecipe
from .weightonly import WeightOnlyRecipe

# Names say what a recipe is: w<bits>-fp16 are weight-only (int weights, fp16 activations),
# w<bits>-u16 fixed-point (int weights, uint16 activations: calibrated Q/DQ pairs).
RECIPES = {
    # float graphs, fp16 on the HTP, in the fp16 ExportForm (families/form.py: fused norms,
    # the residual stream scaled into fp16's range where it would not fit)
    "fp16": FloatRecipe("fp16", None, None, bytes_per_weight=2.0, mask_value=-30000.0),
    # weight-only: the fp16 graphs with every weight MatMul as MatMulNBits (int8 / int4 in blocks
    # of 32, the head int8 under int4), rounded to nearest, no calibration. The binary holds int4
    # packed (0.569 bytes a weight at blocks of 32: docs/htp.md). On real trained models the
    # fixed-point road below loses the massive activations (docs/htp.md: SmolLM2 w8-u16 top-1
    # 0.19); fp16 activations keep them, as AI Hub's weight-only "w4" recipe does
    "w8-fp16": WeightOnlyRecipe("w8-fp16", None, 8, block_size=32, bytes_per_weight=1.0 + 2 / 32,
                           mask_value=-30000.0),
    "w4-fp16": WeightOnlyRecipe("w4-fp16", None, 4, block_size=32, bytes_per_weight=0.5 + 2 / 32,
                           mask_value=-30000.0),
    # fixed point: uint16 activations (calibrated Q/DQ pairs) and int8 per-channel weights
    "w8-u16": FixedPointRecipe("w8-u16", "uint16", 8, bytes_per_weight=1.0, mask_value=-100.0,
                          gptq=False),
    # decoder weights int4 (block 64) via GPTQ with Hessians pooled over the prefill + decode graphs
    # of a shard, each weight's GPTQ kept only where it beats round to nearest on held-out rows;
    # lm_head int8 (docs/notes/measurements.md has the measurements behind each choice)
    "w4-u16": FixedPointRecipe("w4-u16", "uint16", 4, block_size=64,
                          bytes_per_weight=0.5 + 2 / 64, mask_value=-100.0, head_bits=8),
    # int8 weights with one scale per 128 input rows instead of one per output channel
    "w8-u16-b128": FixedPointRecipe("w8-u16-b128", "uint16", 8, block_size=128,
                               bytes_per_weight=1.0 + 4 / 128, mask_value=-100.0, gptq=False),
}
# w4-u16's format with every weight rounded to nearest (no calibration Hessians): per-weight
# validation judges a weight's own output, not what the model carries on
RECIPES["w4-u16-rtn"] = replace(RECIPES["w4-u16"], name="w4-u16-rtn", gptq=False)

# the names these recipes had before (bundles built then say them; --quant still takes them):
# "a16" meant fp16 activations without -qdq and uint16 ones with it
ALIASES = {"w8a16": "w8-fp16", "w4a16": "w4-fp16", "w8a16-qdq": "w8-u16", "w4a16-qdq": "w4-u16",
           "w8a16-qdq-b128": "w8-u16-b128", "w4a16-qdq-rtn": "w4-u16-rtn"}


def canonical(name: str) -> str:
    """A recipe's name for ``name`` or its alias; any other name (the cpu target's weights:
    fp32, int8, ...) as it is."""
    return ALIASES.get(name, name)


def get_recipe(name: str) -> QuantRecipe:
    """The recipe ``--quant name`` asks for (its old name too); a name it is not, one line
    naming the choices. ``BuildOptions.recipe`` resolves the build's once."""
    try:
        return RECIPES[canonical(name)]
    except KeyError:
        raise BuildError(f"unknown --quant {name!r}; choose from {', '.join(RECIPES)} (old names "
                         f"{', '.join(ALIASES)})") from None


def built_recipe(target) -> QuantRecipe:
    """The recipe a bundle's HTP target was built with (``TargetSpec.quant``, old names too):
    what reads a built target's graphs (the probe, the estimator) asks here."""
    recipe = RECIPES.get(canonical(target.quant))
    if recipe is None:
        raise BundleError(f"target {target.name} was built with --quant {target.quant}, which "
                          f"this hexforge does not know (it knows {', '.join(RECIPES)})")
    return recipe
