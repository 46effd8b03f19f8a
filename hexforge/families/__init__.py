"""Family dispatch: ``config.model_type`` -> ``hexforge.families.<model_type>``, found by its name.

One file per HF model_type (mlx-lm's rule): a decoder family's module defines ``FAMILY`` (a
base.DecoderFamily), an encoder family's, named by a media sub-config's model_type
(vision_config, audio_config), ``ENCODER`` (a base.EncoderFamily). Adding a family is adding its
file; no list here names it. REMAP sends architecture twins to the file that already handles
them (e.g. qwen2 = llama with q/k/v biases, which the reused HF Linear modules carry by
themselves). The other modules of this package (base, blocks, ortops, ...) define neither and
are refused like any unknown type. Family modules are build-time code (they import torch); the
runtime never imports them, and finding them reads their source, not imports it.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from ..bundle.errors import UnsupportedModelError

if TYPE_CHECKING:
    from .base import EncoderFamily

REMAP = {"qwen2": "llama", "mistral": "llama", "gemma4_text": "gemma4", "gemma3_text": "gemma3",
         "qwen3_5_text": "qwen3_5", "qwen3_vl_text": "qwen3_vl", "qwen3_5_vision": "qwen3_vl_vision"}


def family_modules(attr: str) -> tuple[str, ...]:
    """The modules of this package that define ``attr`` ("FAMILY" or "ENCODER") at top level,
    read from their source (importing them would import torch)."""
    here = Path(__file__).parent
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(here)])
                        if re.search(rf"^{attr}\s*[:=]", (here / f"{m.name}.py").read_text(),
                                     re.MULTILINE)))


def family_name(model_type: str) -> str:
    if not re.fullmatch(r"[a-z0-9_]+", model_type or ""):
        raise UnsupportedModelError(f"config.json has an invalid model_type {model_type!r}")
    return REMAP.get(model_type, model_type)


def load_family(model_type: str) -> ModuleType:
    """The decoder family module for a config's ``model_type`` (its ``FAMILY``), or a one-line
    UnsupportedModelError."""
    return _load(model_type, "FAMILY", "model_type")


def load_encoder(model_type: str, key: str = "vision_config") -> EncoderFamily:
    """The encoder family of a media sub-config (``config[key].model_type``)."""
    return _load(model_type, "ENCODER", f"{key}.model_type").ENCODER


def _load(model_type: str, attr: str, what: str) -> ModuleType:
    name = family_name(model_type)
    registry = family_modules(attr)
    if name not in registry:
        known = sorted({*registry, *(k for k, v in REMAP.items() if v in registry)})
        raise UnsupportedModelError(f"{what} {model_type!r} is not supported yet (supported: "
                                    f"{', '.join(known)})")
    return importlib.import_module(f"hexforge.families.{name}")


def encoder_families(config: dict) -> list[EncoderFamily]:
    """The encoders a multimodal checkpoint carries: one per media sub-config (vision_config,
    audio_config); a sub-config whose model_type is not a registered encoder is refused."""
    out = []
    for key in ("vision_config", "audio_config"):
        sub = config.get(key)
        if isinstance(sub, dict) and sub.get("model_type"):
            out.append(load_encoder(sub["model_type"], key))
    return out
