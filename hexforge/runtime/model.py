"""The Python API: ``hexforge.load(bundle)`` -> Model with ``generate`` and ``stream``."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, get_type_hints

from ..errors import BackendError, RequestError
from ..manifest import Manifest, confine, load_manifest
from .backends import Backend
from .constrain import Grammars
from .engine import Engine
from .multimodal import prepare_media
from .sampling import make_sampler
from .speculative import PromptLookup
from .text import ChatTemplate, TextTokenizer


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
    prefill_mode: Annotated[str, "'chunked': AR-N prefill graphs; 'decode': the AR-1 graph over "
                            "the prompt"] = "chunked"
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


def pick_target(manifest: Manifest, backend: Backend, target: str | None = None) -> str:
    """The bundle target a backend runs: cpu -> "cpu"; HTP -> the one for the device's arch."""
    htp = {n: t for n, t in manifest.targets.items() if t.htp_arch is not None}
    if target is not None:
        if target not in manifest.targets:
            raise BackendError(f"the bundle has no target {target!r} (it has "
                               f"{', '.join(manifest.targets)})")
        return target
    if not backend.is_htp:
        return "cpu"
    if not htp:
        raise BackendError(f"backend {backend.name} needs an HTP target but the bundle holds only "
                           "cpu graphs; rebuild with e.g. --target v81")
    if backend.device_arch is not None:
        match = [n for n, t in htp.items() if t.htp_arch == backend.device_arch]
        if not match:
            raise BackendError(f"the bundle is built for {', '.join(htp)} but the device is "
                               f"v{backend.device_arch}; rebuild with --target v{backend.device_arch}")
        return match[0]
    if len(htp) > 1:
        raise BackendError(f"the bundle holds {', '.join(htp)}: say which with --arch")
    return next(iter(htp))


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


