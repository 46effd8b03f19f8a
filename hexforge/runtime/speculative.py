"""Speculative decoding with prompt-lookup drafts: several tokens per weight read, same output.

Decode reads every weight once per token; a k-row graph reads them once for k rows. Text that
copies from its input (repeat or edit a paragraph, fix a given function, quote a given text)
continues a span already in the context, so the tokens that followed the last occurrence of the
context's last n-gram are a cheap, often right guess (prompt lookup: no draft model)::

    context ... a b c d e ... a b │ last sampled t          n-gram "a b" found earlier: drafts c d e
    verify step [t c d e] at pos p..p+3 ─▶ logits rows 0..3   (one call of the AR-k graph)
    row 0 samples x0: x0 == c? ─ yes ─▶ row 1 samples x1: x1 == d? ─ no ─▶ stop
    out: c x1          state: rows of t, c committed (p..p+1); rows of d, e never committed

Lossless: each row's logits are the target's own for the tokens before it, and a row is read only
while every draft before it was the token sampled there; rows after the first miss are not
committed (in-place caches hold them past the last position committed, where the next step's rows
overwrite them before anything reads them; rings and static caches are written by the host from
the committed rows only), so no later step can see them.

Sampling: the standard speculative rule accepts a draft token d with probability
min(1, p(d) / q(d)) and on rejection samples norm(max(p - q, 0)). A prompt-lookup draft puts all
its mass on d (q = one-hot), so that is: keep d with probability p(d), else draw from p with d
removed — exactly drawing x ~ p and keeping d iff x == d. The loop therefore calls the request's
own sampler on each row (temperature, top-k/p, min-p, repetition penalty and grammar included, each
seeing the tokens accepted before the row) and compares: every token is distributed as in plain
decoding.

A verify step is worth it only where its expected tokens beat what its time buys in decode steps: on
a cpu an 8-row call costs more than a one-row call (docs/notes/measurements.md), so drafts that keep
missing (open-ended text, where a one-token match is a weak guess) would make decoding slower. The
drafter keeps, per n-gram length, how many drafts a verify step accepted lately, the engine how long
each kind of step takes (``StepCosts``), and a draft is sent only while 1 + accepted >= verify time
/ decode time (and every EXPLORE-th time anyway, to notice when the text turns to copying). On the
HTP a k-row call costs about one weight read: the ratio is ~1 and every draft is sent.

Rows are read one at a time and each token is handed out before the next row is looked at: the
consumer's per-token work (history for the repetition penalty, the grammar's advance, stop strings,
cancellation) happens in the same order as without speculation, and the state afterwards holds
every token handed out but the last, as ``Engine.generate_step``'s does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..bundle.errors import RequestError
from ..bundle.manifest import Manifest
from .sampling import Sampler

MAX_NGRAM = 3  # the longest context suffix looked up; shorter ones are tried next, down to 1
EXPLORE = 8  # a draft judged not worth it is still sent every EXPLORE-th time
GAIN_PRIOR = 1.0  # accepted drafts per verify step assumed before any was seen
GAIN_RATE = 0.25  # weight of the latest verify step in that estimate


class StepCosts:
    """Seconds a decode step and a verify step take (moving averages, kept by the engine across
    requests; the first of each is not counted: it pays for the session's first run)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.seen: set[str] = set()

    def add(self, kind: str, seconds: float) -> None:
        if kind not in self.seen:
            self.seen.add(kind)
            return
        old = self.seconds.get(kind)
        self.seconds[kind] = seconds if old is None else old + 0.2 * (seconds - old)

    @property
    def ratio(self) -> float:
        """verify / decode step time; 1 until both were measured."""
        d, v = self.seconds.get("decode"), self.seconds.get("verify")
        return v / d if d and v else 1.0


@dataclass
class SpeculationStats:
    drafted: int = 0  # draft tokens sent to verify steps
    accepted: int = 0  # of them, the ones sampled as drafted
    verify_calls: int = 0
    verify_tokens: int = 0  # tokens handed out from verify steps (accepted drafts + one per call)
    decode_calls: int = 0  # plain decode steps (no draft found, or no room for a verify step)
    max_draft: int = 0  # the most tokens a step drafts: min(prompt_lookup, verify rows - 1)

    def to_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "max_draft": self.max_draft,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "verify_calls": self.verify_calls, "decode_calls": self.decode_calls,
                "tokens_per_verify": (self.verify_tokens / self.verify_calls
                                      if self.verify_calls else 0.0)}


