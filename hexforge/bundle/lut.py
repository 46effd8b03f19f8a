"""Genie's embedding LUT encodings: what the build writes them in and the runtime hands Genie rows
in (one formula for both: ``LutEncoding.quantize``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# genie_config.json's embedding datatypes hexforge writes -> the LUT file's values
LUT_DTYPES = {"float32": np.float32, "ufixed16": np.uint16, "ufixed8": np.uint8}


@dataclass(frozen=True)
class LutEncoding:
    """Genie's embedding LUT as fixed point. ``scale`` / ``zero_point``: the encoding of the graph
    input the rows go into, one for the whole table: real = scale x (q - zero_point), q in
    0..65535 (Genie's ``quant-param`` writes offset = -zero_point). ``per_row``: the file holds
    8-bit rows instead, each row its own symmetric scale (q - 128 = round(row / s), s =
    max|row| / 127; ``forge/genie/folder.row_quantize``), which Genie turns into that input
    encoding itself.

    Why 16 bits: Gemma-4-E2B's rows ([token embedding | per-layer inputs], 262,144 x 10,496) are
    11 GB as float32, 5.5 GB so; Genie copies the rows as they are into a graph input of the
    same encoding (``forge/genie/decoder.quantize_input``), where a DequantizeLinear makes them float
    (measured: the same tokens as the float32 LUT; a float32 input given this LUT reads inf).
    Why 8 bits a row past 4 GiB: ``forge/genie/folder.LUT_CEILING``."""

    scale: float
    zero_point: int
    per_row: bool = False

    @classmethod
    def of_quant_param(cls, quant_param: dict) -> LutEncoding:
        """genie_config.json's per-tensor ``quant-param`` (real = scale x (q + offset))."""
        return cls(scale=float(quant_param["scale"]), zero_point=-int(quant_param["offset"]))

    def quantize(self, rows) -> np.ndarray:
        q = np.round(np.asarray(rows, np.float64) / self.scale) + self.zero_point
        return np.clip(q, 0, 65535).astype(np.uint16)
