"""Reading a HF checkpoint: a local directory (the layout ``hf download`` writes), a hub id
through the HF cache, or a GGUF file; safetensors only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...bundle.errors import CheckpointError
from ...bundle.manifest import MANIFEST_NAME

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
    the HF cache (``forge/source/hub.py``); or a GGUF file (or a dir holding one), converted once into
    a cached checkpoint dir (``forge/source/gguf.py``), whose dequantized fp32 model is then the oracle."""
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
    if (d / MANIFEST_NAME).is_file():  # built already: "no config.json" sent people looking for one
        raise CheckpointError(f"{d} is a hexforge bundle (it has {MANIFEST_NAME}), not a checkpoint "
                              f"to build from: run it (hexforge run {d} PROMPT, hexforge chat {d}) "
                              f"or look inside (hexforge inspect {d}); build from the HF checkpoint "
                              "it was made from")
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
