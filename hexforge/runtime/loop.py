"""The generation loop every runtime shares: a token source in, text pieces out, then the output.

    source ─▶ EOS / stop token? ─▶ on_token (history, grammar, logprobs) ─▶ detokenizer
           ─▶ stop strings ─▶ Piece ... ─▶ Output (tokens, finish reason, first-token time, text)

The sources: the cpu / qnn engine's (token, logits) steps (``Engine.generate_step``), a Genie
dialog's tokens (libGenie's callback) and a Genie pipeline's (its thread's queue). The loop hands
out at most ``max_new`` tokens whatever the source does (Genie's ``lade`` dialog runs on past
``max-num-tokens``), and stopping early closes the source (a Genie source stops libGenie there;
the engine's keeps the rows of the tokens it handed out).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..bundle.errors import RequestError
from .options import Piece

Extra = TypeVar("Extra")  # what a source hands with each token (the engine: its logits)


class StopStrings:
    """Releases streamed text, holding back any tail that could still become a stop string; cuts
    exactly where the first stop string begins (also when it spans tokens or ends inside one)."""

    def __init__(self, stops: list[str]):
        if any(not isinstance(x, str) or not x for x in stops):
            raise RequestError("stop strings must be non-empty strings")
        self.stops, self.text, self.released, self.hit = stops, "", 0, False

    def add(self, piece: str) -> str:
        if self.hit:  # the output has ended
            return ""
        self.text += piece
        if not self.stops:
            out, self.released = self.text[self.released:], len(self.text)
            return out
        start = max(0, self.released - max(map(len, self.stops)) + 1)
        found = [i for i in (self.text.find(x, start) for x in self.stops) if i >= 0]
        if found:
            cut = min(found)
            out = self.text[self.released:cut]
            self.text, self.released, self.hit = self.text[:cut], cut, True
            return out
        hold = max((k for x in self.stops for k in range(1, len(x))
                    if self.text.endswith(x[:k])), default=0)
        end = max(self.released, len(self.text) - hold)
        out, self.released = self.text[self.released:end], end
        return out

    def flush(self) -> str:
        out, self.released = self.text[self.released:], len(self.text)
        return out


@dataclass
class Output:
    """What the loop produced: the tokens handed out (no EOS), why it ended ("stop": an EOS, a stop
    token or string, a finished grammar; "length"; "cancelled"), when the first token came
    (perf_counter; None: none came) and the text as streamed (cut at a stop string)."""

    tokens: list[int]
    finish: str
    t_first: float | None
    text: str


@dataclass
class Stops(Generic[Extra]):
    """How a request ends besides its length: EOS / stop-token ids, stop strings, and the
    runtime's own hooks — ``on_token(token, extra)`` as each token is taken, ``ended()`` after
    its piece is handed out (a finished grammar: "stop"; a cancelled request: "cancelled")."""

    eos: set[int]
    strings: StopStrings
    on_token: Callable[[int, Extra], None] | None = None
    ended: Callable[[], str | None] | None = None


def emit(source: Iterable[tuple[int, Extra]], detokenizer, stops: Stops[Extra], max_new: int
         ) -> Generator[Piece, None, Output]:
    """Yield a ``Piece`` per piece of text as ``source``'s tokens come; return the ``Output``
    (``out = yield from emit(...)``). The source is closed when the loop ends, read out or not."""
    tokens: list[int] = []
    finish, t_first = "length", None
    strings = stops.strings
    it = iter(source)
    try:
        for token, extra in it:
            if t_first is None:
                t_first = time.perf_counter()
            if token in stops.eos:
                finish = "stop"
                break
            tokens.append(token)
            if stops.on_token is not None:
                stops.on_token(token, extra)
            piece = strings.add(detokenizer.add(token))
            if piece:
                yield Piece(piece, token)
            if strings.hit:
                finish = "stop"
                break
            reason = stops.ended() if stops.ended is not None else None
            if reason is not None:
                finish = reason
                break
            if len(tokens) >= max_new:
                break
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    if not strings.hit:
        tail = strings.add(detokenizer.flush()) + (strings.flush() if not strings.hit else "")
        if tail:
            yield Piece(tail, None)
    return Output(tokens, "stop" if strings.hit else finish, t_first, strings.text)
