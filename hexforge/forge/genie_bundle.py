"""A Genie bundle's files: genie_config.json, htp_backend_ext_config.json, tokenizer.json.

    <bundle>/genie-<target>/             everything ``adb push`` takes, in AI Hub's layout (flat)
      genie_config.json                  the dialog: context, sampler, tokenizer, engine, binaries
      htp_backend_ext_config.json        soc_model, dsp_arch, weight sharing
      tokenizer.json                     the checkpoint's
      prompt_ar{N}_cl{C}_{i}_of_{n}.bin  the context binaries (forge/genie.py), per split i
      token_ar1_cl{C}_{i}_of_{n}.bin     (decoder_{i}_of_{n}.bin: both in one, weight-shared)
      per_layer_embedding.f32            Gemma-4: the per-layer table Genie gathers from

Key by key these follow AI Hub's exporter (``qai_hub_models/utils/llm_helpers.py``
``create_genie_config``, ``save_htp_config_for_genie_bundle``); docs/genie.md has the sources.
Paths in genie_config.json are relative: Genie resolves them against its working directory, so
``genie-t2t-run`` runs from inside the folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import BuildError
from ..manifest import Manifest
from ..runtime.genie_model import sampler_config

CONFIG = "genie_config.json"
EXTENSIONS = "htp_backend_ext_config.json"
TOKENIZER = "tokenizer.json"


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
                  per_layer_lut: tuple[str, int] | None = None) -> dict:
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
                           "kv-dim": spec.kv_dim, "allow-async-init": False}},
            "model": model}}
    if per_layer_lut is not None:  # Genie gathers the rows into per_layer_inputs
        path, width = per_layer_lut
        dialog["perlayer-embedding"] = {"version": 1, "type": "lut", "lut-path": path,
                                        "size": width, "datatype": "float32"}
    return {"dialog": dialog}


def backend_extensions(soc_model: int, htp_arch: int, weight_sharing: bool) -> dict:
    return {"devices": [{"soc_model": soc_model, "dsp_arch": f"v{htp_arch}",
                         "cores": [{"core_id": 0, "perf_profile": "burst",
                                    "rpc_control_latency": 100}]}],
            "memory": {"mem_type": "shared_buffer"},
            "context": {"weight_sharing_enabled": weight_sharing}}


PER_LAYER_LUT = "per_layer_embedding.f32"


def write_per_layer_lut(host_file: Path, table: str, scale: float, dst: Path) -> int:
    """The per-layer embedding table [V, L*P] x ``scale`` as raw float32 rows (Genie's ``lut``),
    a block of rows at a time (Gemma-4-E2B's is 262,144 x 8,960), written beside and renamed.
    -> the row width."""
    import numpy as np

    from ..runtime.hostfile import load_host_tensors

    rows = load_host_tensors(host_file)[table]
    tmp = dst.with_name(dst.name + ".partial")
    with open(tmp, "wb") as f:
        for start in range(0, rows.shape[0], 4096):
            block = np.asarray(rows[start:start + 4096], np.float32)
            (block * np.float32(scale)).tofile(f)
    tmp.replace(dst)
    return int(rows.shape[1])


def write_bundle_files(folder: Path, manifest: Manifest, bins: list[Path], tokenizer_json: Path,
                       soc_model: int, htp_arch: int, spec, host_file: Path,
                       weight_sharing: bool = False) -> Path:
    """genie_config.json, htp_backend_ext_config.json, tokenizer.json (and the per-layer
    embedding table where the family has one) beside ``bins`` (which are in ``folder``
    already). -> the config's path."""
    if any(b.parent != folder for b in bins):
        raise BuildError("a Genie bundle's binaries must sit beside its genie_config.json")
    shutil.copy2(tokenizer_json, folder / TOKENIZER)
    lut = None
    if spec.per_layer_table is not None:
        table, scale = spec.per_layer_table
        lut = (PER_LAYER_LUT, write_per_layer_lut(host_file, table, scale, folder / PER_LAYER_LUT))
    cfg = dialog_config(manifest, [b.name for b in bins], bos_token(tokenizer_json), spec,
                        per_layer_lut=lut)
    (folder / EXTENSIONS).write_text(
        json.dumps(backend_extensions(soc_model, htp_arch, weight_sharing), indent=1) + "\n")
    (folder / CONFIG).write_text(json.dumps(cfg, indent=1) + "\n")
    return folder / CONFIG
