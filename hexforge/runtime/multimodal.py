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

from ..bundle.errors import BundleError, RequestError

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

    def after(self, n: int) -> MediaRows:
        """The rows of prompt indices n.. for a prompt that starts at index n: a chat turn whose
        first n ids (and their media) are in the engine state already. The M-RoPE positions stay
        those of the whole conversation: an image earlier in it moves every later position."""
        keep = self.index >= n
        return MediaRows(index=self.index[keep] - n, embeds=self.embeds[keep],
                         extra={b: v[keep] for b, v in self.extra.items()},
                         rope_positions=(None if self.rope_positions is None
                                         else self.rope_positions[:, n:]),
                         rope_delta=self.rope_delta)


def _items(ids: list[int], spec, n_items: int, bos: int | None) -> list[int]:
    """ids with one placeholder per item: as written in the prompt, or put first (after BOS)."""
    if spec.placeholder_id not in ids:
        at = 1 if ids and bos is not None and ids[0] == bos else 0
        return ids[:at] + [spec.placeholder_id] * n_items + ids[at:]
    check_marks(ids, spec, n_items, "prompt")
    return ids


def check_marks(ids: list[int], spec, n_items: int, where: str) -> None:
    marked = ids.count(spec.placeholder_id)
    if marked != n_items:
        raise RequestError(f"the {where} marks {marked} {spec.modality} place(s) with "
                           f"{spec.placeholder_text!r} but {n_items} {spec.modality}(s) were given")


Encoded = dict[int, list[tuple[np.ndarray, dict[str, np.ndarray]]]]  # placeholder id -> items


