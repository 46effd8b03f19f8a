"""Logits processors and samplers as small composable functions.

A processor maps logits [V] float32 -> logits [V]; a sampler maps logits -> token id.
``make_sampler`` composes them; temperature 0 means greedy (argmax, first index on ties, as torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..errors import RequestError

Processor = Callable[[np.ndarray], np.ndarray]
Sampler = Callable[[np.ndarray], int]


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def temperature(t: float) -> Processor:
    return lambda logits: logits / t


def top_k(k: int) -> Processor:
    def apply(logits: np.ndarray) -> np.ndarray:
        if k <= 0 or k >= logits.shape[-1]:
            return logits
        kth = np.partition(logits, -k)[-k]
        return np.where(logits < kth, -np.inf, logits)

    return apply


def top_p(p: float) -> Processor:
    def apply(logits: np.ndarray) -> np.ndarray:
        if p >= 1.0:
            return logits
        order = np.argsort(-logits, kind="stable")
        probs = softmax(logits[order])
        # keep the smallest prefix whose mass reaches p (always at least one token)
        keep = np.cumsum(probs) - probs < p
        out = np.full_like(logits, -np.inf)
        out[order[keep]] = logits[order[keep]]
        return out

    return apply


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def categorical(rng: np.random.Generator) -> Sampler:
    def sample(logits: np.ndarray) -> int:
        probs = softmax(logits.astype(np.float64))
        return int(rng.choice(probs.shape[-1], p=probs))

    return sample


def chain(processors: Sequence[Processor], sampler: Sampler) -> Sampler:
    def run(logits: np.ndarray) -> int:
        for proc in processors:
            logits = proc(logits)
        return sampler(logits)

    return run


def make_sampler(temperature_: float = 0.0, top_k_: int = 0, top_p_: float = 1.0,
                 seed: int | None = None) -> Sampler:
    if not np.isfinite(temperature_) or temperature_ < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature_}")
    if not 0.0 < top_p_ <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p_}")
    if top_k_ < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k_}")
    if temperature_ == 0.0:
        return greedy
    procs = [temperature(temperature_), top_k(top_k_), top_p(top_p_)]
    return chain(procs, categorical(np.random.default_rng(seed)))
