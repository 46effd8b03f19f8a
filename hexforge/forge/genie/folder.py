"""A Genie bundle's files: genie_config.json, htp_backend_ext_config.json, tokenizer.json.

    <bundle>/genie-<target>/             everything ``adb push`` takes, in AI Hub's layout (flat)
      genie_config.json                  the dialog: context, sampler, tokenizer, engine, binaries
      htp_backend_ext_config.json        soc_model, dsp_arch, weight sharing
      tokenizer.json                     the checkpoint's
      prompt_ar{N}_cl{C}_{i}_of_{n}.bin  the context binaries (forge/genie/decoder.py), per split i
      token_ar1_cl{C}_{i}_of_{n}.bin     (decoder_{i}_of_{n}.bin: both in one, weight-shared)
      embedding.u16                      Gemma-4: [token embedding | per-layer inputs] rows
                                         (embedding.f32 in a bundle with media nodes; a LUT
                                         a 16-bit one would make 4 GiB or more: embedding.u8
                                         + embedding.scale / embedding.offset, a scale a row)

Key by key these follow AI Hub's exporter (``qai_hub_models/utils/llm_helpers.py``
``create_genie_config``, ``save_htp_config_for_genie_bundle``); docs/genie.md has the sources.
Paths in genie_config.json are relative: Genie resolves them against its working directory, so
``genie-t2t-run`` runs from inside the folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ...bundle.errors import BuildError
from ...bundle.lade import LADE, lade_from
from ...bundle.lut import LutEncoding
from ...bundle.manifest import Manifest
from ...bundle.targets import Target
from ...runtime.genie.model import sampler_config
from ..context import StageContext

CONFIG = "genie_config.json"
EXTENSIONS = "htp_backend_ext_config.json"
TOKENIZER = "tokenizer.json"
CACHE_INDEX = "cache_index"  # families/genieio.CACHE_INDEX (that module imports torch)


def folder_name(target: str) -> str:
    return f"genie-{target}"


def rope_block(rope) -> dict:
    """Genie's positional-encoding entry for a ``families.base.GenieRope``."""
    block = {"type": "rope", "rope-dim": rope.dim, "rope-theta": rope.theta}
    if rope.prefix:
        block["prefix"] = rope.prefix
    if rope.scaling:
        block["rope-scaling"] = dict(rope.scaling)
    return block


def positional_encoding(spec) -> dict | list[dict]:
    """One entry for one rope (AI Hub's form), a list with a prefix per rope otherwise."""
    blocks = [rope_block(r) for r in spec.ropes]
    return blocks[0] if len(blocks) == 1 else blocks


