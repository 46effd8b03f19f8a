"""Host-side inputs of the graphs, made from the manifest's declarative host recipe (numpy only).

    token ids ──gather(embed table) x scale──▶ hidden [1, T, H]  (also bound as "embed")
    token ids ──gather(extra table) x scale──▶ host:<name> [1, T, D]  (e.g. Gemma-4 PLE)
    positions ──x inv_freq, cat(f, f), cos/sin, x scaling──▶ rope_cos/sin:<name> [1, T, R]
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import BundleError
from ..manifest import HostRecipe

# safetensors dtype -> bytes per element: the ones safetensors.numpy loads; others are refused
_ST_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                   "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_ST_HEADER = 100_000_000  # the safetensors format's own header cap


def check_safetensors_header(path: Path) -> dict:
    """Validate a safetensors header against the file's real size *before* the library maps or
    allocates anything: the 8-byte header length, the JSON header, and every tensor's dtype, shape
    and [begin, end) offsets (inside the data region, matching shape x dtype size). Returns the
    parsed header; any lie is a BundleError naming the file."""
    import json

    def bad(why: str) -> BundleError:
        return BundleError(f"host tensors {path.name} are corrupted: {why}")

    size = path.stat().st_size
    if size < 8:
        raise bad(f"{size} bytes is shorter than the 8-byte header length")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > min(size - 8, MAX_ST_HEADER):
            raise bad(f"the header claims {n:,} bytes but the file has {size - 8:,} after the length")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError / UnicodeDecodeError are ValueErrors
        raise bad("the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r} has a malformed entry")
        dtype, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
        if dtype not in _ST_DTYPE_BYTES:
            raise bad(f"tensor {name!r} has an unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and isinstance(offs, list) and len(offs) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                        for x in (*shape, *offs))):
            raise bad(f"tensor {name!r} has a malformed shape or offsets")
        begin, end = offs
        if not begin <= end <= data:
            raise bad(f"tensor {name!r} spans bytes [{begin}, {end}) of a {data:,}-byte data region")
        if math.prod(shape) * _ST_DTYPE_BYTES[dtype] != end - begin:
            raise bad(f"tensor {name!r}: shape {shape} x {dtype} does not fill [{begin}, {end})")
    return header


_ST_NUMPY = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
             "F16": "float16", "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64",
             "U64": "uint64", "F64": "float64",
             # a bf16 checkpoint's tables, kept in bf16 (numpy's own types lack it; onnx's
             # dependency ml_dtypes has it, and its astype(float32) is exact)
             "BF16": ml_dtypes.bfloat16}


def map_for_gathers(path: Path) -> mmap.mmap:
    """``path`` as a read-only memory map, advised MADV_RANDOM where the OS has it: a gather reads
    scattered rows, and under the default advice each page fault also reads the kernel's
    read-around window (8 MB on this VM's disk). A cold row of Gemma-4-E2B's per-layer table took
    2.3-5.3 ms that way and 0.27-0.29 ms advised (page cache dropped; a 512-token prompt gathers
    512 rows, a decode token one)."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_RANDOM"):  # not on Windows
        m.madvise(mmap.MADV_RANDOM)
    return m


