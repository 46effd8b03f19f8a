"""A multi-turn chat that keeps the engine state between turns: ``Model.session()``.

A turn may bring images / audio. Its media are encoded once and kept with the session (keyed by
the message that holds them, which keeps their references); every turn splices the soft tokens of
the whole conversation into its rendered ids, so the ids compare to the state's and positions
(M-RoPE's included) are those of the whole conversation. Only what follows the state's ids is then
prefilled, with its share of the soft rows; a turn that cannot reuse the state prefills everything
with every item of the conversation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..bundle.errors import RequestError
from ..bundle.manifest import Manifest
from .engine import Engine
from .multimodal import Encoded, MediaRows, check_marks, splice
from .options import (
    Done,
    GenerationOptions,
    GenerationResult,
    Piece,
    pieces_of,
    result_of,
    takes_generation_options,
)
from .text import TextTokenizer


class ChatModel(Protocol):
    """What a session takes of its model (``model.Model``, which makes sessions: a protocol, so
    this module needs no import of it)."""

    manifest: Manifest
    tokenizer: TextTokenizer
    engine: Engine

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True
                            ) -> str: ...

    def encode_media(self, images: list | None, audios: list | None) -> Encoded: ...

    def iterate(self, prompt: str | list[int], o: GenerationOptions | None = None,
                steps: Callable[..., Iterator[tuple[int, Any]]] | None = None
                ) -> Iterator[Piece | Done]: ...

MEDIA_KEYS = {"image": "images", "audio": "audios"}  # modality -> the message's key for its items


class ChatSession:
    """Messages + the token ids the engine state holds. A turn renders the whole conversation
    with the chat template; if the state's ids are a prefix of it, only the rest is prefilled
    (KV rows, ring buffers, recurrent states and media all continue); otherwise it starts over.
    A user message with media holds them under "images" / "audios" (as given: paths, bytes, ...)
    and marks their places in its content with the bundle's placeholder text."""

    def __init__(self, model: ChatModel, system: str | None = None):
        self.model = model
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.cached: list[int] = []  # ids whose effect is in the engine state
        self.last_reused = 0  # prompt tokens the last turn did not prefill again
        self.resets = -1  # the engine's reset count when the state held ``cached``
        # id(message) -> (the message, its media's soft tokens): encoded once, not every turn
        self._encoded: dict[int, tuple[dict, Encoded]] = {}

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.cached, self._encoded = [], {}
        self.model.engine.reset()

    @takes_generation_options
    def stream(self, content: str, options: GenerationOptions) -> Iterator[str]:
        """``send``, streamed: the reply's text pieces as they are generated."""
        return pieces_of(self._turn(content, options))

    @takes_generation_options
    def send(self, content: str, options: GenerationOptions) -> GenerationResult:
        """One user turn -> the reply, the state kept for the next turn. images / audios: this
        turn's media (paths, bytes, data URLs), at the content's placeholders (``<|image|>``, ...)
        or put before its text."""
        return result_of(self._turn(content, options))

    def _turn(self, content: str, options: GenerationOptions):
        m, eng = self.model, self.model.engine
        # bad media fail here, the state intact
        user = self._user_message(content, options.images, options.audios)
        msgs = [*self.messages, user]
        ids = m.tokenizer.encode(m.apply_chat_template(msgs), add_special_tokens=False)
        ids, media = self._splice(ids, msgs)
        n = len(self.cached)
        reuse = (0 < n < len(ids) and ids[:n] == self.cached and eng.pos == n
                 and eng.resets == self.resets)
        self.last_reused = n if reuse else 0
        if reuse and media is not None:
            media = media.after(n)
        yielded: list[int] = []

        def steps(_ids, sampler, max_new, drafter):
            gen = eng.generate_step(ids[n:] if reuse else ids, sampler, max_new, fresh=not reuse,
                                    media=media, drafter=drafter)
            for token, logits in gen:
                yielded.append(token)
                yield token, logits

        # the media rows go to ``steps``: the turn's options hand none to the single-prompt path
        text_only = dataclasses.replace(options, images=None, audios=None)
        for item in m.iterate(ids, text_only, steps=steps):
            if isinstance(item, Done):  # before handing out the result: callers stop reading there
                self.cached = ids + yielded[:-1]  # every yielded token but the last went in
                self.resets = eng.resets
                self.messages = [*msgs, {"role": "assistant", "content": item.result.text}]
                self._encoded = {k: v for k, v in self._encoded.items()
                                 if any(v[0] is x for x in self.messages)}
            yield item

    def _user_message(self, content: str, images: list | None, audios: list | None) -> dict:
        """The user message of a turn; its media encoded (and kept) before any decoder work."""
        msg: dict[str, Any] = {"role": "user", "content": content}
        if not images and not audios:
            return msg
        if not isinstance(content, str):
            raise RequestError("a turn with images / audio takes its text as a string")
        m = self.model
        encoded = m.encode_media(images, audios)
        marks, given = "", {"image": images, "audio": audios}
        for modality, key in MEDIA_KEYS.items():
            if not given[modality]:
                continue
            items = msg[key] = list(given[modality] or [])
            spec = m.manifest.encoder(modality)
            if spec is None:
                raise RequestError(f"this bundle has no {modality} encoder")
            text = spec.placeholder_text
            if text not in content:  # no place marked: the items go before the text
                marks += text * len(items)
        msg["content"] = marks + content
        self._encoded[id(msg)] = (msg, encoded)
        return msg

    def _splice(self, ids: list[int], msgs: list[dict]) -> tuple[list[int], MediaRows | None]:
        """ids with every item of the conversation expanded to its soft tokens, and their rows
        (None: no media). A message whose items are not encoded yet (messages set from outside)
        is encoded from its references."""
        m = self.model
        media: Encoded = {}
        for msg in msgs:
            if not any(msg.get(key) for key in MEDIA_KEYS.values()):
                continue
            kept = self._encoded.get(id(msg))
            if kept is None or kept[0] is not msg:
                kept = self._encoded[id(msg)] = (msg, m.encode_media(msg.get("images"),
                                                                     msg.get("audios")))
            for placeholder, items in kept[1].items():
                media.setdefault(placeholder, []).extend(items)
        if not media:
            return ids, None
        for spec in m.manifest.encoders:
            if spec.placeholder_id in media:
                check_marks(ids, spec, len(media[spec.placeholder_id]), "conversation")
        return splice(m.manifest, ids, media)
