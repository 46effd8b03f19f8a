"""Reading a local HF checkpoint directory (the layout ``hf download`` writes), safetensors only."""

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


def read_checkpoint(path: str | Path) -> Checkpoint:
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory (expected a local HF checkpoint dir)")
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