class PromptLookup:
    """Drafts from the context itself: the tokens after the latest earlier occurrence of the
    context's last n-gram (n = MAX_NGRAM down to 1). ``context`` is read live (the generation
    loop appends every token it hands out); an index of every n-gram's latest end is kept up to
    date incrementally, so a lookup costs O(MAX_NGRAM) whatever the context's length."""

    def __init__(self, k: int, context: list[int]):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise RequestError(f"prompt_lookup must be an integer >= 1 (draft tokens), got {k!r}")
        self.k, self.context = k, context
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self.indexed = 0  # n-grams ending before this position are in self.ends
        self.stats = SpeculationStats()
        self.gain = [GAIN_PRIOR] * (MAX_NGRAM + 1)  # accepted drafts per verify, by match length
        self.skipped = [0] * (MAX_NGRAM + 1)
        self.match = 0  # the match length of the last draft sent

    def _index(self, upto: int) -> None:
        ctx = self.context
        for end in range(self.indexed + 1, upto + 1):
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self.ends[n][tuple(ctx[end - n:end])] = end
        self.indexed = max(self.indexed, upto)

    def draft(self, limit: int, cost_ratio: float = 1.0) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier match of the longest
        suffix of the context that occurred before; [] if none did, or if a verify step on a
        match that long has not paid lately for costing cost_ratio decode steps."""
        ctx, limit = self.context, min(self.k, limit)
        L = len(ctx)
        if limit < 1 or L < 2:
            return []
        self._index(L - 1)  # n-grams ending before the last token: the suffix itself is not one
        for n in range(min(MAX_NGRAM, L - 1), 0, -1):
            end = self.ends[n].get(tuple(ctx[L - n:]))
            if end is not None:
                # a continuation that runs into the end of the context goes on as the period
                # L - end it implies (a loop "x y x y" drafts "x y x ..", not one token)
                out: list[int] = []
                for i in range(end, end + limit):
                    out.append(int(ctx[i]) if i < L else out[i - L])
                if 1 + self.gain[n] < cost_ratio:
                    self.skipped[n] += 1
                    if self.skipped[n] % EXPLORE:
                        return []
                self.match = n
                return out
        return []

    def record(self, accepted: int) -> None:
        """A verify step of the last draft sent accepted this many of its tokens."""
        g = self.gain[self.match]
        self.gain[self.match] = g + GAIN_RATE * (accepted - g)


def draft_limit(verify_len: int) -> int:
    """The most draft tokens a verify step of ``verify_len`` rows takes: its first row is the
    last token sampled."""
    return verify_len - 1


class VerifyStep(Protocol):
    """A verify step's rows, run but not committed (``engine.Verification``)."""

    def logits(self, i: int) -> np.ndarray: ...

    def accept(self, n: int) -> None: ...


class Stepper(Protocol):
    """What the loop below steps: the engine's decode and verify steps and where they stand
    (``engine.Engine``, which calls the loop: a protocol, so this module needs no import of it)."""

    step_costs: StepCosts
    pos: int  # the next row's position

    @property
    def context(self) -> int: ...

    @property
    def verify_len(self) -> int: ...  # rows of a verify step

    def decode(self, token: int, copy: bool = True) -> np.ndarray: ...

    def verify(self, ids: list[int]) -> VerifyStep: ...


def check_speculation(manifest: Manifest) -> None:
    """Refuse families whose state cannot drop the rows of rejected drafts."""
    recurrent = sorted({s.kind for s in manifest.state} & {"conv_fifo", "ssm"})
    if recurrent:
        raise RequestError(f"prompt lookup is not supported for {manifest.family}: its "
                           f"recurrent state ({', '.join(recurrent)}) cannot be rolled back to "
                           "the accepted row")


def speculative_steps(engine: Stepper, sampler: Sampler, logits: np.ndarray, max_new_tokens: int,
                      drafter: PromptLookup) -> Iterator[tuple[int, np.ndarray]]:
    """``Engine.generate_step``'s loop after the prefill, with verify steps wherever a draft is
    found (plain decode steps elsewhere). Yields (token, logits it was sampled from)."""
    stats, costs = drafter.stats, engine.step_costs
    stats.max_draft = min(drafter.k, draft_limit(engine.verify_len))
    token = sampler(logits)
    yield token, logits
    left = max_new_tokens - 1
    T = engine.verify_len
    while left > 0:
        # a verify step takes the last token + drafts, and its rows must end inside the cache;
        # the last token handed out is never a draft (it comes from the row after them)
        room = draft_limit(T) if engine.pos + T <= engine.context else 0
        drafts = drafter.draft(min(room, left - 1), costs.ratio)
        if not drafts:
            t = time.perf_counter()
            logits = engine.decode(token, copy=False)
            costs.add("decode", time.perf_counter() - t)
            stats.decode_calls += 1
            token = sampler(logits)
            left -= 1
            yield token, logits
            continue
        t = time.perf_counter()
        step = engine.verify([token, *drafts])
        spent = time.perf_counter() - t
        rows = accepted = 0
        try:
            for i in range(len(drafts) + 1):
                t = time.perf_counter()
                logits = step.logits(i)
                spent += time.perf_counter() - t
                token = sampler(logits)
                hit = i < len(drafts) and token == drafts[i]
                rows, left, accepted = i + 1, left - 1, accepted + hit
                yield token, logits
                if not hit:  # the row after a miss was computed from the wrong token
                    break
        finally:  # also when the consumer stops reading: the rows of the tokens handed out
            step.accept(rows)
            costs.add("verify", spent)
            drafter.record(accepted)
            stats.verify_calls += 1
            stats.drafted += len(drafts)
            stats.accepted += accepted
            stats.verify_tokens += rows
