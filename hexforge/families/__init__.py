"""Family dispatch: ``config.model_type`` -> ``hexforge.families.<module>`` via importlib.

One file per HF model_type; REMAP sends architecture twins to the file that already handles them
(e.g. qwen2 = llama with q/k/v biases, which the reused HF Linear modules carry by themselves).
Family modules are build-time code (they import torch); the runtime never imports them.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType
from typing import TYPE_CHECKING

from ..errors import UnsupportedModelError

if TYPE_CHECKING:
    from .base import EncoderFamily

REMAP = {"qwen2": "llama", "mistral": "llama", "gemma4_text": "gemma4", "gemma3_text": "gemma3",
         "qwen3_5_text": "qwen3_5", "qwen3_vl_text": "qwen3_vl", "qwen3_5_vision": "qwen3_vl_vision"}


def family_name(model_type: str) -> str:
    if not re.fullmatch(r"[a-z0-9_]+", model_type or ""):
        raise UnsupportedModelError(f"config.json has an invalid model_type {model_type!r}")
    return REMAP.get(model_type, model_type)


def load_family(model_type: str) -> ModuleType:
    name = family_name(model_type)
    try:
        return importlib.import_module(f"hexforge.families.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"hexforge.families.{name}":
            raise
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported yet (no hexforge/families/{name}.py)"
        ) from None


def encoder_families(config: dict) -> list[EncoderFamily]:
    """The encoders a multimodal checkpoint carries: one per ``*_config`` sub-config whose
    model_type has a family file (vision_config, audio_config)."""
    out = []
    for key in ("vision_config", "audio_config"):
        sub = config.get(key)
        if isinstance(sub, dict) and sub.get("model_type"):
            out.append(load_family(sub["model_type"]).ENCODER)
    return out
