"""What one request asks for (``GenerationOptions``, the typed keywords of ``Model.generate`` and
friends) and what it gets back (``GenerationResult``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Any, TypedDict, get_type_hints

from ..bundle.errors import ContextOverflowError, RequestError


def check_request(prompt_ids: list[int], max_new_tokens: int, vocab_size: int, context: int,
                  past: int = 0) -> None:
    """A request every runtime refuses before running anything (hexforge's engine and Genie's
    alike): no prompt, no tokens asked for, ids outside the vocabulary, more than the context."""
    import numpy as np

    if not prompt_ids:
        raise RequestError("the prompt is empty (0 tokens)")
    if max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    bad = [t for t in prompt_ids if not (isinstance(t, int | np.integer) and 0 <= t < vocab_size)]
    if bad:
        raise RequestError(f"token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
    if past + len(prompt_ids) + max_new_tokens > context:
        raise ContextOverflowError(past + len(prompt_ids), max_new_tokens, context)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS / stop token / stop string) | "length" | "cancelled"
    ttft_ms: float  # prompt in -> first token out (tokenize + prefill + first sample)
    decode_tok_s: float  # tokens after the first / time after the first
    total_ms: float
    timings: dict = field(default_factory=dict)
    # per generated token, when requested: {"token", "logprob", "top": [(token, logprob), ...]}
    logprobs: list[dict] | None = None
    # under prompt_lookup: drafted / accepted tokens, acceptance, verify_calls, decode_calls,
    # tokens_per_verify (runtime/speculative.py SpeculationStats)
    speculation: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


PREFILL_MODES = ("chunked", "decode")


def check_prefill_mode(mode: str) -> str:
    """``mode`` if it is a prefill mode; a one-line error otherwise."""
    if mode not in PREFILL_MODES:
        raise RequestError(f"prefill_mode must be one of {', '.join(PREFILL_MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """How one request generates: each field is a keyword argument of ``Model.generate`` /
    ``stream`` / ``chat`` / ``stream_chat`` and ``ChatSession.send`` / ``stream``. None means
    the bundle's generation defaults (the checkpoint's generation config) where it has one."""

    max_new_tokens: Annotated[int | None, "tokens to generate at most (None: the bundle's "
                              "default, 64 unless the checkpoint's generation config says so)"] = None
    temperature: Annotated[float | None, "0: greedy; None: the generation config's (greedy "
                           "without one)"] = None
    top_k: Annotated[int | None, "sample among the k likeliest tokens (0: all)"] = None
    top_p: Annotated[float | None, "sample among the likeliest tokens holding this probability "
                     "mass"] = None
    min_p: Annotated[float, "drop tokens below this fraction of the likeliest token's "
                     "probability"] = 0.0
    repetition_penalty: Annotated[float, "divide the logits of tokens already in the context by "
                                  "this (HF's rule); 1: off"] = 1.0
    penalty_window: Annotated[int, "the repetition penalty looks at the context's last this many "
                              "ids only (0: all of them)"] = 0
    seed: Annotated[int | None, "the sampler's seed (the same seed, the same output)"] = None
    stop: Annotated[str | list[str] | None, "strings that end the output (it is cut before "
                    "them)"] = None
    stop_token_ids: Annotated[list[int] | None, "token ids that end the output, beside EOS"] = None
    ignore_eos: Annotated[bool, "generate past EOS tokens"] = False
    logprobs: Annotated[int | None, "report each token's logprob and this many top alternatives "
                        "(0: the chosen token only)"] = None
    response_format: Annotated[dict | None, "constrain the output, OpenAI-style: {'type': "
                               "'json_schema' | 'json_object' | 'regex' | 'lark', ...}"] = None
    constraint: Annotated[Any, "or a ready grammar processor with advance(token) and done "
                          "(runtime/constrain.py)"] = None
    images: Annotated[list | None, "images (paths, bytes, data: URLs) spliced at the prompt's "
                      "placeholders (or put first)"] = None
    audios: Annotated[list | None, "audio clips (paths, bytes, data: URLs), as images"] = None
    prompt_lookup: Annotated[int | None, "speculative decoding: draft up to k tokens a step from "
                             "the context and verify them in one call (the same tokens)"] = None
    prefill_mode: Annotated[str | None, "'chunked': AR-N prefill graphs; 'decode': the AR-1 "
                            "graph over the prompt; None: the model's (hexforge.load's "
                            "prefill_mode, 'chunked' unless set)"] = None
    should_stop: Annotated[Callable[[], bool] | None, "polled every token; True cancels "
                           "(finish_reason 'cancelled')"] = None


def _options_doc() -> str:
    hints = get_type_hints(GenerationOptions, include_extras=True)
    return "\n".join(f"    {f.name}: {hints[f.name].__metadata__[0]}" for f in fields(GenerationOptions))


def takes_generation_options(fn):
    """``fn(self, first, options: GenerationOptions)`` -> a method called as ``fn(self, first,
    **options)``, whose signature (``help()``, ``inspect.signature``) lists every field of
    GenerationOptions as a typed keyword-only parameter; an unknown keyword is a TypeError."""
    hints = get_type_hints(GenerationOptions)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                annotation=hints[f.name]) for f in fields(GenerationOptions)]
    sig, own = inspect.signature(fn), get_type_hints(fn)
    head = [p.replace(annotation=own.get(p.name, p.annotation)) for p in sig.parameters.values()
            if p.name != "options"]

    @functools.wraps(fn)
    def method(self, first, **options):
        return fn(self, first, GenerationOptions(**options))

    method.__signature__ = sig.replace(parameters=[*head, *params],
                                       return_annotation=own.get("return", sig.return_annotation))
    method.__doc__ = f"{fn.__doc__ or ''}\n\nKeyword arguments (GenerationOptions):\n{_options_doc()}"
    return method


class Clock(TypedDict):
    ttft_ms: float
    decode_tok_s: float
    total_ms: float


def request_clock(t0: float, t_first: float | None, n_tokens: int) -> Clock:
    """A request's ttft_ms / decode_tok_s / total_ms from its perf_counter readings (the start,
    the first token; the end is now) and its output length: every runtime's result reads them."""
    import time

    t_end = time.perf_counter()
    t_first = t_first or t_end
    n_after = max(n_tokens - 1, 0)
    return Clock(ttft_ms=(t_first - t0) * 1e3,
                 decode_tok_s=n_after / (t_end - t_first) if n_after and t_end > t_first else 0.0,
                 total_ms=(t_end - t0) * 1e3)


