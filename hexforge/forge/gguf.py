"""GGUF input: a llama.cpp ``.gguf`` file as a checkpoint, through transformers' own GGUF loader.

    MODEL.gguf ──transformers (gguf_file=…): dequantized to fp32──▶ HF model + tokenizer
               ──save_pretrained (safetensors) into the cache──▶ an ordinary checkpoint dir
               (config.json, model.safetensors, tokenizer.json, chat template, generation config)

The dequantized fp32 model is the oracle: the bundle is judged against what the GGUF holds, not
against the (unavailable) weights it was quantized from. transformers marks a GGUF-loaded model
as quantized, which ``save_pretrained`` refuses, so its state dict is copied into a plain
``from_config`` model first.

The conversion runs once per file: the cache key is the file's sha256, and a conversion writes
into a temp dir renamed into place at the end (a killed conversion leaves nothing that looks
done). The cache lives in ``$HEXFORGE_CACHE/gguf`` (default ``~/.cache/hexforge/gguf``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..errors import CheckpointError

GGUF_MAGIC = b"GGUF"


def cache_root() -> Path:
    return Path(os.environ.get("HEXFORGE_CACHE") or Path.home() / ".cache" / "hexforge") / "gguf"


def find_gguf(path: str | Path) -> Path | None:
    """``path`` if it is a .gguf file, the one .gguf in a dir without config.json, else None
    (a dir with several .gguf files and no config.json is an error: which one is meant?)."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:4])
        raise CheckpointError(f"{p} holds several .gguf files ({names}); give the file itself")
    return found[0] if found else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def gguf_checkpoint(path: str | Path, log=None) -> Path:
    """The checkpoint dir converted from GGUF file ``path`` (converted now if not cached)."""
    src = Path(path)
    with open(src, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise CheckpointError(f"{src} is not a GGUF file (no GGUF magic)")
    out = cache_root() / _sha256(src)[:24]
    if (out / "config.json").is_file():
        return out
    if log:
        log(f"converting {src.name} (GGUF, dequantized to fp32) into {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(src, tmp)
        (tmp / "hexforge_gguf.json").write_text(json.dumps({"source": src.name}))
        try:
            os.replace(tmp, out)
        except OSError:  # a concurrent conversion of the same file finished first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kw = {"gguf_file": src.name}
    quiet = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # transformers' per-tensor bar: the build logs its own line
    try:
        config = AutoConfig.from_pretrained(str(src.parent), **kw)
        loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kw)
    except (ValueError, KeyError, RuntimeError, OSError) as e:  # an architecture transformers'
        # GGUF loader does not know, or a corrupt file
        raise CheckpointError(f"{src}: transformers cannot load this GGUF file "
                              f"({' '.join(str(e).split())[:300]})") from None
    finally:
        if quiet is None:
            os.environ.pop("TQDM_DISABLE")
        else:
            os.environ["TQDM_DISABLE"] = quiet
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing = model.load_state_dict(loaded.state_dict(), strict=False).missing_keys
    missing = [k for k in missing if k not in _tied(model)]
    if missing:
        raise CheckpointError(f"{src}: the GGUF has no values for {', '.join(missing[:3])}")
    dst.mkdir(parents=True)
    model.save_pretrained(str(dst), safe_serialization=True)
    tokenizer.save_pretrained(str(dst))
    GenerationConfig.from_model_config(loaded.config).save_pretrained(str(dst))
    if not (dst / "tokenizer.json").is_file():
        raise CheckpointError(f"{src}: its tokenizer has no fast (tokenizer.json) form")


def _tied(model) -> set[str]:
    """Parameter names that share a tensor with another (a tied head)."""
    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied |= {name, seen[id(p)]}
        seen.setdefault(id(p), name)
    return tied
