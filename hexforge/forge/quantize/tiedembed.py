"""A tied embedding stored once in a cpu-only quantized bundle.

    host.safetensors                       cpu/s0.weights (the last shard's)
    ┌──────────────────────────────┐       ┌──────────────────────────────────────────┐
    │ embed_tokens     U8 [V,D/2]  │  ==   │ head MatMulNBits B      [V, D/blk, blk/2] │  int4
    │   (int8: U8 [V, D])          │       │   (int8: [V, D/blk, blk])                │
    │ embed_tokens.int4_scales     │  ==   │ head MatMulNBits scales [V, D/blk]        │
    │ rope inv_freq, other tables  │       │ ...                                      │
    └──────────────────────────────┘       └──────────────────────────────────────────┘

A tied head's weight is the embedding table transposed, and both go through onnxruntime's
4- or 8-bit quantizer with rows as its N, so the two hold the same bytes (bundle/qtables.py
``Int4Table``, ``Int8Table``). Where they do, byte for byte, the table leaves host.safetensors and
the manifest points at the head's ranges (``SharedRows``): Qwen3-0.6B stores 82 MB less at
int4-b128, 175 MB at int8. Bundles with HTP targets keep their own table (forge/pipeline.py):
an HTP deployment must not need the cpu target's weight file to embed its tokens.
"""

from __future__ import annotations

from pathlib import Path

from ...bundle.hostfile import check_safetensors_header
from ...bundle.manifest import SharedRows, TargetSpec
from ...bundle.qtables import INT4_SCALES, INT8_SCALES


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
    """Where ``target``'s head MatMulNBits holds the same bytes as the int4 or int8 host table
    ``table`` in ``bundle``/host.safetensors: drop the table from that file and -> the SharedRows
    to put in the manifest. None (nothing changed) where the table is neither or any byte
    differs."""
    import onnx

    host = bundle / "host.safetensors"
    header = check_safetensors_header(host)
    bits = next((b for b, suffix in ((4, INT4_SCALES), (8, INT8_SCALES))
                 if table + suffix in header), None)
    head = next((g for g in target.graphs if g.role == "head"), None)
    if bits is None or head is None or header.get(table, {}).get("dtype") != "U8":
        return None  # I8 rows (zero point 0, a width the block does not divide): not its layout
    scales = table + (INT4_SCALES if bits == 4 else INT8_SCALES)
    model = onnx.load(str(bundle / head.file), load_external_data=False)
    node = next((n for n in model.graph.node if n.op_type == "MatMulNBits"), None)
    if node is None or len(node.input) != 3:  # zero points, g_idx or bias: not this layout
        return None
    ranges = [_external_range(model, name) for name in node.input[1:3]]
    if None in ranges or ranges[0][0] != ranges[1][0]:
        return None
    data_start = _data_start(host)
    weights = (bundle / head.file).parent / ranges[0][0]
    for (_, offset, length), name in zip(ranges, (table, scales), strict=True):
        begin, end = header[name]["data_offsets"]
        if length != end - begin or _read(weights, offset, length) != _read(
                host, data_start + begin, length):
            return None
    V, width = header[table]["shape"]
    D, blocks = width * 8 // bits, header[scales]["shape"][1]
    drop_host_tensors(host, {table, scales})
    return SharedRows(file=weights.relative_to(bundle).as_posix(), rows=ranges[0][1:],
                      scales=ranges[1][1:], shape=(V, D), block=D // blocks, bits=bits)


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