def bos_token(tokenizer_json: Path) -> int:
    """The id Genie should put before a prompt: the one the tokenizer's post-processor prepends
    (Genie's own tokenizer skips the post-processor and prepends ``bos-token`` instead), or -1."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a").ids
    return full[0] if len(full) == len(plain) + 1 and full[1:] == plain else -1


def dialog_config(manifest: Manifest, bins: list[str], bos: int, spec,
                  tokenizer: str = TOKENIZER, extensions: str = EXTENSIONS,
                  lut: tuple[str, int, LutEncoding | None] | None = None,
                  cache_index: bool = False) -> dict:
    """``cache_index``: the graphs take the scatter form's ``cache_index``
    (``genieio.GenieContract.cache_index``), named in the default group's entry."""
    g = manifest.generation
    eos = g.eos_token_ids or [-1]
    model = {"version": 1, "type": "binary", "binary": {"version": 1, "ctx-bins": bins},
             "positional-encoding": positional_encoding(spec)}
    if spec.linear_attention:
        model["linear-attention"] = True
    dialog = {
        "version": 1, "type": "basic",
        "context": {"version": 1, "size": manifest.context, "n-vocab": manifest.vocab_size,
                    "bos-token": bos, "eos-token": eos if len(eos) > 1 else eos[0]},
        "sampler": sampler_config(g.temperature, g.top_k, g.top_p),
        "tokenizer": {"version": 1, "path": tokenizer},
        "engine": {
            "version": 1, "n-threads": 3,
            "backend": {
                "version": 1, "type": "QnnHtp", "extensions": extensions,
                # AI Hub's values; cpu-mask picks the big cores of a phone's CPU
                "QnnHtp": {"version": 1, "use-mmap": True, "spill-fill-bufsize": 0,
                           "mmap-budget": 0, "poll": True, "cpu-mask": "0xe0",
                           "kv-dim": spec.caches[0].kv_dim, "allow-async-init": False}},
            "model": model}}
    if len(spec.caches) > 1 or cache_index:  # the default group's mask is attention_mask
        groups = [{"version": 1, "prefix": c.prefix, "kv-dim": c.kv_dim} for c in spec.caches]
        groups[0]["attention-mask-tensor-name"] = "attention_mask"
        if cache_index:  # Genie then says where each new row goes ("scatter=true")
            groups[0]["cache-index-tensor-name"] = CACHE_INDEX
        dialog["engine"]["cache-groups"] = groups
    if lut is not None:  # Genie gathers the rows itself into inputs_embeds
        path, width, enc = lut
        dialog["embedding"] = {"version": 1, "type": "lut", "lut-path": path, "size": width,
                               "datatype": "float32"}
        if enc is not None and enc.per_row:  # Genie's PCQ: a scale / offset file, a value a row
            dialog["embedding"] |= {"datatype": "ufixed8", "quant-param": {
                "type": "pcq", "scale": ROW_SCALES, "offset": ROW_OFFSETS}}
        elif enc is not None:
            dialog["embedding"] |= {"datatype": "ufixed16", "quant-param": {
                "scale": enc.scale, "offset": -enc.zero_point}}
    return {"dialog": dialog}


def backend_extensions(soc_model: int, htp_arch: int, weight_sharing: bool) -> dict:
    return {"devices": [{"soc_model": soc_model, "dsp_arch": f"v{htp_arch}",
                         "cores": [{"core_id": 0, "perf_profile": "burst",
                                    "rpc_control_latency": 100}]}],
            "memory": {"mem_type": "shared_buffer"},
            "context": {"weight_sharing_enabled": weight_sharing}}


LUT = {True: "embedding.u16", False: "embedding.f32"}  # fixed point or not
ROW_LUT, ROW_SCALES, ROW_OFFSETS = "embedding.u8", "embedding.scale", "embedding.offset"
# (in the build's work folder) an 8-bit LUT's graph-input encoding [scale, zero_point]: what Genie
# turns its rows into, and what rows the host hands Genie must already be in (towers.py)
LUT_INPUT = "lut-input.json"
NEVER_ROW = 1  # rows past the vocabulary at the LUT's end: an eos-token Genie can read
# libGenie 1.21 holds a LUT's byte size in 32 bits: at 2^32 bytes or more it reads rows at
# offsets wrapped past 4 GiB ("T2E conversion overflow", a prompt id refused, other tokens),
# while rows past 2^31 bytes read right (docs/genie.md#the-lut-past-4-gib; the runs:
# docs/notes/genie-record.md)
LUT_CEILING = 1 << 32


def lut_bytes(rows: int, width: int, item: int) -> int:
    """A LUT's file size: ``rows`` of the vocabulary and the NEVER_ROW, ``item`` bytes a value."""
    return (rows + NEVER_ROW) * width * item


def needs_row_lut(rows: int, width: int) -> bool:
    """Whether Genie's LUT of ``rows`` x ``width`` goes 8-bit with a scale a row (Genie's PCQ):
    where a 16-bit one would reach LUT_CEILING (Gemma-4-E2B's 5.5 GB -> 2.75 GB, E4B's
    7.0 GB -> 3.5 GB). The build then writes the LUT's host tables in the same rows
    (``joint_row_scales``), so every backend runs the weights Genie runs."""
    return lut_bytes(rows, width, 2) >= LUT_CEILING


