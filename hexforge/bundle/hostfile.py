"""Reading host.safetensors and a weight file's shared table rows: the header validated against
the file before anything is mapped, then read-only memory maps the host gathers rows from.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import BundleError
from .qtables import INT4_SCALES, INT8_SCALES, HostTable, Int4Table, Int8Table

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
    read-around window: a cold row costs ten times as much (docs/notes/measurements.md)."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_RANDOM"):  # not on Windows
        m.madvise(mmap.MADV_RANDOM)
    return m


def view(m: mmap.mmap, dtype, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    """``shape`` x ``dtype`` at byte ``offset`` of the map, as a plain read-only ndarray (it keeps
    the map alive; a row gather from it costs half what indexing a np.memmap does)."""
    return np.frombuffer(m, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)


def load_host_tensors(path: Path) -> dict[str, HostTable]:
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
        out: dict[str, HostTable] = {}
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
            rows, scales = out.get(base), out.pop(name)
            assert not isinstance(rows, Int8Table | Int4Table)  # read as arrays above
            assert not isinstance(scales, Int8Table | Int4Table)
            out[base] = table(base, rows, scales)
    return out


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