def encode_items(engine, spec, inputs: list[dict[str, np.ndarray]], counts: list[int]
                 ) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Run the encoder graph per item; keep its first n rows: (soft [n, H], {bind: [n, H]})."""
    out = []
    for feeds, n in zip(inputs, counts, strict=True):
        res = engine.encode(spec, feeds)
        out.append((res["soft"][0, :n], {b: v[0, :n] for b, v in res.items() if b != "soft"}))
    return out


def decode_media(manifest, images: list | None, audios: list | None, preps: dict) -> dict:
    """Decode every item before any model work: {modality: (spec, preprocessor, [decoded])}.
    Items are paths / bytes / data URLs, or already decoded (a PIL image; a float32 waveform at
    the model's rate), which pass through: the server decodes once to answer bad media with a
    400 before streaming, then hands the decoded items on. preps caches preprocessors by name."""
    from .media import load_audio, load_image

    out = {}
    for modality, items in (("image", list(images or [])), ("audio", list(audios or []))):
        if not items:
            continue
        spec = manifest.encoder(modality)
        if spec is None:
            raise RequestError(f"this bundle has no {modality} encoder; {modality} inputs need a "
                               f"bundle built from a checkpoint with an {modality} tower")
        if spec.name not in preps:
            preps[spec.name] = load_preprocessor(spec.preprocessor, spec.params)
        prep = preps[spec.name]
        if modality == "image":
            decoded = [x if hasattr(x, "getbbox") else load_image(x) for x in items]
        else:
            decoded = [x if isinstance(x, np.ndarray) else
                       load_audio(x, prep.sampling_rate, prep.max_seconds) for x in items]
        out[modality] = (spec, prep, decoded)
    return out


def prepare_media(engine, manifest, ids: list[int], images: list | None, audios: list | None,
                  preps: dict) -> tuple[list[int], MediaRows | None]:
    """Decode + preprocess + encode the media; -> (ids with each placeholder expanded to
    [begin] placeholder * n [end], MediaRows of the soft tokens at those indices).

    Bad media fail here, before any decoder work."""
    decoded = decode_media(manifest, images, audios, preps)
    for spec, _, items in decoded.values():
        ids = _items(ids, spec, len(items), manifest.generation.bos_token_id)
    encoded = encode_decoded(engine, decoded)
    if not encoded:
        return ids, None
    return splice(manifest, ids, encoded)


def encode_media(engine, manifest, images: list | None, audios: list | None, preps: dict
                 ) -> Encoded:
    """Decode + preprocess + encode: {placeholder id: [(soft [n, H], {bind: [n, D]}) per item]}.
    Every item is decoded before any encoder runs, so bad media cost no encoder work."""
    return encode_decoded(engine, decode_media(manifest, images, audios, preps))


def encode_decoded(engine, decoded: dict) -> Encoded:
    encoded: Encoded = {}
    for spec, prep, items in decoded.values():
        feeds, counts = zip(*(prep(media) for media in items), strict=True)
        encoded[spec.placeholder_id] = encode_items(engine, spec, list(feeds), list(counts))
    return encoded


def splice(manifest, ids: list[int], encoded: Encoded) -> tuple[list[int], MediaRows]:
    """Expand each placeholder to [begin] placeholder * n [end] (begin / end only where the prompt
    does not already have them: chat templates like Qwen's write them) and collect the rows."""
    specs = {e.placeholder_id: e for e in manifest.encoders}
    new_ids: list[int] = []
    index: list[int] = []
    embeds: list[np.ndarray] = []
    extra: dict[str, list[np.ndarray]] = {}
    taken = dict.fromkeys(encoded, 0)
    for i, t in enumerate(ids):
        if t not in encoded:
            new_ids.append(t)
            continue
        spec = specs[t]
        soft, rows = encoded[t][taken[t]]
        taken[t] += 1
        if spec.begin_id is not None and (not new_ids or new_ids[-1] != spec.begin_id):
            new_ids.append(spec.begin_id)
        index.extend(range(len(new_ids), len(new_ids) + soft.shape[0]))
        new_ids.extend([t] * soft.shape[0])
        embeds.append(soft)
        for bind, v in rows.items():
            extra.setdefault(bind, []).append(v)
        if spec.end_id is not None and (i + 1 == len(ids) or ids[i + 1] != spec.end_id):
            new_ids.append(spec.end_id)
    media = MediaRows(index=np.asarray(index, np.int64),
                      embeds=np.concatenate(embeds).astype(np.float32),
                      extra={b: np.concatenate(v).astype(np.float32) for b, v in extra.items()})
    if manifest.host.positions == "mrope":  # Qwen-VL: 3-D positions over each image's grid
        image = manifest.encoder("image")
        media.rope_positions, media.rope_delta = mrope_positions(new_ids, image)
    return new_ids, media


def mrope_positions(ids, spec, grid: tuple[int, int, int] | None = None
                    ) -> tuple[np.ndarray, int]:
    """M-RoPE positions of a prompt whose images are already expanded (HF ``get_rope_index``):
    -> (positions [3, P] int64 (t, h, w), rope_delta).

        text run of n     t = h = w = cur .. cur+n-1;                     cur += n
        image (t, h, w)   (cur + ti, cur + hi, cur + wi) over the merged grid, row-major;
                          cur += max(h, w)
        rope_delta = max + 1 - P: decode position of slot s is s + rope_delta on all axes

    ``grid``: (t, h, w) in patches (HF image_grid_thw); default the spec's fixed build size.
    Every image must be exactly its t·(h/m)·(w/m) placeholder tokens in a row."""
    m = int(spec.params["merge_size"])
    if grid is None:
        p = int(spec.params["patch_size"])
        grid = (1, int(spec.params["height"]) // p, int(spec.params["width"]) // p)
    gt, gh, gw = grid[0], grid[1] // m, grid[2] // m
    n_img = gt * gh * gw
    tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
    image = np.stack([tt.ravel(), hh.ravel(), ww.ravel()])  # [3, n_img], before the offset
    ids = np.asarray(ids, np.int64)
    is_ph = ids == spec.placeholder_id
    out = np.zeros((3, ids.shape[0]), np.int64)
    cur, i = 0, 0
    while i < ids.shape[0]:
        if is_ph[i]:
            if not is_ph[i:i + n_img].all() or i + n_img > ids.shape[0]:
                raise RequestError(f"an image needs {n_img} consecutive {spec.placeholder_text!r} "
                                   f"tokens at prompt index {i}")
            out[:, i:i + n_img] = image + cur
            cur += max(gh, gw)
            i += n_img
        else:
            j = i + 1
            while j < ids.shape[0] and not is_ph[j]:
                j += 1
            out[:, i:j] = np.arange(j - i) + cur
            cur += j - i
            i = j
    delta = int(out.max()) + 1 - ids.shape[0] if ids.shape[0] else 0
    return out, delta
