"""Two runs of the same weights compared token by token: libGenie's Genie binaries and qnn-sim's
target graphs (or any two backends) may pick differently where the top two fp16 logits tie, so
a flip there is a tie, not a difference, and the tokens after it are not compared (their
prefixes differ). The one rule the suite and bench/genie_conformance.py both apply. Where
qnn-sim's own margins are not at hand (a pipeline's media prompt), each of the other run's picks
is seen by qnn-sim on that run's own prefix instead (``pick_gaps``, ``departs_on_own_prefix``):
every one must be its top or a few fp16 steps below it."""

from __future__ import annotations

import numpy as np

from .sampling import greedy

TIE = 2e-3  # a top-2 logit margin this small is a tie in fp16 (its step near 4: 0.0039)
# another run's pick this many fp16 steps (at the top logit's size) below qnn-sim's top, on its
# own prefix, is the two binaries' rounding: the Genie form's own input encoding (a pipeline's
# media rows in the 16-bit LUT's) flipped a tiny Gemma-4's pick 2 steps below; a wrong input
# puts it tens of steps below and more (docs/notes/genie-record.md)
TIE_STEPS = 4


def greedy_margins(model, ids: list[int], n: int, stop: list[int] | None = None
                   ) -> tuple[list[int], list[float]]:
    """``model``'s greedy tokens after ``ids`` (up to n, ending before a token in ``stop``) and
    each pick's top-2 logit margin."""
    tokens, margins = [], []
    for token, logits in model.engine.generate_step(ids, greedy, n):
        if stop and token in stop:
            break
        top = np.sort(np.asarray(logits, np.float32).reshape(-1))[-2:]
        tokens.append(int(token))
        margins.append(float(top[1] - top[0]))
    return tokens, margins


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first index where the two differ (None: equal, or one ends early)."""
    return next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)


def differs_past_ties(got: list[int], want: list[int], margins: list[float]) -> int | None:
    """The first index where ``got`` leaves ``want`` (whose picks had ``margins``), or where one
    ends before the other, unless qnn-sim's pick there was a tie; None when they are equal."""
    i = first_difference(got, want)
    if i is None:
        if len(got) == len(want):
            return None
        i = min(len(got), len(want))
    return None if i < len(margins) and margins[i] <= TIE else i


def pick_gaps(model, prompt: str | list[int], tokens: list[int], images: list | None = None,
              audios: list | None = None) -> list[tuple[float, int, float]]:
    """``model``'s view of another run's picks ``tokens`` after ``prompt`` (with its images /
    audio), each on that run's own prefix: (top logit - the pick's logit, the pick's rank: 1 =
    the top, one fp16 step at the top's size) per step. A rank-2 pick a step or two below is a
    near-tie the two binaries' fp16 rounding can flip (262,144-row vocabularies of random
    weights have them often); a wrong input row puts the pick far down (Gemma-4-E2B's LUT past
    4 GiB: rank 118,266)."""
    from .multimodal import prepare_media

    ids, media = model.encode(prompt), None
    if images or audios:
        ids, media = prepare_media(model.engine, model.manifest, ids, images, audios, {})
    forced = iter(tokens)
    out = []
    for token, logits in model.engine.generate_step(ids, lambda _: next(forced), len(tokens),
                                                    media=media):
        x = np.asarray(logits, np.float32).reshape(-1)
        top = float(x.max())
        out.append((top - float(x[token]), int((x > x[token]).sum()) + 1,
                    float(np.spacing(np.float16(abs(top))))))
    return out


def departs_on_own_prefix(gaps: list[tuple[float, int, float]]) -> int | None:
    """The first step whose pick (``pick_gaps``) is neither ``model``'s top nor within
    ``TIE_STEPS`` fp16 steps of it; None: every pick agrees up to rounding."""
    return next((i for i, (gap, rank, step) in enumerate(gaps)
                 if rank > 1 and gap > max(TIE, TIE_STEPS * step)), None)
