"""Host-side inputs of the graphs, made from the manifest's declarative host recipe (numpy only).

    token ids ──gather(embed table) x scale──▶ hidden [1, T, H]  (also bound as "embed")
    token ids ──gather(extra table) x scale──▶ host:<name> [1, T, D]  (e.g. Gemma-4 PLE)
    positions ──x inv_freq, cat(f, f), cos/sin, x scaling──▶ rope_cos/sin:<name> [1, T, R]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..bundle.errors import BundleError
from ..bundle.manifest import HostRecipe
from ..bundle.qtables import HostTable


def rope_tables(inv_freq: np.ndarray, attention_scaling: float,
                positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [positions, R] for positions 0 .. positions-1, fp32 as HF computes them: the
    host's rows, and the constant tables cpu graphs' GroupQueryAttention reads (built from this
    same function, so the two agree bit for bit). inv_freq [R/2]."""
    pos = np.arange(positions, dtype=np.float32)[:, None]
    freqs = pos * inv_freq.astype(np.float32)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    scale = np.float32(attention_scaling)
    return np.cos(emb) * scale, np.sin(emb) * scale


class HostInputs:
    def __init__(self, recipe: HostRecipe, tensors: dict[str, HostTable], max_positions: int,
                 placeholder_ids: Sequence[int] = ()):
        self.recipe = recipe
        try:
            self.embed_table = tensors[recipe.embed.table]
            inv = {r.name: np.asarray(tensors[r.inv_freq], np.float32) for r in recipe.ropes}
            self.extra = {e.name: tensors[e.table] for e in recipe.extra_embeds}
        except KeyError as e:
            raise BundleError(f"host tensor {e} named in the manifest is missing") from None
        if self.embed_table.ndim != 2:
            raise BundleError(f"embedding table must be 2-D, got {self.embed_table.shape}")
        self.embed_scale = np.float32(recipe.embed.scale)
        self.placeholder_ids = list(placeholder_ids)  # media placeholders (manifest encoders)
        self.max_positions = max_positions  # rows of the rope tables
        # cos/sin tables for every position a (padded) step can touch: [P, R]
        self.rope = {r.name: rope_tables(inv[r.name], r.attention_scaling, max_positions)
                     for r in recipe.ropes}
        # M-RoPE: which position axis (0 t, 1 h, 2 w) each of the R rotary columns reads
        self.mrope_axis = {r.name: mrope_axes(r.mrope_section, r.mrope_interleaved,
                                              inv[r.name].shape[0])
                           for r in recipe.ropes if r.mrope_section is not None}

    def media_ids(self, ids: np.ndarray) -> np.ndarray:
        """ids with media placeholder tokens replaced by the recipe's media_pad_id (if any): the
        host gathers read it there (the soft tokens replace the embedding rows afterwards)."""
        if self.recipe.media_pad_id is None or not self.placeholder_ids:
            return ids
        return np.where(np.isin(ids, self.placeholder_ids), self.recipe.media_pad_id, ids)

    @property
    def vocab_size(self) -> int:
        return self.embed_table.shape[0]

    def _embed_rows(self, ids: np.ndarray | int) -> np.ndarray:
        """ids [T] -> [T, H] float32 (a token id -> [H])."""
        h = self.embed_table[ids].astype(np.float32)
        return h * self.embed_scale if self.embed_scale != 1.0 else h

    def _extra_rows(self, e, ids: np.ndarray | int) -> np.ndarray:
        return self.extra[e.name][ids].astype(np.float32) * np.float32(e.scale)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids [T] -> hidden [1, T, H] float32."""
        return self._embed_rows(ids)[None]

    def extra_embeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Other per-token host gathers (e.g. Gemma-4 per-layer inputs): {name: [1, T, D]}."""
        return {e.name: self._extra_rows(e, ids)[None] for e in self.recipe.extra_embeds}

    def write_token_rows(self, token: int, rows: dict[str, np.ndarray]) -> None:
        """One token's embed() and extra_embeds() rows written in place, by the same float ops:
        rows["hidden"] and rows["host:<name>"] (a decode step's kept [1, 1, D] arrays, any float
        dtype); a media placeholder reads media_pad_id's rows, as media_ids()."""
        if token in self.placeholder_ids and self.recipe.media_pad_id is not None:
            token = self.recipe.media_pad_id
        rows["hidden"][...] = self._embed_rows(token)
        for e in self.recipe.extra_embeds:
            rows[f"host:{e.name}"][...] = self._extra_rows(e, token)

    def rope_tables(self, name: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions [T] (1-D, or M-RoPE text rows: t = h = w) or [3, T] (M-RoPE t, h, w)
        -> cos, sin [1, T, R]. Column j of an M-RoPE table depends only on its own axis'
        position, so it is a gather from the 1-D table: out[t, j] = table[pos[axis[j], t], j]."""
        cos, sin = self.rope[name]
        if positions.ndim == 1:
            p = int(positions[0]) if positions.shape[0] == 1 else -1
            if 0 <= p < cos.shape[0]:  # a decode step: views of one row, no gather
                return cos[p:p + 1][None], sin[p:p + 1][None]
            return cos[positions][None], sin[positions][None]
        axis = self.mrope_axis.get(name)
        if axis is None:
            raise BundleError(f"rope {name!r} got 3-D positions but declares no mrope_section")
        rows = positions[axis].T  # [T, R]: each column's own position
        cols = np.arange(axis.shape[0])[None]
        return cos[rows, cols][None], sin[rows, cols][None]


def mrope_axes(section: list[int], interleaved: bool, n_freq: int) -> np.ndarray:
    """[2 n_freq] axis (0 t, 1 h, 2 w) of each rotary column cat(f, f) (see RopeSpec).

    Interleaved is HF Qwen3-VL ``recomposition_frequencies``: start from t everywhere, then
    columns 1, 4, 7 .. < 3 h take h and 2, 5, 8 .. < 3 w take w."""
    if sum(section) != n_freq:
        raise BundleError(f"mrope_section {section} does not sum to the {n_freq} rope frequencies")
    axis = np.zeros(n_freq, dtype=np.int64)
    if interleaved:
        for a in (1, 2):
            axis[a:section[a] * 3:3] = a
    else:
        axis[section[0]:section[0] + section[1]] = 1
        axis[section[0] + section[1]:] = 2
    return np.concatenate([axis, axis])