def view(m: mmap.mmap, dtype, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    """``shape`` x ``dtype`` at byte ``offset`` of the map, as a plain read-only ndarray (it keeps
    the map alive; indexing a np.memmap costs 2.9 us a row gather, a plain view 1.3 us)."""
    return np.frombuffer(m, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)


def load_host_tensors(path: Path) -> dict[str, np.ndarray]:
    """Read safetensors (never pickle); a corrupted header is a BundleError, not a crash.

    The tensors are read-only memory maps of the file: a gather touches only the rows it reads
    (Gemma-4-E2B's per-layer table is 9.4 GB fp32), never the whole table."""
    from safetensors import SafetensorError, safe_open

    header = check_safetensors_header(path)
    try:
        with safe_open(str(path), "np"):  # the library's own validation of the layout
            pass
        m = map_for_gathers(path)
        start = 8 + int.from_bytes(m[:8], "little")
        out = {}
        for name, t in header.items():
            if name == "__metadata__":
                continue
            if t["dtype"] not in _ST_NUMPY:
                raise ValueError(f"tensor {name!r} has dtype {t['dtype']}, which numpy lacks")
            begin, end = t["data_offsets"]
            dtype = np.dtype(_ST_NUMPY[t["dtype"]]).newbyteorder("<")
            if end == begin:
                out[name] = np.zeros(t["shape"], dtype)
            else:
                out[name] = view(m, dtype, start + begin, tuple(t["shape"]))
    except (SafetensorError, OSError, ValueError) as e:
        raise BundleError(f"host tensors {path.name} cannot be read: {e}") from None
    for suffix, table in ((INT8_SCALES, Int8Table), (INT4_SCALES, Int4Table)):
        for name in [n for n in out if n.endswith(suffix)]:  # quantized tables: rows dequantized
            base = name.removesuffix(suffix)
            out[base] = table(base, out.get(base), out.pop(name))
    return out


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
        if not ok:
            got = "missing" if q is None else f"{q.dtype} {list(q.shape)}"
            raise BundleError(f"host table {name!r}: int8 rows ({got}) do not match their scales "
                              f"{list(scales.shape)}")
        self.q, self.scales = q, scales
        self.block = q.shape[1] // scales.shape[1]
        self.shape, self.ndim, self.dtype = q.shape, 2, np.dtype(np.float32)
        self.nbytes = q.nbytes + scales.nbytes

    def __getitem__(self, ids) -> np.ndarray:
        q, s = self.q[ids], self.scales[ids]
        if q.dtype == np.uint8:  # q - 128 as int8, exactly: the top bit flipped (a 2560-wide row
            q = q.view(np.int8) ^ np.int8(-128)  # 8.6 us, by a 256-entry float table 10.0)
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
        if not ok:
            got = "missing" if q is None else f"{q.dtype} {list(q.shape)}"
            raise BundleError(f"host table {name!r}: int4 rows ({got}) do not match their scales "
                              f"{list(scales.shape)}")
        self.q, self.scales = q, scales
        self.block = 2 * q.shape[1] // scales.shape[1]
        self.shape, self.ndim, self.dtype = (q.shape[0], 2 * q.shape[1]), 2, np.dtype(np.float32)
        self.nbytes = q.nbytes + scales.nbytes

    # byte -> its two columns' (nibble - 8), low nibble first: one np.take unpacks a row (a
    # 1024-wide row dequantized in 7.4 us; by shifts and masks 14.5, by fancy indexing 13.6; from
    # a bundle's mapped table 9.2 us, its int8 table 6.2)
    _PAIRS = np.stack([np.arange(256) & 0x0F, np.arange(256) >> 4], axis=-1).astype(np.float32) - 8

    def __getitem__(self, ids) -> np.ndarray:
        q, s = self.q[ids], self.scales[ids]  # [..., D / 2], [..., D / block]
        pairs = np.take(self._PAIRS, q, axis=0)  # [..., D / 2, 2]
        return (pairs.reshape(*q.shape[:-1], -1, self.block) * s[..., None]).reshape(
            *q.shape[:-1], 2 * q.shape[-1])


def shared_table(path: Path, name: str, ref) -> Int4Table | Int8Table:
    """Host table ``name`` from the weight file ``path`` (a manifest ``SharedRows``: a tied
    head's int4 or int8 rows and scales), memory-mapped like the other host tables. Ranges that
    do not fit the file or the table's shape are a BundleError naming both."""
    (V, D), block, bits = ref.shape, ref.block, ref.bits
    if V < 1 or D < 2 or block < 2 or block % 2 or D % block or bits not in (4, 8):
        raise BundleError(f"host table {name!r}: shape {[V, D]} does not split into int{bits} "
                          f"blocks of {block}")
    width = D * bits // 8  # bytes a row
    want = {"rows": V * width, "scales": V * (D // block) * 4}
    try:
        size = path.stat().st_size
        m = map_for_gathers(path)
    except (OSError, ValueError) as e:  # ValueError: mmap of an empty file
        raise BundleError(f"host table {name!r}: its weight file cannot be read: {e}") from None
    arrays = {}
    for part, dtype, shape in (("rows", np.uint8, (V, width)), ("scales", "<f4", (V, D // block))):
        offset, length = getattr(ref, part)
        if length != want[part] or offset < 0 or offset + length > size:
            raise BundleError(f"host table {name!r}: its {part} [{offset}, +{length}) do not fit "
                              f"{path.name} ({size:,} bytes) as {want[part]:,} bytes")
        arrays[part] = view(m, dtype, offset, shape)
    return (Int4Table if bits == 4 else Int8Table)(name, arrays["rows"], arrays["scales"])


def rope_tables(inv_freq: np.ndarray, attention_scaling: float,
                positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [positions, R] for positions 0 .. positions-1, fp32 as HF computes them: the
    host's rows, and the constant tables cpu graphs' GroupQueryAttention reads (built from this
    same function, so the two agree bit for bit). inv_freq [R/2]."""
    pos = np.arange(positions, dtype=np.float32)[:, None]
    freqs = pos * inv_freq.astype(np.float32)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    scale = np.float32(attention_scaling)
    return np.cos(emb) * scale, np.sin(emb) * scale


class HostInputs:
    def __init__(self, recipe: HostRecipe, tensors: dict[str, np.ndarray], max_positions: int,
                 placeholder_ids: list[int] = ()):
        self.recipe = recipe
        try:
            self.embed_table = tensors[recipe.embed.table]
            inv = {r.name: tensors[r.inv_freq].astype(np.float32) for r in recipe.ropes}
            self.extra = {e.name: tensors[e.table] for e in recipe.extra_embeds}
        except KeyError as e:
            raise BundleError(f"host tensor {e} named in the manifest is missing") from None
        if self.embed_table.ndim != 2:
            raise BundleError(f"embedding table must be 2-D, got {self.embed_table.shape}")
        self.embed_scale = np.float32(recipe.embed.scale)
        self.placeholder_ids = list(placeholder_ids)  # media placeholders (manifest encoders)
        self.max_positions = max_positions  # rows of the rope tables
        # cos/sin tables for every position a (padded) step can touch: [P, R]
        self.rope = {r.name: rope_tables(inv[r.name], r.attention_scaling, max_positions)
                     for r in recipe.ropes}
        # M-RoPE: which position axis (0 t, 1 h, 2 w) each of the R rotary columns reads
        self.mrope_axis = {r.name: mrope_axes(r.mrope_section, r.mrope_interleaved,
                                              inv[r.name].shape[0])
                           for r in recipe.ropes if r.mrope_section is not None}

    def media_ids(self, ids: np.ndarray) -> np.ndarray:
        """ids with media placeholder tokens replaced by the recipe's media_pad_id (if any): the
        host gathers read it there (the soft tokens replace the embedding rows afterwards)."""
        if self.recipe.media_pad_id is None or not self.placeholder_ids:
            return ids
        return np.where(np.isin(ids, self.placeholder_ids), self.recipe.media_pad_id, ids)

    @property
    def vocab_size(self) -> int:
        return self.embed_table.shape[0]

    def _embed_rows(self, ids: np.ndarray | int) -> np.ndarray:
        """ids [T] -> [T, H] float32 (a token id -> [H])."""
        h = self.embed_table[ids].astype(np.float32)
        return h * self.embed_scale if self.embed_scale != 1.0 else h

    def _extra_rows(self, e, ids: np.ndarray | int) -> np.ndarray:
        return self.extra[e.name][ids].astype(np.float32) * np.float32(e.scale)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids [T] -> hidden [1, T, H] float32."""
        return self._embed_rows(ids)[None]

    def extra_embeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Other per-token host gathers (e.g. Gemma-4 per-layer inputs): {name: [1, T, D]}."""
        return {e.name: self._extra_rows(e, ids)[None] for e in self.recipe.extra_embeds}

    def write_token_rows(self, token: int, rows: dict[str, np.ndarray]) -> None:
        """One token's embed() and extra_embeds() rows written in place, by the same float ops:
        rows["hidden"] and rows["host:<name>"] (a decode step's kept [1, 1, D] arrays, any float
        dtype); a media placeholder reads media_pad_id's rows, as media_ids()."""
        if token in self.placeholder_ids and self.recipe.media_pad_id is not None:
            token = self.recipe.media_pad_id
        rows["hidden"][...] = self._embed_rows(token)
        for e in self.recipe.extra_embeds:
            rows[f"host:{e.name}"][...] = self._extra_rows(e, token)

    def rope_tables(self, name: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions [T] (1-D, or M-RoPE text rows: t = h = w) or [3, T] (M-RoPE t, h, w)
        -> cos, sin [1, T, R]. Column j of an M-RoPE table depends only on its own axis'
        position, so it is a gather from the 1-D table: out[t, j] = table[pos[axis[j], t], j]."""
        cos, sin = self.rope[name]
        if positions.ndim == 1:
            p = int(positions[0]) if positions.shape[0] == 1 else -1
            if 0 <= p < cos.shape[0]:  # a decode step: views of one row, no gather
                return cos[p:p + 1][None], sin[p:p + 1][None]
            return cos[positions][None], sin[positions][None]
        axis = self.mrope_axis.get(name)
        if axis is None:
            raise BundleError(f"rope {name!r} got 3-D positions but declares no mrope_section")
        rows = positions[axis].T  # [T, R]: each column's own position
        cols = np.arange(axis.shape[0])[None]
        return cos[rows, cols][None], sin[rows, cols][None]


def mrope_axes(section: list[int], interleaved: bool, n_freq: int) -> np.ndarray:
    """[2 n_freq] axis (0 t, 1 h, 2 w) of each rotary column cat(f, f) (see RopeSpec).

    Interleaved is HF Qwen3-VL ``recomposition_frequencies``: start from t everywhere, then
    columns 1, 4, 7 .. < 3 h take h and 2, 5, 8 .. < 3 w take w."""
    if sum(section) != n_freq:
        raise BundleError(f"mrope_section {section} does not sum to the {n_freq} rope frequencies")
    axis = np.zeros(n_freq, dtype=np.int64)
    if interleaved:
        for a in (1, 2):
            axis[a:section[a] * 3:3] = a
    else:
        axis[section[0]:section[0] + section[1]] = 1
        axis[section[0] + section[1]:] = 2
    return np.concatenate([axis, axis])
