"""A tied embedding stored once in a cpu-only int4 bundle.

    host.safetensors                       cpu/s0.weights (the last shard's)
    ┌──────────────────────────────┐       ┌──────────────────────────────────────────┐
    │ embed_tokens       U8 [V,D/2]│  ==   │ head MatMulNBits B      [V, D/blk, blk/2] │
    │ embed_tokens.int4_scales     │  ==   │ head MatMulNBits scales [V * D/blk]       │
    │ rope inv_freq, other tables  │       │ ...                                      │
    └──────────────────────────────┘       └──────────────────────────────────────────┘

A tied head's weight is the embedding table transposed, and both go through onnxruntime's
int4 quantizer with rows as its N, so the two hold the same bytes (runtime/host.py
``Int4Table``). Where they do, byte for byte, the table leaves host.safetensors and the manifest
points at the head's ranges (``SharedRows``): Qwen3-0.6B int4-b128 stores 82 MB less. Bundles
with HTP targets keep their int8 table and are not touched (host_table_formats).
"""

from __future__ import annotations

from pathlib import Path

from ..manifest import SharedRows, TargetSpec
from ..runtime.host import INT4_SCALES, check_safetensors_header


def _external_range(model, name: str) -> tuple[str, int, int] | None:
    """(location, offset, length) of initializer ``name`` stored as external data, else None."""
    from onnx.external_data_helper import ExternalDataInfo

    t = next((t for t in model.graph.initializer if t.name == name), None)
    if t is None or not t.external_data:
        return None
    info = ExternalDataInfo(t)
    return (info.location, info.offset or 0, info.length) if info.length else None


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _data_start(path: Path) -> int:
    """Where a safetensors file's data region begins (its 8-byte header length + the header)."""
    return 8 + int.from_bytes(_read(path, 0, 8), "little")


def share_tied_embedding(bundle: Path, target: TargetSpec, table: str) -> SharedRows | None:
    """Where ``target``'s head MatMulNBits holds the same bytes as int4 host table ``table`` in
    ``bundle``/host.safetensors: drop the table from that file and -> the SharedRows to put in
    the manifest. None (nothing changed) where the table is not int4 or any byte differs."""
    import onnx

    host = bundle / "host.safetensors"
    header = check_safetensors_header(host)
    if table not in header or table + INT4_SCALES not in header:
        return None
    head = next((g for g in target.graphs if g.role == "head"), None)
    if head is None:
        return None
    model = onnx.load(str(bundle / head.file), load_external_data=False)
    node = next((n for n in model.graph.node if n.op_type == "MatMulNBits"), None)
    if node is None or len(node.input) != 3:  # zero points, g_idx or bias: not this layout
        return None
    ranges = [_external_range(model, name) for name in node.input[1:3]]
    if None in ranges or ranges[0][0] != ranges[1][0]:
        return None
    data_start = _data_start(host)
    weights = (bundle / head.file).parent / ranges[0][0]
    for (_, offset, length), name in zip(ranges, (table, table + INT4_SCALES), strict=True):
        begin, end = header[name]["data_offsets"]
        if length != end - begin or _read(weights, offset, length) != _read(
                host, data_start + begin, length):
            return None
    V, half = header[table]["shape"]
    blocks = header[table + INT4_SCALES]["shape"][1]
    drop_host_tensors(host, {table, table + INT4_SCALES})
    return SharedRows(file=weights.relative_to(bundle).as_posix(), rows=ranges[0][1:],
                      scales=ranges[1][1:], shape=(V, 2 * half), block=2 * half // blocks)


def drop_host_tensors(path: Path, names: set[str]) -> None:
    """Rewrite safetensors ``path`` without ``names``, the others' bytes copied as they are, in
    their order, through a temporary file. write_host_tensors puts wider dtypes first, so a dropped
    tensor (a whole number of its elements) shifts only tensors of its width or narrower: every
    one stays aligned."""
    import json

    header = check_safetensors_header(path)
    data_start = _data_start(path)
    kept = sorted(((k, v) for k, v in header.items() if k != "__metadata__" and k not in names),
                  key=lambda kv: kv[1]["data_offsets"][0])
    out, off = {}, 0
    for name, t in kept:
        begin, end = t["data_offsets"]
        out[name] = {**t, "data_offsets": [off, off + end - begin]}
        off += end - begin
    if "__metadata__" in header:
        out["__metadata__"] = header["__metadata__"]
    raw = json.dumps(out, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(len(raw).to_bytes(8, "little"))
        dst.write(raw)
        for _, t in kept:
            begin, end = t["data_offsets"]
            src.seek(data_start + begin)
            _copy(src, dst, end - begin)
    tmp.replace(path)


def _copy(src, dst, n: int, chunk: int = 64 << 20) -> None:
    while n > 0:
        buf = src.read(min(chunk, n))
        if not buf:
            raise OSError("the file ended early")
        dst.write(buf)
        n -= len(buf)

