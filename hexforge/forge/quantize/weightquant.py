"""Weight formats for the QDQ graphs: symmetric int8 / int4, round to nearest or GPTQ.

    int8, a scale per output channel        rtn_int8(w)            gptq_int8(w, H)
    int8, a scale per block of B input rows rtn_int8(w, block=B)   gptq_int8_blocks(w, H, B)
    int4, a scale per block of B input rows int4_blocks(w, B)      gptq_int4(w, H, B)
    int4 LPBQ: the block scales as codes     the same, snap=lpbq_snap(w, B)
      1..16 x a float per output channel

All take w [K, N] (x @ w, K = input features) and return (scales, q int8 [K, N]); the caller
(qdq.requantize_weights) writes them as DequantizeLinear(axis=1) or (axis=0, block_size=B) --
the LPBQ scales as a DequantizeLinear of their codes feeding the weight's (lpbq_codes).
H [K, K] is the calibration inputs' Hessian (calibstats), present only for GPTQ recipes.

Why LPBQ for int4 (docs/notes/htp-speed.md, ``bench/experiments/int_weights.py``): with float
block scales onnxruntime-qnn dequantizes an int4 weight on the vector units into an fp16
convolution every step; with 4-bit block codes (1..16, stored uint8) under a per-channel float
scale (Qualcomm's "low power block quantization") the EP fuses it into one integer MatMul on the
matrix unit, the 4-bit weights packed two to a byte in the binary.
"""

from __future__ import annotations

import numpy as np

from ...bundle.errors import BuildError


