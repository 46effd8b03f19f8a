"""Reading a HF checkpoint: a local directory (the layout ``hf download`` writes), a hub id
through the HF cache, or a GGUF file; safetensors only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
MAX_JSON_BYTES = 64 * 1024 * 1024


@dataclass
class Checkpoint:
    dir: Path
    config: dict
    generation: dict
    tokenizer_files: list[str]

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")


def _read_json(path: Path) -> dict:
    if path.stat().st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path} is too large to be a config file")
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:  # deeply nested arrays overflow json's recursion
        raise CheckpointError(f"{path} nests JSON too deeply") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def read_checkpoint(path: str | Path, log=None) -> Checkpoint:
    """A HF checkpoint dir; a hub id ``ORG/NAME`` with nothing on disk by that name, resolved in
    the HF cache (``forge/hub.py``); or a GGUF file (or a dir holding one), converted once into
    a cached checkpoint dir (``forge/gguf.py``), whose dequantized fp32 model is then the oracle."""
    from .gguf import find_gguf, gguf_checkpoint
    from .hub import hub_checkpoint, is_hub_id

    if is_hub_id(path):
        d = hub_checkpoint(str(path), log)
    else:
        gguf = find_gguf(path)
        d = gguf_checkpoint(gguf, log) if gguf else Path(path)
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory (expected a local HF checkpoint dir, a hub "
                              "id ORG/NAME or a .gguf file)")
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d} has no config.json; is it a HF checkpoint directory?")
    config = _read_json(d / "config.json")
    safetensors = sorted(d.glob("*.safetensors"))
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not safetensors:
        if pickles:
            raise CheckpointError(
                f"{d} has only pickle weights ({', '.join(pickles[:3])}); hexforge reads "
                "safetensors only (pickle can run code). Convert them to safetensors first.")
        raise CheckpointError(f"{d} has no *.safetensors weights")
    if not (d / "tokenizer.json").is_file():
        raise CheckpointError(f"{d} has no tokenizer.json (a fast tokenizer file is required)")
    gen = d / "generation_config.json"
    return Checkpoint(
        dir=d, config=config, generation=_read_json(gen) if gen.is_file() else {},
        tokenizer_files=[f for f in TOKENIZER_FILES if (d / f).is_file()],
    )


# ---- giving back the pages of mapped files ----------------------------------------------------
# transformers maps the safetensors (MAP_PRIVATE) and the build's calibration sessions map their
# weight files: every page the build has read once stays in this process's RSS until unmapped.
# After the host tensors, that is the whole checkpoint (Gemma-4-E2B: 8.7 of a 17 GB peak), though
# each later stage reads one shard of it. The pages are clean copies of their files: dropping them
# costs a page-cache fault on the next read. A mapping holding private (copy-on-write) pages is
# left alone: MADV_DONTNEED would throw those writes away.
MADV_DONTNEED = 4


def release_mapped_pages(*roots: str | Path) -> int:
    """Drop this process's resident pages of files mapped from under ``roots`` (nothing is
    unmapped: the next read faults them back in). -> bytes given back (0 where there is no
    /proc/self/smaps: Linux only)."""
    import ctypes
    import re

    # the files themselves: a HF cache snapshot holds symlinks into the repo's blobs/
    found = {Path(r).resolve() for r in roots}
    for r in roots:
        if Path(r).is_dir():
            found |= {f.resolve().parent for f in Path(r).iterdir() if f.is_symlink()}
    dirs = [str(d) + "/" for d in found]
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    spans, cur = [], None  # (start, end, rss bytes) of clean mappings under roots
    for line in smaps.splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)", line)
        if m:
            cur = None
            if any(m[3].startswith(d) for d in dirs):
                cur = [int(m[1], 16), int(m[2], 16), 0]
                spans.append(cur)
        elif cur is not None and line.startswith("Rss:"):
            cur[2] = int(line.split()[1]) * 1024
        elif cur is not None and line.startswith("Anonymous:") and int(line.split()[1]):
            spans.remove(cur)  # copy-on-write pages: its own data, not the file's
            cur = None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    freed = 0
    for start, end, rss in spans:
        if rss and libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            freed += rss
    return freed