class Model:
    def __init__(self, bundle: str | Path, backend: str | Backend = "cpu",
                 arch: str | int | None = None, target: str | None = None,
                 allow_cpu_fallback: bool = False):
        self.bundle = Path(bundle)
        self.manifest = load_manifest(self.bundle)
        self.backend = (backend if isinstance(backend, Backend) else
                        Backend.resolve(backend, parse_arch(arch), allow_cpu_fallback))
        self.target = pick_target(self.manifest, self.backend, target)
        if self.backend.is_htp and self.backend.device_arch is None:
            # qnn-sim simulates the target's arch; on a device QNN itself checks the SoC
            self.backend.device_arch = self.manifest.targets[self.target].htp_arch
        tok_dir = confine(self.bundle, self.manifest.tokenizer.dir)
        self.tokenizer = TextTokenizer(tok_dir)
        self.chat_template = ChatTemplate.load(tok_dir)
        self.engine = Engine(self.bundle, self.manifest, self.target, self.backend)
        self.generation = self.manifest.generation
        self._preprocessors: dict = {}  # media preprocessors by encoder name (made on first use)

    @cached_property
    def grammars(self) -> Grammars:
        """Constrained decoding's per-model setup (the vocabulary index), made on first use."""
        tok_json = confine(self.bundle, self.manifest.tokenizer.dir) / "tokenizer.json"
        return Grammars(tok_json.read_text(), self.manifest.vocab_size,
                        self.generation.eos_token_ids)

    @property
    def context(self) -> int:
        return self.manifest.context

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise RequestError("this bundle's checkpoint has no chat template (a base model?): "
                               "use a plain completion prompt")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    @takes_generation_options
    def chat(self, messages: list[dict], options: GenerationOptions) -> GenerationResult:
        """Render ``messages`` with the checkpoint's chat template and generate the reply."""
        return self._result(self._iterate(self._chat_ids(messages), options))

    @takes_generation_options
    def stream_chat(self, messages: list[dict], options: GenerationOptions) -> Iterator[str]:
        """``chat``, streamed: the reply's text pieces as they are generated."""
        return self._pieces(self._iterate(self._chat_ids(messages), options))

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.apply_chat_template(messages)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def session(self, system: str | None = None) -> ChatSession:
        """A multi-turn chat that keeps the model state between turns (prefills only new text)."""
        return ChatSession(self, system)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise RequestError("prompt must be a string or a list of token ids")

    def _iterate(self, prompt, o: GenerationOptions, steps=None
                 ) -> Iterator[tuple[str, int | None, GenerationResult | None]]:
        """Yields (text piece, token id, None) per token, then ("", None, result) once.

        steps: (ids, sampler, max_new, drafter) -> a (token, logits) generator, instead of a
        fresh generate_step (chat sessions continue their state through it)."""
        g = self.generation
        max_new = g.max_new_tokens if o.max_new_tokens is None else o.max_new_tokens
        if not isinstance(max_new, int) or isinstance(max_new, bool):
            raise RequestError(f"max_new_tokens must be an integer, got {max_new!r}")
        t0 = time.perf_counter()
        ids = self.encode(prompt)
        media = None
        if o.images or o.audios:
            if steps is not None:
                raise RequestError("images / audio in a chat session are not supported yet: use "
                                   "model.generate / model.chat")
            ids, media = prepare_media(self.engine, self.manifest, ids, o.images, o.audios,
                                       self._preprocessors)
        history = list(ids)  # the repetition penalty's window and the drafter read it live
        drafter = PromptLookup(o.prompt_lookup, history) if o.prompt_lookup else None
        constraint = o.constraint
        if constraint is None and o.response_format is not None:
            constraint = self.grammars.constraint(o.response_format)
        sampler = make_sampler(g.temperature if o.temperature is None else o.temperature,
                               g.top_k if o.top_k is None else o.top_k,
                               g.top_p if o.top_p is None else o.top_p, o.seed, o.min_p,
                               o.repetition_penalty, history, o.penalty_window, constraint)
        stops = StopStrings(list([o.stop] if isinstance(o.stop, str) else o.stop or []))
        eos = set() if o.ignore_eos else set(g.eos_token_ids)
        eos |= set(o.stop_token_ids or [])
        detok = self.tokenizer.detokenizer()
        tokens: list[int] = []
        lps: list[dict] | None = [] if o.logprobs is not None else None
        finish, t_first = "length", None
        if steps is None:
            steps = lambda ids, sampler, n, drafter: self.engine.generate_step(  # noqa: E731
                ids, sampler, n, o.prefill_mode, media=media, drafter=drafter)
        for token, logits in steps(ids, sampler, max_new, drafter):
            if t_first is None:
                t_first = time.perf_counter()
            if token in eos:
                finish = "stop"
                break
            tokens.append(token)
            history.append(token)
            if constraint is not None:
                constraint.advance(token)
            if lps is not None:
                lps.append(token_logprobs(logits, token, o.logprobs))
            piece = stops.add(detok.add(token))
            if piece:
                yield piece, token, None
            if stops.hit or (constraint is not None and constraint.done):  # done: only EOS is left
                finish = "stop"
                break
            if o.should_stop is not None and o.should_stop():
                finish = "cancelled"
                break
        if not stops.hit:
            tail = stops.add(detok.flush()) + (stops.flush() if not stops.hit else "")
            if tail:
                yield tail, None, None
        t_end = time.perf_counter()
        t_first = t_first or t_end
        n_after = max(len(tokens) - 1, 0)
        result = GenerationResult(
            text=stops.text if stops.stops else self.tokenizer.decode(tokens), token_ids=tokens,
            prompt_tokens=len(ids), finish_reason="stop" if stops.hit else finish,
            ttft_ms=(t_first - t0) * 1e3,
            decode_tok_s=n_after / (t_end - t_first) if n_after and t_end > t_first else 0.0,
            total_ms=(t_end - t0) * 1e3, logprobs=lps,
            speculation=drafter.stats.to_dict() if drafter is not None else None,
        )
        yield "", None, result

    @takes_generation_options
    def generate(self, prompt: str | list[int], options: GenerationOptions) -> GenerationResult:
        """Generate from ``prompt`` (text, or token ids as they are) -> GenerationResult."""
        return self._result(self._iterate(prompt, options))

    @takes_generation_options
    def stream(self, prompt: str | list[int], options: GenerationOptions) -> Iterator[str]:
        """``generate``, streamed: the output's text pieces as they are generated."""
        return self._pieces(self._iterate(prompt, options))

    @staticmethod
    def _result(items) -> GenerationResult:
        for _, _, result in items:
            if result is not None:
                return result
        raise AssertionError("unreachable")

    @staticmethod
    def _pieces(items) -> Iterator[str]:
        for piece, _, result in items:
            if result is None:
                yield piece


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

    @takes_generation_options
    def stream(self, content: str, options: GenerationOptions) -> Iterator[str]:
        """``send``, streamed: the reply's text pieces as they are generated."""
        return Model._pieces(self._turn(content, options))

    @takes_generation_options
    def send(self, content: str, options: GenerationOptions) -> GenerationResult:
        """One user turn: the reply, the state kept for the next turn."""
        return Model._result(self._turn(content, options))

    def _turn(self, content: str, options: GenerationOptions):
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

        for item in m._iterate(ids, options, steps=steps):
            if item[2] is not None:  # before handing out the result: callers stop reading there
                self.cached = ids + yielded[:-1]  # every yielded token but the last went in
                self.messages = [*msgs, {"role": "assistant", "content": item[2].text}]
            yield item


def token_logprobs(logits, token: int, top: int) -> dict:
    """Log-softmax of the model's raw logits (before sampling processors), as OpenAI reports."""
    import numpy as np

    from .sampling import log_softmax

    lp = log_softmax(logits)
    out = {"token": int(token), "logprob": float(lp[token]), "top": []}
    if top:
        best = np.argsort(-lp, kind="stable")[:top]
        out["top"] = [(int(t), float(lp[t])) for t in best]
    return out


def parse_arch(arch: str | int | None) -> int | None:
    if arch is None or isinstance(arch, int):
        return arch
    digits = str(arch).lower().removeprefix("v")
    if not digits.isdigit():
        raise BackendError(f"--arch must look like v81, got {arch!r}")
    return int(digits)


def load(bundle: str | Path, backend: str | Backend = "cpu", arch: str | int | None = None,
         target: str | None = None, allow_cpu_fallback: bool = False) -> Model:
    """Load a bundle: backend "cpu" (default), "qnn", "qnn-sim" or "auto" (or a resolved
    ``Backend``); ``arch`` = the device's Hexagon arch (e.g. "v81") when running HTP targets."""
    return Model(bundle, backend, arch, target, allow_cpu_fallback)
