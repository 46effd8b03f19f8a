"""A Genie bundle's files: genie_config.json, htp_backend_ext_config.json, tokenizer.json.

    <bundle>/genie-<target>/             everything ``adb push`` takes, in AI Hub's layout (flat)
      genie_config.json                  the dialog: context, sampler, tokenizer, engine, binaries
      htp_backend_ext_config.json        soc_model, dsp_arch, weight sharing
      tokenizer.json                     the checkpoint's
      prompt_ar{N}_cl{C}_1_of_1.bin      the context binaries (build/genie.py), prefill first
      token_ar1_cl{C}_1_of_1.bin

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


def rope_config(hf_config: dict, head_dim: int) -> dict:
    """Genie's ``positional-encoding`` block from an HF config: Genie computes the cos/sin tables
    itself, so only rope types it knows can be expressed (theirs: docs/genie.md)."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise BuildError("--genie: the config names no rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise BuildError("--genie: partial rotary embeddings are not expressed yet")
    block = {"type": "rope", "rope-dim": head_dim // 2, "rope-theta": theta}
    if kind == "default":
        return block
    if kind == "llama3":
        block["rope-scaling"] = {
            "rope-type": "llama3", "factor": params["factor"],
            "low-freq-factor": params["low_freq_factor"],
            "high-freq-factor": params["high_freq_factor"],
            "original-max-position-embeddings": params["original_max_position_embeddings"]}
        return block
    if kind == "linear":
        block["rope-scaling"] = {"rope-type": "linear", "factor": params["factor"]}
        return block
    raise BuildError(f"--genie: rope type {kind!r} is not mapped to Genie's rope-scaling yet")


def bos_token(tokenizer_json: Path) -> int:
    """The id Genie should put before a prompt: the one the tokenizer's post-processor prepends
    (Genie's own tokenizer skips the post-processor and prepends ``bos-token`` instead), or -1."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a").ids
    return full[0] if len(full) == len(plain) + 1 and full[1:] == plain else -1


def dialog_config(manifest: Manifest, bins: list[str], bos: int, head_dim: int,
                  tokenizer: str = TOKENIZER, extensions: str = EXTENSIONS) -> dict:
    g = manifest.generation
    eos = g.eos_token_ids or [-1]
    return {"dialog": {
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
                           "kv-dim": head_dim, "allow-async-init": False}},
            "model": {"version": 1, "type": "binary",
                      "binary": {"version": 1, "ctx-bins": bins},
                      "positional-encoding": rope_config(manifest.hf_config, head_dim)}}}}


def backend_extensions(soc_model: int, htp_arch: int, weight_sharing: bool) -> dict:
    return {"devices": [{"soc_model": soc_model, "dsp_arch": f"v{htp_arch}",
                         "cores": [{"core_id": 0, "perf_profile": "burst",
                                    "rpc_control_latency": 100}]}],
            "memory": {"mem_type": "shared_buffer"},
            "context": {"weight_sharing_enabled": weight_sharing}}


def write_bundle_files(folder: Path, manifest: Manifest, bins: list[Path], tokenizer_json: Path,
                       soc_model: int, htp_arch: int, head_dim: int,
                       weight_sharing: bool = False) -> Path:
    """genie_config.json, htp_backend_ext_config.json and tokenizer.json beside ``bins`` (which
    are in ``folder`` already). -> the config's path."""
    if any(b.parent != folder for b in bins):
        raise BuildError("a Genie bundle's binaries must sit beside its genie_config.json")
    shutil.copy2(tokenizer_json, folder / TOKENIZER)
    cfg = dialog_config(manifest, [b.name for b in bins], bos_token(tokenizer_json), head_dim)
    (folder / EXTENSIONS).write_text(
        json.dumps(backend_extensions(soc_model, htp_arch, weight_sharing), indent=1) + "\n")
    (folder / CONFIG).write_text(json.dumps(cfg, indent=1) + "\n")
    return folder / CONFIG
