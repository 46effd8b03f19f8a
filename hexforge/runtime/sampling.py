"""Logits processors and samplers as small composable functions.

A processor maps logits [V] float32 -> logits [V]; a sampler maps logits -> token id.
``make_sampler`` composes them; temperature 0 means greedy (argmax, first index on ties, as torch).
A processor returns a new array and never writes the one it gets: in ``generate_step`` that is
the graph's own output buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..bundle.errors import RequestError

Processor = Callable[[np.ndarray], np.ndarray]
Sampler = Callable[[np.ndarray], int]


def greedy(logits: np.ndarray) -> int:
    # numpy's argmax on the host, not an ArgMax node at the end of the head graph: over a real
    # vocabulary onnxruntime's CPU ArgMax took three times numpy's (docs/notes/measurements.md)
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


def min_p(p: float) -> Processor:
    """Drop tokens whose probability is below p x the top token's (after temperature)."""
    def apply(logits: np.ndarray) -> np.ndarray:
        if p <= 0.0:
            return logits
        # prob_i / prob_max = exp(l_i - l_max)
        return np.where(logits - np.max(logits) < np.log(p), -np.inf, logits)

    return apply


def repetition_penalty(penalty: float, history: list[int], window: int = 0) -> Processor:
    """CTRL-style (as transformers): logits of tokens seen in the last ``window`` ids of
    ``history`` (all if 0; the list is read at call time) are divided by penalty if > 0, else
    multiplied."""
    def apply(logits: np.ndarray) -> np.ndarray:
        if penalty == 1.0 or not history:
            return logits
        seen = np.unique(np.asarray(history[-window:] if window else history, dtype=np.int64))
        out = logits.copy()
        v = out[seen]
        out[seen] = np.where(v > 0, v / penalty, v * penalty)
        return out

    return apply


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x)
    return x - m - np.log(np.exp(x - m).sum())


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
                 seed: int | None = None, min_p_: float = 0.0, repetition_penalty_: float = 1.0,
                 history: list[int] | None = None, penalty_window: int = 0,
                 constraint: Processor | None = None) -> Sampler:
    """constraint: a grammar mask (runtime/constrain.py), applied first so that top-k / top-p /
    min-p choose among allowed tokens only (the other way round they could keep none)."""
    if not np.isfinite(temperature_) or temperature_ < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature_}")
    if not 0.0 < top_p_ <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p_}")
    if top_k_ < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k_}")
    if not 0.0 <= min_p_ < 1.0:
        raise RequestError(f"min_p must be in [0, 1), got {min_p_}")
    if not (np.isfinite(repetition_penalty_) and repetition_penalty_ > 0):
        raise RequestError(f"repetition_penalty must be > 0, got {repetition_penalty_}")
    first = [constraint] if constraint is not None else []
    if repetition_penalty_ != 1.0 and history is not None:
        first.append(repetition_penalty(repetition_penalty_, history, penalty_window))
    if temperature_ == 0.0:
        return chain(first, greedy)
    procs = [*first, temperature(temperature_), top_k(top_k_), top_p(top_p_), min_p(min_p_)]
    return chain(procs, categorical(np.random.default_rng(seed)))
