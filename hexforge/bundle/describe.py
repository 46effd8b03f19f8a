"""A bundle's parts in words, as the build log and ``hexforge inspect`` both write them: a shard's
layers, an encoder's input."""

from __future__ import annotations


def encoder_input(spec) -> dict:
    """What an encoder takes, from its manifest params: a fixed-resolution vision graph's build
    size (every image is resized to it, so a bundle built at the wrong size still runs, only
    worse: the size must be visible), an audio window, or an aspect-preserving image budget."""
    p = spec.params
    if "height" in p and "width" in p:
        h, w = int(p["height"]), int(p["width"])
        return {"image_size": [h, w], "text": f"images resized to {h}x{w} (H x W)"}
    if "max_seconds" in p:
        s = float(p["max_seconds"])
        return {"audio_seconds": s, "text": f"audio up to {s:g} s"}
    return {"text": f"{spec.modality}s resized at their own aspect ratio"}


def layer_span(layers: tuple[int, int] | list[int]) -> str:
    """A shard's layers as the build log and ``hexforge inspect`` write them: half-open, as
    Python's ranges, so [0,30) [30,60) meet at 30."""
    a, b = layers
    return f"[{a},{b})"