def row_quantize(rows) -> tuple[object, object]:
    """rows [r, W] float -> (uint8 [r, W], scales float32 [r]): symmetric, a scale a row
    (s = max|row| / 127, q = round(row / s) + 128; an all-zero row: s = 1). Rows the host holds
    in ``joint_row_scales``'s form come back as the host's own 8-bit values."""
    import numpy as np

    r = np.asarray(rows, np.float64)
    s = (np.abs(r).max(axis=1) / 127).astype(np.float32)
    s[s == 0] = 1.0
    q = np.clip(np.rint(r / s[:, None].astype(np.float64)), -127, 127) + 128
    return q.astype(np.uint8), s


def joint_row_scales(tables: list[tuple[object, float]], block: int = 8192) -> list[object]:
    """The host scales that make each LUT row one 8-bit row (``needs_row_lut``): for tables
    (rows [V, D_k], LUT factor f_k) side by side in the LUT, s[v] = max_k max|x_k[v] f_k| / 127,
    and table k's rows int8 with one scale a row, s / f_k -> [scales float32 [V] per table].
    (Table k gathered, times f_k, is then (q x s / f_k) x f_k: the LUT row ``row_quantize``
    reads back as the same q.)"""
    import numpy as np
    import torch

    V = tables[0][0].shape[0]
    peak = np.zeros(V, np.float64)
    for t, f in tables:
        for a in range(0, V, block):
            part = torch.as_tensor(t[a:a + block]).to(torch.float32).abs().amax(dim=1)
            peak[a:a + block] = np.maximum(peak[a:a + block], part.double().numpy() * abs(f))
    s = peak / 127
    s[s == 0] = 1.0
    return [(s / f).astype(np.float32) for _, f in tables]


def _lut_parts(host_file: Path, tables: tuple[tuple[str, float], ...]):
    from ...bundle.hostfile import load_host_tensors

    host = load_host_tensors(host_file)
    parts = [(host[name], scale) for name, scale in tables]
    rows = parts[0][0].shape[0]
    if any(t.shape[0] != rows for t, _ in parts):
        raise BuildError(f"the tables of Genie's embedding LUT differ in rows: {tables}")
    return parts, rows


def _lut_blocks(parts, rows: int, flag: bool, block: int = 4096):
    """The LUT's float32 rows, a block at a time: each row the tables' rows x scale, side by
    side, then a 0.0 media-flag column where the spec asks for one (``GenieSpec.media_flag``)."""
    import numpy as np

    for start in range(0, rows, block):
        cols = [np.asarray(t[start:start + block], np.float32) * np.float32(s) for t, s in parts]
        if flag:
            cols.append(np.zeros((cols[0].shape[0], 1), np.float32))
        yield np.concatenate(cols, axis=1)


def lut_encoding(host_file: Path, spec, cover: float = 0.0) -> LutEncoding:
    """The 16-bit encoding that covers every value of ``spec``'s LUT (and 0, a media flag's
    1.0, and [-cover, cover]: the media rows the towers can emit, towers.media_row_bound);
    the file a scale a row where a 16-bit one would reach ``LUT_CEILING``."""
    parts, rows = _lut_parts(host_file, spec.lut)
    lo, hi = -cover, max(cover, 1.0 if spec.media_flag else 0.0)
    for block in _lut_blocks(parts, rows, spec.media_flag):
        lo, hi = min(lo, float(block.min())), max(hi, float(block.max()))
    scale = (hi - lo) / 65535 or 1.0
    width = sum(int(t.shape[1]) for t, _ in parts) + int(spec.media_flag)
    return LutEncoding(scale=scale, zero_point=round(-lo / scale),
                       per_row=needs_row_lut(rows, width))


