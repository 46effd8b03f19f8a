"""Host-side inputs of the graphs, made from the manifest's declarative host recipe (numpy only).

    token ids ──gather(embed table) x scale──▶ hidden [1, T, H]  (also bound as "embed")
    token ids ──gather(extra table) x scale──▶ host:<name> [1, T, D]  (e.g. Gemma-4 PLE)
    positions ──x inv_freq, cat(f, f), cos/sin, x scaling──▶ rope_cos/sin:<name> [1, T, R]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import BundleError
from ..manifest import HostRecipe


def load_host_tensors(path: Path) -> dict[str, np.ndarray]:
    """Read safetensors (never pickle); a corrupted header is a BundleError, not a crash."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise BundleError(f"host tensors {path.name} cannot be read: {e}") from None


class HostInputs:
    def __init__(self, recipe: HostRecipe, tensors: dict[str, np.ndarray], max_positions: int):
        self.recipe = recipe
        try:
            self.embed_table = tensors[recipe.embed.table]
            inv = {r.name: tensors[r.inv_freq].astype(np.float32) for r in recipe.ropes}
            self.extra = {e.name: tensors[e.table] for e in recipe.extra_embeds}
        except KeyError as e:
            raise BundleError(f"host tensor {e} named in the manifest is missing") from None
        if self.embed_table.ndim != 2:
            raise BundleError(f"embedding table must be 2-D, got {self.embed_table.shape}")
        self.embed_scale = np.float32(recipe.embed.scale)
        # cos/sin tables for every position a (padded) step can touch: [P, R], fp32 as HF computes
        pos = np.arange(max_positions, dtype=np.float32)[:, None]
        self.rope: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for r in recipe.ropes:
            freqs = pos * inv[r.name][None, :]
            emb = np.concatenate([freqs, freqs], axis=-1)
            scale = np.float32(r.attention_scaling)
            self.rope[r.name] = (np.cos(emb) * scale, np.sin(emb) * scale)

    @property
    def vocab_size(self) -> int:
        return self.embed_table.shape[0]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids [T] -> hidden [1, T, H] float32."""
        h = self.embed_table[ids].astype(np.float32)
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        return h[None]

    def extra_embeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Other per-token host gathers (e.g. Gemma-4 per-layer inputs): {name: [1, T, D]}."""
        return {e.name: (self.extra[e.name][ids].astype(np.float32) * np.float32(e.scale))[None]
                for e in self.recipe.extra_embeds}

    def rope_tables(self, name: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = self.rope[name]
        return cos[positions][None], sin[positions][None]
