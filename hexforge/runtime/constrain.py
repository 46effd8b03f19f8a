"""Constrained decoding: JSON schema, JSON object, regex and Lark grammars, through llguidance.

llguidance was picked by measurement (``bench/experiments/constrained.py``): the lowest per-token mask time of
the candidates, every output valid, and it imports neither torch nor transformers (xgrammar does
both at import time). It builds its token trie from the bundle's ``tokenizer.json`` directly.

A ``Constraint`` is a logits processor in ``sampling.py``'s style — ``logits -> logits`` — placed
first in the chain (before temperature / top-k / top-p, so those only ever see allowed tokens), plus
``advance(token)``, which the token loop calls with every token it keeps. EOS follows the grammar:
masked while the output is incomplete, the only choice once it is complete.

    grammars = Grammars(tokenizer_json, vocab_size, eos_ids)    # once per model (the slow part)
    c = grammars.constraint({"type": "json_schema", "json_schema": {"schema": {...}}})
    sampler = make_sampler(..., constraint=c); ...; c.advance(token)
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ..bundle.errors import BackendError, RequestError

# compact JSON (as OpenAI's structured output): no free whitespace a random or weak model could
# spend its whole token budget on
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_of(response_format: dict | None) -> str | None:
    """An OpenAI-style ``response_format`` -> an llguidance grammar (None: unconstrained text).

    {"type": "text"} · {"type": "json_object"} · {"type": "json_schema", "json_schema":
    {"schema": {...}}} and hexforge's {"type": "regex", "regex": "..."} · {"type": "lark",
    "lark": "start: ..."}."""
    from llguidance import LLMatcher

    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError("response_format must be an object like {\"type\": \"json_schema\", ...}")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format json_schema needs {\"json_schema\": {\"schema\": {...}}}")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind in ("regex", "lark"):
        source = response_format.get(kind)
        if not isinstance(source, str) or not source:
            raise RequestError(f"response_format {kind} needs a non-empty string {kind!r}")
        return (LLMatcher.grammar_from_regex(source) if kind == "regex"
                else LLMatcher.grammar_from_lark(source))
    raise RequestError(f"unknown response_format type {kind!r} (text, json_object, json_schema, "
                       "regex, lark)")


class Constraint:
    """One request's grammar state: masks logits, advances with each kept token."""

    def __init__(self, matcher: Any, vocab_size: int, mask_size: int):
        # mask_size >= vocab_size: the tokenizer may know more ids than the model has logits
        self.matcher, self.vocab_size = matcher, vocab_size
        self._bits = np.zeros((mask_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next (EOS only once it is complete)."""
        # straight into our buffer (llguidance.numpy's wrapper adds only checks we do not need)
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[:self.vocab_size].view(bool)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):  # a token outside the mask: a caller bug
            raise BackendError(f"constrained decoding failed: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The output is complete: nothing but EOS can follow."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class Grammars:
    """Per model: the llguidance tokenizer (built once, lazily: it indexes the whole vocabulary)
    and the last few compiled grammars (a fresh request deep-copies a compiled matcher)."""

    CACHE = 32

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        self._source, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, list(eos_ids)
        self.mask_size = max(vocab_size, json_vocab_size(tokenizer_json))
        self._tok = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        from llguidance import LLTokenizer

        with self._lock:
            if self._tok is None:
                self._tok = LLTokenizer(self._source, n_vocab=self.mask_size,
                                        eos_token=self.eos_ids or None)
            return self._tok

    def constraint(self, response_format: dict | None) -> Constraint | None:
        grammar = grammar_of(response_format)
        if grammar is None:
            return None
        return Constraint(self.matcher(grammar), self.vocab_size, self.mask_size)

    def matcher(self, grammar: str):
        from llguidance import LLMatcher

        tok = self.tokenizer
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        compiled = LLMatcher(tok, grammar, log_level=0)
        if compiled.is_error():
            raise RequestError(f"response_format cannot be compiled: {compiled.get_error()}")
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.CACHE:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()


def json_vocab_size(tokenizer_json: str) -> int:
    """1 + the largest token id of a tokenizer.json (model vocab plus added tokens)."""
    data = json.loads(tokenizer_json)
    vocab = (data.get("model") or {}).get("vocab") or {}
    n = max(vocab.values(), default=-1) + 1 if isinstance(vocab, dict) else len(vocab)  # BPE | Unigram
    added = [t.get("id", -1) for t in data.get("added_tokens") or []]
    return max([n, *(i + 1 for i in added)])
