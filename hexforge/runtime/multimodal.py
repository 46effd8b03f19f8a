"""Images and audio in a prompt: decode, preprocess, encode, splice (numpy + ORT, no torch).

    prompt text ─tokenize─▶ ids with one placeholder per item (or none: items go first)
    each item   ─media.py─▶ image | waveform ─preprocessor─▶ graph inputs, n soft tokens
                ─encoder graph─▶ soft [1, S, H] ─rows [:n]─▶ MediaRows (by prompt index)
    ids: placeholder ─▶ [begin] placeholder * n [end]        (as the HF processor expands it)

The engine then replaces the embedding rows at those indices (``MediaRows.slice`` per step).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import numpy as np

from ..errors import BundleError

# preprocessor key (EncoderSpec.preprocessor) -> "module:Class"; a class takes the spec's params
# and maps decoded media to ({input key: array with batch dim}, n soft tokens)
PREPROCESSORS = {
    "gemma4_image": "hexforge.runtime.vision:Gemma4ImagePrep",
    "gemma4_audio": "hexforge.runtime.audio:Gemma4AudioPrep",
    "qwen2vl_image": "hexforge.runtime.vision:Qwen2VLImagePrep",
}


def load_preprocessor(key: str, params: dict):
    if key not in PREPROCESSORS:
        raise BundleError(f"unknown media preprocessor {key!r} (this hexforge knows "
                          f"{', '.join(PREPROCESSORS)}); update hexforge")
    module, _, cls = PREPROCESSORS[key].partition(":")
    return getattr(importlib.import_module(module), cls)(params)


@dataclass
class MediaRows:
    """What the media add to one prompt, by prompt index; the engine slices it per step."""

    index: np.ndarray  # [M] int64, sorted: prompt indices of the soft tokens
    embeds: np.ndarray  # [M, H] float32: replace the token embeddings at those indices
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # bind -> [M, D] (deepstack:<i>)
    rope_positions: np.ndarray | None = None  # [3, P] M-RoPE positions of the prompt; None = 1-D
    rope_delta: int = 0  # after the prompt: rope position = slot position + rope_delta

    def slice(self, start: int, T: int, embeds: np.ndarray, rope_pos: np.ndarray):
        """Rows for prompt indices start .. start+T-1: (embeds [1, T, H] with soft rows put in,
        {bind: [1, T, D]} zero on text rows, rope positions [T] or [3, T])."""
        sel = (self.index >= start) & (self.index < start + T)
        rows = self.index[sel] - start
        embeds = embeds.copy()
        embeds[0, rows] = self.embeds[sel]
        extra = {}
        for bind, value in self.extra.items():
            x = np.zeros((1, T, value.shape[-1]), np.float32)
            x[0, rows] = value[sel]
            extra[bind] = x
        if self.rope_positions is not None:
            P = self.rope_positions.shape[1]
            pos = np.arange(start, start + T)
            # pad rows past the prompt's end: any position (their outputs are never read)
            rope_pos = self.rope_positions[:, np.minimum(pos, P - 1)]
        return embeds, extra, rope_pos