def write_lut(host_file: Path, spec, encoding: LutEncoding | None, dst: Path) -> int:
    """Genie's embedding LUT: each row the rows of ``spec.lut`` (host table, scale) side by side
    (Gemma-4: the token embedding x sqrt(H), then its per-layer inputs x sqrt(P); Qwen3-VL: the
    token embedding, then its media flag, 0.0), in
    ``encoding`` (None: float32), a block of rows at a time, written beside and renamed; then
    one row of zeros at index V (``NEVER_ROW``). -> the row width.

    Why the extra row: Genie reads its eos-token's row of the LUT, and the -1 that turns EOS
    off made libGenie read before the table and segfault (tiny Qwen3.5 / Gemma-3, every run);
    id V is a row Genie can read that the sampler never picks (logits have V entries), so
    --ignore-eos gives eos-token V (``runtime.genie_model.never_eos``)."""
    import numpy as np

    parts, rows = _lut_parts(host_file, spec.lut)
    width = sum(int(t.shape[1]) for t, _ in parts) + int(spec.media_flag)
    if encoding is None and lut_bytes(rows, width, 4) >= LUT_CEILING:
        raise BuildError(f"--genie: a float32 embedding LUT of {rows:,} x {width:,} is "
                         f"{lut_bytes(rows, width, 4) / 2**30:.1f} GiB, past the 4 GiB libGenie "
                         "reads right; refused")
    tmp = dst.with_name(dst.name + ".partial")
    scales = []
    with open(tmp, "wb") as f:
        for block in (*_lut_blocks(parts, rows, spec.media_flag),
                      np.zeros((NEVER_ROW, width), np.float32)):
            if encoding is None:
                block.tofile(f)
            elif encoding.per_row:
                q, s = row_quantize(block)
                q.tofile(f)
                scales.append(s)
            else:
                encoding.quantize(block).tofile(f)
    if scales:  # Genie's PCQ files: float32 scales, int32 offsets (real = s x (q + offset))
        s = np.concatenate(scales)
        s.tofile(dst.parent / ROW_SCALES)
        np.full(s.shape, -128, np.int32).tofile(dst.parent / ROW_OFFSETS)
    tmp.replace(dst)
    return width


def write_bundle_files(ctx: StageContext, folder: Path, manifest: Manifest, bins: list[Path],
                       target: Target, spec, lut: LutEncoding | None = None) -> Path:
    """genie_config.json, htp_backend_ext_config.json, tokenizer.json (and the embedding LUT, from
    the build's host tables, where the family has Genie gather its inputs) beside ``bins`` (which
    are in ``folder`` already), for ``target``'s arch and SoC. -> the config's path."""
    tokenizer_json = ctx.root / manifest.tokenizer.dir / "tokenizer.json"
    host_file = ctx.root / "host.safetensors"
    cache_index = ctx.opts.genie_kv != "concat"  # the decoder's graphs take a cache_index
    if any(b.parent != folder for b in bins):
        raise BuildError("a Genie bundle's binaries must sit beside its genie_config.json")
    shutil.copy2(tokenizer_json, folder / TOKENIZER)
    table = None
    if spec.lut:
        name = ROW_LUT if lut is not None and lut.per_row else LUT[lut is not None]
        table = (name, write_lut(host_file, spec, lut, folder / name), lut)
    cfg = dialog_config(manifest, [b.name for b in bins], bos_token(tokenizer_json), spec,
                        lut=table, cache_index=cache_index)
    (folder / EXTENSIONS).write_text(
        json.dumps(backend_extensions(target.default_soc.soc_model, target.htp_arch,
                                      ctx.opts.share_weights), indent=1) + "\n")
    (folder / CONFIG).write_text(json.dumps(cfg, indent=1) + "\n")
    if ctx.opts.genie_kv == "lade":  # the graphs are guarded: the lookahead dialog's defaults
        (folder / LADE).write_text(json.dumps(lade_from(ctx.opts.genie_lade)) + "\n")
    return folder / CONFIG
