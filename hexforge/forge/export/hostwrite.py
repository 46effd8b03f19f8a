"""Writing a bundle's host.safetensors: the tables the host gathers from (embeddings, per-layer
tables) and small constants (rope inv_freq), streamed a chunk of rows at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...bundle.qtables import INT4_SCALES, INT8_SCALES, int4_blocks, int8_blocks


def write_host_tensors(path: Path, tensors: dict,
                       quantized: dict[str, tuple[int, int]] | None = None,
                       row_scales: dict[str, np.ndarray] | None = None) -> None:
    """safetensors with floating torch tensors in the precision they hold: bf16 and fp16 tables
    as they are (BF16 / F16; the runtime upcasts the rows it gathers, which is exact), any other
    as F32, converted a chunk of rows at a time (a table never exists whole twice in memory).
    F32 would double a bf16 checkpoint's tables: Gemma-4-E2B's per-layer table 9.4 GB instead of
    4.7, Qwen3.5-0.8B's embedding 1.02 GB instead of 0.51.
    The tables named in ``quantized`` (name -> (bits, block)) are written as 8-bit rows + per-block
    scales (bundle/qtables.py ``Int8Table``; its own block) or int4 rows + scales per ``block``
    columns (``Int4Table``), a chunk at a time too. The tables in ``row_scales`` (name -> float32
    [V], a scale a row: a Genie LUT past 4 GiB, ``forge/genie/folder.joint_row_scales``) as int8
    rows with those scales (``Int8Table``, one block a row). numpy arrays are written as they are."""
    import torch

    def blocks_of(bits: int, block: int):  # (first row, rows [r, D] float32) -> (q, scales)
        return lambda start, rows: (int8_blocks if bits == 8 else int4_blocks)(rows, block)

    def given_rows(scales: np.ndarray):  # int8 rows at the given scale, one a row
        def quant(start: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            s = scales[start:start + rows.shape[0], None]
            return np.clip(np.rint(rows / s), -127, 127).astype(np.int8), s
        return quant

    np_st = {np.dtype(k): v for k, v in (("float32", "F32"), ("float16", "F16"), ("float64", "F64"),
             ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"),
             ("uint8", "U8"), ("bool", "BOOL"))}
    # torch dtype -> (safetensors dtype, bytes, the dtype whose bits are written)
    kept = {torch.bfloat16: ("BF16", 2, torch.int16), torch.float16: ("F16", 2, torch.float16)}
    items = []
    for name, t in tensors.items():
        if name in (quantized or {}) or name in (row_scales or {}):  # a 2-D table's rows and
            # their scales, both made chunk by chunk below (each chunk is quantized twice, once
            # per item: cheaper than holding either)
            t = torch.as_tensor(t)
            if t.dim() != 2:
                raise ValueError(f"host table {name!r} is {t.dim()}-D; quantized tables are 2-D")
            bits, block = (8, t.shape[1]) if name in (row_scales or {}) else quantized[name]
            quant = (given_rows(row_scales[name]) if name in (row_scales or {})
                     else blocks_of(bits, block))
            q, sc = quant(0, np.zeros((1, t.shape[1]), np.float32))
            st, suffix = np_st[q.dtype], INT8_SCALES if bits == 8 else INT4_SCALES
            items.append((name, st, 1, [t.shape[0], q.shape[1]], ("rows", t, quant)))
            items.append((name + suffix, "F32", 4, [t.shape[0], sc.shape[1]], ("scales", t, quant)))
            continue
        if isinstance(t, torch.Tensor):
            if t.is_floating_point():
                st, size, _ = kept.get(t.dtype, ("F32", 4, None))
                items.append((name, st, size, list(t.shape), t))
                continue
            t = t.numpy()
        t = np.ascontiguousarray(t)
        items.append((name, np_st[t.dtype], t.dtype.itemsize, list(t.shape), t))
    items.sort(key=lambda x: (-x[2], x[0]))  # wider dtypes first: every tensor stays aligned
    header, off = {}, 0
    for name, dt, size, shape, _ in items:
        n = int(np.prod(shape, dtype=np.int64)) * size
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for *_, t in items:
            if isinstance(t, np.ndarray):
                f.write(memoryview(t.reshape(-1)).cast("B"))
                continue
            part, t, quant = t if isinstance(t, tuple) else (None, t, None)
            flat = t.detach().reshape(t.shape[0], -1) if t.dim() > 1 else t.detach().reshape(1, -1)
            rows = max(1, (64 << 20) // max(1, flat.shape[1] * 4))  # ~64 MB of fp32 at a time
            for i in range(0, flat.shape[0], rows):
                chunk = flat[i:i + rows].contiguous()
                if part is not None:  # a quantized table's rows or scales
                    chunk = quant(i, chunk.to(torch.float32).numpy())[part == "scales"]
                else:
                    chunk = (chunk.view(kept[t.dtype][2]) if t.dtype in kept
                             else chunk.to(torch.float32)).numpy()
                f.write(memoryview(np.ascontiguousarray(chunk).reshape(-1)).cast("B"))
