"""Tokenizer (HF ``tokenizers``, no transformers at run time) and a streaming detokenizer."""

from __future__ import annotations

from pathlib import Path

from ..bundle.errors import BundleError, RequestError


def encode_prompt(tokenizer: TextTokenizer, prompt: str | list[int]) -> list[int]:
    """A request's prompt -> token ids: text through the tokenizer, ids as they are."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("the prompt is empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise RequestError("prompt must be a string or a list of token ids")


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
        self.tok, self.ids = tok, list[int]()
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


class ChatTemplate:
    """The checkpoint's chat template, rendered the way transformers renders it (jinja2's
    ImmutableSandboxedEnvironment, trim_blocks/lstrip_blocks, ``raise_exception``), so a template
    cannot reach Python attributes or import anything; plus loop / size budgets
    (``_BoundedSandbox``) and every failure mapped to a RequestError."""

    MAX_BYTES = 1 << 20

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None):
        from jinja2 import TemplateError

        def raise_exception(message):
            raise TemplateError(message)

        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                              extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["range"] = env.budget_range
        try:
            self._template = env.from_string(source)
        except (TemplateError, RecursionError, MemoryError) as e:
            raise BundleError(f"the chat template does not parse: {e}") from None
        self._env = env
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def load(cls, tokenizer_dir: Path) -> ChatTemplate | None:
        import json

        source = None
        jinja = tokenizer_dir / "chat_template.jinja"
        config: dict = {}
        cfg_path = tokenizer_dir / "tokenizer_config.json"
        if cfg_path.is_file() and cfg_path.stat().st_size < cls.MAX_BYTES * 16:
            try:
                config = json.loads(cfg_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise BundleError(f"{cfg_path.name} is not valid JSON") from None
        if jinja.is_file() and jinja.stat().st_size < cls.MAX_BYTES:
            source = jinja.read_text()
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # [{"name": "default", "template": ..}]
            named = {t.get("name"): t.get("template") for t in config["chat_template"]
                     if isinstance(t, dict)}
            source = named.get("default")
        if not source:
            return None

        def token(v):
            return v.get("content") if isinstance(v, dict) else v

        return cls(source, token(config.get("bos_token")), token(config.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        from jinja2 import TemplateError
        from jinja2.exceptions import SecurityError

        check_messages(messages)
        self._env.spent = 0
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **kwargs)
        except SecurityError as e:
            raise RequestError(f"the chat template tried something the sandbox forbids: {e}") from None
        except TemplateError as e:
            raise RequestError(f"the chat template refused the messages: {e}") from None
        except Exception as e:  # {% include %} without a loader (TypeError), RecursionError, ...
            raise RequestError(f"the chat template failed on these messages: "
                               f"{type(e).__name__}: {e}") from None


def _BoundedSandbox(**kw):
    """jinja2's ImmutableSandboxedEnvironment plus two budgets the sandbox lacks, so a hostile
    template cannot hang or exhaust the server: ``range`` draws from one per-render budget of
    RENDER_BUDGET iterations (nested loops multiply otherwise), and ``*`` / ``**`` refuse
    results bigger than the budget ('a' * 10**10, 10**10**10)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    budget = RENDER_BUDGET

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])
        spent = 0

        def budget_range(self, *args):
            r = range(*args)
            self.spent += len(r)
            if self.spent > budget:
                raise SecurityError(f"the template iterates more than {budget:,} times")
            return r

        def call_binop(self, context, operator, left, right):
            if operator == "**":
                big = isinstance(left, int) and left.bit_length() * abs(right) > 64 * budget
                if isinstance(right, int) and (abs(right) > 64 or big):
                    raise SecurityError("'**' with an exponent over 64 or a huge result is refused")
            elif isinstance(left, str | list | tuple) or isinstance(right, str | list | tuple):
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(n, int) and hasattr(seq, "__len__") and len(seq) * n > budget:
                    raise SecurityError(f"'*' would make a sequence over {budget:,} items")
            return super().call_binop(context, operator, left, right)

    return Env(**kw)


RENDER_BUDGET = 1_000_000


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        if not isinstance(m["content"], str | list):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts")
