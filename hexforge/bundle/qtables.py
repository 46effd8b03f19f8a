"""Quantized host tables: int8 and int4 rows with per-block scales, in onnxruntime's MatMulNBits
layout (so a tied head's weights and the embedding table can be the same bytes), and their
row gathers that dequantize only the rows asked for.
"""

from __future__ import annotations

import numpy as np

from .errors import BundleError

# a table with int8 weights (--cpu-weights int8 / int8-b128 bundles, the per-layer tables of
# quantized ones, the embedding of bundles with HTP targets): "<table>" U8 [V, D] and
# "<table>.int8_scales" F32 [V, D / block]: column j of row v is (q - 128) x scale[v, j // block]
# -- onnxruntime's 8-bit MatMulNBits layout (zero point 128) with the table's rows as its N, so a
# tied int8 head holds the same bytes as the table. A width the block does not divide: I8 rows
# (zero point 0), one scale a row. Bundles from before the U8 layout (I8 rows, a scale per 32
# columns) load as they are.
INT8_SCALES = ".int8_scales"
INT8_BLOCK = 32


def int8_blocks(rows: np.ndarray, block: int = INT8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """rows [r, D] float -> (q [r, D], scales float32 [r, D / block]): symmetric, each block of
    ``block`` columns by onnxruntime's own 8-bit quantizer, the one the build's MatMulNBits
    weights go through (q uint8, zero point 128, scale absmax / 128); where ``block`` does not
    divide D, the whole row as one block (q int8, scale absmax / 127)."""
    if rows.shape[1] % block:
        b = rows.astype(np.float32)
        scales = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
        q = np.rint(b / np.where(scales == 0, 1, scales))
        return np.clip(q, -127, 127).astype(np.int8), scales.astype(np.float32)
    return _matmulnbits_rows(rows, 8, block)


def _matmulnbits_rows(rows: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """rows [r, D] float -> (q uint8 [r, D x bits / 8], scales float32 [r, D / block]) by
    onnxruntime's symmetric 4- or 8-bit MatMulNBits quantizer with the rows as its N (B [N,
    K / block, block x bits / 8] is then the rows' own bytes). ``block`` divides D."""
    from onnxruntime.capi import _pybind_state as ort_c

    quantize = {4: ort_c.quantize_matmul_4bits, 8: ort_c.quantize_matmul_8bits}[bits]
    r, D = rows.shape
    q = np.zeros((r, D // block, block * bits // 8), np.uint8)
    scales = np.zeros((r, D // block), np.float32)
    per_byte = 8 // bits  # zero points packed like the weights; unused when symmetric
    zero_points = np.zeros((r, (D // block + per_byte - 1) // per_byte), np.uint8)
    w = np.ascontiguousarray(rows.astype(np.float32, copy=False).T)  # [K = D, N = r]
    quantize(q, w, scales, zero_points, block, r, D, True)
    return q.reshape(r, D * bits // 8), scales


class Int8Table:
    """A host table stored as 8-bit rows and per-block scales (``int8_blocks``); ``table[ids]``
    gathers the rows and dequantizes them to float32, reading a quarter of an fp32 table's bytes.
    """

    def __init__(self, name: str, q: np.ndarray | None, scales: np.ndarray):
        ok = (q is not None and q.dtype in (np.int8, np.uint8) and q.ndim == 2 and scales.ndim == 2
              and scales.shape[0] == q.shape[0] and scales.shape[1] > 0
              and q.shape[1] % scales.shape[1] == 0)
        if not ok or q is None:
            got = "missing" if q is None else f"{q.dtype} {list(q.shape)}"
            raise BundleError(f"host table {name!r}: int8 rows ({got}) do not match their scales "
                              f"{list(scales.shape)}")
        self.q, self.scales = q, scales
        self.block = q.shape[1] // scales.shape[1]
        self.shape, self.ndim, self.dtype = q.shape, 2, np.dtype(np.float32)
        self.nbytes = q.nbytes + scales.nbytes

    def __getitem__(self, ids) -> np.ndarray:
        q, s = self.q[ids], self.scales[ids]
        if q.dtype == np.uint8:  # q - 128 as int8, exactly: the top bit flipped (faster than a
            q = q.view(np.int8) ^ np.int8(-128)  # 256-entry float table: docs/notes/measurements.md)
        return (q.reshape(*q.shape[:-1], -1, self.block) * s[..., None]).reshape(q.shape)


# a table with int4 weights (--cpu-weights int4 / int4-b128 bundles): "<table>" U8 [V, D / 2],
# two columns a byte (the even one in the low nibble), and "<table>.int4_scales" F32
# [V, D / block]: column j of row v is (nibble - 8) x scale[v, j // block] -- onnxruntime's
# MatMulNBits layout (zero point 8) with the table's rows as its N, so a tied head holds the same
# bytes as the table
INT4_SCALES = ".int4_scales"


def int4_blocks(rows: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """rows [r, D] float -> (q uint8 [r, D / 2], scales float32 [r, D / block]) by onnxruntime's
    own symmetric int4 quantizer, the one the build's MatMulNBits weights go through (rows as N,
    columns as K). D must be a multiple of ``block`` (and ``block`` of 2)."""
    D = rows.shape[1]
    if block % 2 or D % block:
        raise ValueError(f"int4 rows of {D} columns do not split into blocks of {block}")
    return _matmulnbits_rows(rows, 4, block)


class Int4Table:
    """A host table stored as int4 rows (``int4_blocks``) and per-block scales; ``table[ids]``
    gathers the rows and dequantizes them to float32, reading an eighth of an fp32 table's bytes."""

    def __init__(self, name: str, q: np.ndarray | None, scales: np.ndarray):
        ok = (q is not None and q.dtype == np.uint8 and q.ndim == 2 and scales.ndim == 2
              and scales.shape[0] == q.shape[0] and scales.shape[1] > 0
              and (2 * q.shape[1]) % scales.shape[1] == 0)
        if not ok or q is None:
            got = "missing" if q is None else f"{q.dtype} {list(q.shape)}"
            raise BundleError(f"host table {name!r}: int4 rows ({got}) do not match their scales "
                              f"{list(scales.shape)}")
        self.q, self.scales = q, scales
        self.block = 2 * q.shape[1] // scales.shape[1]
        self.shape, self.ndim, self.dtype = (q.shape[0], 2 * q.shape[1]), 2, np.dtype(np.float32)
        self.nbytes = q.nbytes + scales.nbytes

    # byte -> its two columns' (nibble - 8), low nibble first: one np.take unpacks a row, half
    # the time of shifts and masks or fancy indexing (docs/notes/measurements.md)
    _PAIRS = np.stack([np.arange(256) & 0x0F, np.arange(256) >> 4], axis=-1).astype(np.float32) - 8

    def __getitem__(self, ids) -> np.ndarray:
        q, s = self.q[ids], self.scales[ids]  # [..., D / 2], [..., D / block]
        pairs = np.take(self._PAIRS, q, axis=0)  # [..., D / 2, 2]
        return (pairs.reshape(*q.shape[:-1], -1, self.block) * s[..., None]).reshape(
            *q.shape[:-1], 2 * q.shape[-1])


# a host table as loaded: float rows, or quantized rows dequantized on each gather
HostTable = np.ndarray | Int8Table | Int4Table