def rtn_int8(w: np.ndarray, block: int | None = None,
             cols: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8, round to nearest, one scale per output channel (``block`` None) or per
    ``block`` input rows of it -> (scale [N] or [K/block, N], q [K, N] int8), in column blocks (a
    real-size lm_head is [1024, 248320]: whole-array temporaries were GBs)."""
    K, N = w.shape
    B = block or K
    scale = np.empty((K // B, N), np.float32)
    q = np.empty((K, N), np.int8)
    for c in range(0, N, cols):
        blk = w[:, c:c + cols].reshape(K // B, B, -1)
        s = np.maximum(np.abs(blk).max(axis=1), 1e-8) / 127.0  # [K/B, cols]
        scale[:, c:c + cols] = s
        q[:, c:c + cols] = np.clip(np.round(blk / s[:, None]), -127, 127).reshape(K, -1)
    return (scale[0] if block is None else scale), q


GPTQ_BLOCK = 128  # rows per lazy batch (the paper's); int4 uses its scale group instead
GPTQ_SUB = 16  # rows per sub-block: the rank-1 updates stay within these (cache-resident)


def gptq_int8(w: np.ndarray, H: np.ndarray, damp: float = 0.01):
    """GPTQ with symmetric int8 per-output-channel scales (fixed from the whole column up front).
    -> (scale [N] float32, q [K, N] int8 in [-127, 127])."""
    s = (np.maximum(np.abs(w).max(axis=0), 1e-8) / 127.0).astype(np.float32)  # [N]
    _, Q = _gptq(w, H, GPTQ_BLOCK, lambda rows: s, -127, 127, damp)
    return s, Q


def gptq_int8_blocks(w: np.ndarray, H: np.ndarray, B: int, damp: float = 0.01):
    """GPTQ with symmetric int8 groups of B input rows, each group's scale its rows' absmax / 127
    as updated by the groups before it. -> (scale [K/B, N] float32, q [K, N] int8)."""
    return _gptq(w, H, B, lambda rows: np.maximum(np.abs(rows).max(axis=0), 1e-8) / 127.0,
                 -127, 127, damp)


def gptq_int4(w: np.ndarray, H: np.ndarray, B: int, damp: float = 0.01, snap=None):
    """GPTQ with symmetric int4 groups of B input rows, each group's scale chosen (MSE clip
    search, ``int4_blocks``, on ``snap``'s grid if given) on its rows as already updated by the
    groups before it. -> (scale [K/B, N] float32, q [K, N] int8 in [-8, 7])."""
    return _gptq(w, H, B, lambda rows: int4_blocks(rows, len(rows), snap)[0][0], -8, 7, damp)


def _gptq(w: np.ndarray, H: np.ndarray, block: int, block_scale, qlo: int, qhi: int,
          damp: float):
    """GPTQ (Frantar et al. 2022) for w [K, N] (x @ w): rows are quantized in order and each
    row's rounding error is spread over the rows not yet quantized through the inverse Hessian of
    the calibration inputs, so the *outputs* x @ w move least.

    The paper's lazy batch, one level deeper: a row's error reaches the rest of its sub-block of
    GPTQ_SUB rows by rank-1 updates (a few cache-resident rows), the rest of its block by one
    GEMM per sub-block, and the rows after the block by one GEMM per block. float32 like the
    paper's code (``_hinv`` too): with ``_hinv`` ~3x faster than the float64 row-by-row loop it
    replaces, with the same output error (docs/notes/measurements.md).
    ``block_scale(rows [block, N]) -> [N]``: each block's scale, from its rows as updated so far.
    -> (scales [K/block, N] float32, q [K, N] int8 in [qlo, qhi])."""
    K, N = w.shape
    W = np.array(w, np.float32)
    Hinv = _hinv(H, W, damp)  # upper: Hinv[i, i:] drives row i's error
    scales = np.empty((-(-K // block), N), np.float32)
    Q = np.empty((K, N), np.int8)
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        s = scales[b0 // block] = block_scale(W[b0:b1])
        err = np.empty((b1 - b0, N), np.float32)  # [rows of the block, N]
        for s0 in range(b0, b1, GPTQ_SUB):
            s1 = min(s0 + GPTQ_SUB, b1)
            for i in range(s0, s1):
                q = np.clip(np.rint(W[i] / s), qlo, qhi)
                Q[i] = q
                e = err[i - b0] = (W[i] - q * s) / Hinv[i, i]
                if i + 1 < s1:
                    W[i + 1:s1] -= np.outer(Hinv[i, i + 1:s1], e)
            if s1 < b1:
                W[s1:b1] -= Hinv[s0:s1, s1:b1].T @ err[s0 - b0:s1 - b0]
        if b1 < K:
            W[b1:] -= Hinv[b0:b1, b1:].T @ err
    return scales, Q


def _hinv(H: np.ndarray, W: np.ndarray, damp: float) -> np.ndarray:
    """Upper Cholesky factor U of the damped inverse Hessian, H^-1 = U^T U (dead inputs zeroed in
    W in place), without forming H^-1: with J the row reversal and J H J = L L^T (lower L),
    H^-1 = (J L^-T J)(J L^-1 J) and J L^-1 J is upper with a positive diagonal, so it is U.
    One Cholesky + one triangular inverse, 2K^3/3 flops, vs 3K^3 for inv + Cholesky: the
    Hessians of the down projections are K = intermediate (12288 for Gemma-4-E2B's wide MLPs).

    In float32, as the GPTQ paper's code: half the float64 time with the same output error (the
    damping bounds the condition number; docs/notes/measurements.md); float64 where float32 fails (not
    positive definite in its rounding)."""
    from scipy.linalg import LinAlgError, cholesky, lapack

    K = H.shape[0]
    dead = np.diag(H) == 0
    W[dead] = 0.0
    for dtype, trtri in ((np.float32, lapack.strtri), (np.float64, lapack.dtrtri)):
        Hd = np.array(H, dtype)
        Hd[dead, dead] = 1.0
        Hd[np.diag_indices(K)] += damp * np.mean(np.diag(Hd))
        try:
            L = cholesky(Hd[::-1, ::-1], lower=True, overwrite_a=True, check_finite=False)
        except LinAlgError:
            continue
        Linv, info = trtri(L, lower=1, overwrite_c=1)
        if not info and np.isfinite(np.diag(Linv)).all():
            return np.ascontiguousarray(Linv[::-1, ::-1], np.float32)
    raise BuildError("GPTQ: the damped Hessian is not positive definite")


CLIP_RATIOS = np.linspace(1.0, 0.6, 9)  # candidate clip ratios of the block absmax


def int4_blocks(w: np.ndarray, B: int, snap=None) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] -> (scale [K/B, N], q int8 in [-8, 7] [K, N]): symmetric int4 per block of B input
    rows, each block's scale = ratio x absmax / 7 with the ratio that minimises the block's MSE
    (clipping a few outliers buys resolution for the rest); ``snap(scale) -> scale`` puts each
    candidate on the grid the format can hold (``lpbq_snap``)."""
    K, N = w.shape
    wb = w.reshape(K // B, B, N)
    absmax = np.maximum(np.abs(wb).max(axis=1), 1e-8)  # [K/B, N]
    best_err = np.full(absmax.shape, np.inf, dtype=np.float64)
    best_scale = absmax / 7.0 if snap is None else snap(absmax / 7.0)
    for r in CLIP_RATIOS:
        s = absmax * r / 7.0 if snap is None else snap(absmax * r / 7.0)
        err = ((np.clip(np.round(wb / s[:, None]), -8, 7) * s[:, None] - wb) ** 2).sum(axis=1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, s, best_scale)
    q = np.clip(np.round(wb / best_scale[:, None]), -8, 7).astype(np.int8).reshape(K, N)
    return best_scale.astype(np.float32), q


HOLDOUT = 5  # every 5th calibration row judges GPTQ against round to nearest (validated_gptq)


def gptq_damp(n_rows: int, K: int) -> float:
    """GPTQ's damping for a Hessian summed from n_rows calibration rows of K inputs: the share of
    H's mean diagonal added to its diagonal, 0.3 (K / n)^2 within [0.01, 3]: the cap for fewer
    rows than ~K/3, the paper's 0.01 from ~5.5K rows.

    Why: n rows leave H singular in K - n directions, and with the paper's 0.01 GPTQ fits the
    rows it saw; more damping pulls its updates toward round to nearest where the rows say
    little. The built-in calibration gives ~300 rows (prefill + decode, less the held-out ones)
    against K 1024-12288: the rule follows the held-out error and end-to-end cosine of each
    damping (docs/notes/measurements.md, with the tables)."""
    return float(np.clip(0.3 * (K / max(n_rows, 1)) ** 2, 0.01, 3.0))


def dequantize(scale: np.ndarray, q: np.ndarray) -> np.ndarray:
    """(scale [N] per channel or [K/B, N] per block, q [K, N]) -> float32 [K, N]."""
    if scale.ndim == 1:
        return q * scale
    return q * np.repeat(scale, q.shape[0] // scale.shape[0], axis=0)


def validated_gptq(w: np.ndarray, rows: np.ndarray, gptq, rtn) -> tuple[np.ndarray, np.ndarray, bool]:
    """GPTQ from the calibration rows [r, K] minus every HOLDOUT-th one, kept only where it moves
    the outputs of those held-out rows less than round to nearest does; else round to nearest.
    ``gptq(w, H, damp)`` / ``rtn(w)`` -> (scale, q); damp from ``gptq_damp``.
    -> (scale, q, whether GPTQ was kept).

    Why: with fewer calibration rows than inputs (H of rank r < K) GPTQ fits the rows it saw and
    spreads its error into the directions they leave out: on a real-width model it lost to round
    to nearest on rows it had not seen, on the tiny one it won (docs/notes/measurements.md). Which one
    wins depends on the model and the calibration, so each weight is judged on its own."""
    val = rows[::HOLDOUT]
    train = np.delete(rows, np.s_[::HOLDOUT], axis=0).astype(np.float64)
    ref = val @ w
    sg, qg = gptq(w, train.T @ train, gptq_damp(train.shape[0], w.shape[0]))
    sr, qr = rtn(w)
    if np.linalg.norm(val @ dequantize(sg, qg) - ref) < np.linalg.norm(val @ dequantize(sr, qr) - ref):
        return sg, qg, True
    return sr, qr, False


# LPBQ block codes 1..16, stored uint8: the HTP expands each int4 weight x its block's code into
# the int8 weight its matrix unit multiplies (``expand_block_quant_to_pc_int8_weights``), so
# the product must fit int8 (-8 x 16 = -128). Larger codes are accepted by the compiler and
# wrong at run time: the simulator's output was uncorrelated with the graph's at code 64 and
# -1/255 of it at 255 (bench/experiments/int_weights.py, docs/notes/htp-speed.md)
LPBQ_CODES = 16


def lpbq_channel_scale(w: np.ndarray, B: int) -> np.ndarray:
    """w [K, N] -> the float scale [N] of each output channel's block codes: its largest block's
    absmax / 7 is code 16 (smaller blocks take smaller codes, on a grid of 1/16 of it)."""
    K, N = w.shape
    absmax = np.abs(w.reshape(K // B, B, N)).max(axis=1).max(axis=0)  # [N]
    return (np.maximum(absmax, 1e-8) / 7.0 / LPBQ_CODES).astype(np.float32)


def lpbq_snap(w: np.ndarray, B: int):
    """The ``snap`` that puts block scales [K/B, N] on w's LPBQ grid: a whole code 1..16 of its
    channel's scale (``lpbq_channel_scale``)."""
    ch = lpbq_channel_scale(w, B)
    return lambda s: (np.clip(np.round(s / ch), 1, LPBQ_CODES) * ch).astype(np.float32)


def lpbq_codes(scale: np.ndarray, ch: np.ndarray) -> np.ndarray:
    """Block scales on the LPBQ grid [K/B, N] -> their uint8 codes (scale = codes x ch)."""
    return np.clip(np.round(scale / ch), 1, LPBQ_CODES).astype(np.uint8)
