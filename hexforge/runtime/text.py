"""Tokenizer (HF ``tokenizers``, no transformers at run time) and a streaming detokenizer."""

from __future__ import annotations

from pathlib import Path

from ..errors import BundleError, RequestError


class TextTokenizer:
    def __init__(self, tokenizer_dir: Path):
        from tokenizers import Tokenizer

        path = tokenizer_dir / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise BundleError(f"tokenizer {path} cannot be loaded: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(f"prompt must be a string, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Yields text only once it is complete UTF-8.

    Byte-level BPE splits a multi-byte character across tokens; decoding a partial sequence gives
    U+FFFD. We decode a short window [prefix, end) and emit the part after [prefix, read) only when
    it does not end in U+FFFD (the vLLM / HF TextStreamer approach), so chunks joined == full decode.
    """

    def __init__(self, tok: TextTokenizer):
        self.tok, self.ids = tok, []
        self.prefix_offset = self.read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tok.decode(self.ids[self.prefix_offset:])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is left (a dangling partial character decodes as U+FFFD)."""
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tok.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]