@dataclass(frozen=True)
class Piece:
    """Text of the output as it is generated (``Model.iterate``): ``token`` the id whose text it
    ends with; None for the text the stream's end released (held back for a stop string, or
    bytes of a character that the last token did not complete)."""

    text: str
    token: int | None


@dataclass(frozen=True)
class Done:
    """The last item of ``Model.iterate``: the whole request's result."""

    result: GenerationResult


def result_of(items: Iterable[Piece | Done]) -> GenerationResult:
    """The result of ``Model.iterate``'s items (read to the end)."""
    for item in items:
        if isinstance(item, Done):
            return item.result
    raise AssertionError("unreachable: iterate ends with Done")


def pieces_of(items: Iterable[Piece | Done]) -> Iterator[str]:
    """The text pieces of ``Model.iterate``'s items, as they come."""
    for item in items:
        if isinstance(item, Piece):
            yield item.text


class GenerationMethods:
    """``generate`` / ``stream`` / ``chat`` / ``stream_chat``, made of a class's ``iterate``
    (prompt, GenerationOptions) -> Piece..., Done and its ``chat_ids`` (messages -> the chat
    template's ids): one set of methods, one signature, for every runtime (Model, GenieModel)."""

    def iterate(self, prompt: str | list[int], o: GenerationOptions | None = None
                ) -> Iterator[Piece | Done]:
        raise NotImplementedError

    def chat_ids(self, messages: list[dict]) -> list[int]:
        raise NotImplementedError

    @takes_generation_options
    def generate(self, prompt: str | list[int], options: GenerationOptions) -> GenerationResult:
        """Generate from ``prompt`` (text, or token ids as they are) -> GenerationResult."""
        return result_of(self.iterate(prompt, options))

    @takes_generation_options
    def stream(self, prompt: str | list[int], options: GenerationOptions) -> Iterator[str]:
        """``generate``, streamed: the output's text pieces as they are generated."""
        return pieces_of(self.iterate(prompt, options))

    @takes_generation_options
    def chat(self, messages: list[dict], options: GenerationOptions) -> GenerationResult:
        """Render ``messages`` with the checkpoint's chat template and generate the reply."""
        return result_of(self.iterate(self.chat_ids(messages), options))

    @takes_generation_options
    def stream_chat(self, messages: list[dict], options: GenerationOptions) -> Iterator[str]:
        """``chat``, streamed: the reply's text pieces as they are generated."""
        return pieces_of(self.iterate(self.chat_ids(messages), options))
