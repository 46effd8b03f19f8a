"""A multi-turn chat that keeps the engine state between turns: ``Model.session()``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import GenerationResult, Model


class ChatSession:
    """Messages + the token ids the engine state holds. A turn renders the whole conversation
    with the chat template; if the state's ids are a prefix of it, only the rest is prefilled
    (KV rows, ring buffers and recurrent states all continue); otherwise it starts over."""

    def __init__(self, model: Model, system: str | None = None):
        self.model = model
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.cached: list[int] = []  # ids whose effect is in the engine state
        self.last_reused = 0  # prompt tokens the last turn did not prefill again

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.cached = []
        self.model.engine.reset()

    def stream(self, content: str, **kw) -> Iterator[str]:
        for piece, _, result in self._turn(content, **kw):
            if result is None:
                yield piece

    def send(self, content: str, **kw) -> GenerationResult:
        for _, _, result in self._turn(content, **kw):
            if result is not None:
                return result
        raise AssertionError("unreachable")

    def _turn(self, content: str, **kw):
        m, eng = self.model, self.model.engine
        msgs = [*self.messages, {"role": "user", "content": content}]
        ids = m.tokenizer.encode(m.apply_chat_template(msgs), add_special_tokens=False)
        n = len(self.cached)
        reuse = 0 < n < len(ids) and ids[:n] == self.cached and eng.pos == n
        self.last_reused = n if reuse else 0
        yielded: list[int] = []

        def steps(_ids, sampler, max_new, drafter):
            gen = eng.generate_step(ids[n:] if reuse else ids, sampler, max_new, fresh=not reuse,
                                    drafter=drafter)
            for token, logits in gen:
                yielded.append(token)
                yield token, logits

        for item in m._iterate(ids, steps=steps, **kw):
            if item[2] is not None:  # before handing out the result: callers stop reading there
                self.cached = ids + yielded[:-1]  # every yielded token but the last went in
                self.messages = [*msgs, {"role": "assistant", "content": item[2].text}]
            yield item
