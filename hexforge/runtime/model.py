"""The Python API: ``hexforge.load(bundle)`` -> Model with ``generate`` and ``stream``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..bundle.bundlefiles import check_load, for_target
from ..bundle.errors import BackendError, RequestError
from ..bundle.manifest import Manifest, confine, load_manifest
from .backends import Backend
from .constrain import Grammars
from .engine import Engine
from .loop import Stops, StopStrings, emit
from .multimodal import Encoded, decode_media, encode_media, prepare_media
from .options import (
    Done,
    GenerationMethods,
    GenerationOptions,
    GenerationResult,
    Piece,
    check_prefill_mode,
    request_clock,
)
from .sampling import Sampler, make_sampler
from .session import ChatSession
from .speculative import PromptLookup
from .text import ChatTemplate, TextTokenizer, encode_prompt

if TYPE_CHECKING:
    from .genie.model import GenieModel

# a chat session's own generation loop (ChatSession): (ids, sampler, max new tokens, drafter) ->
# (token, logits) per step
Steps = Callable[[list[int], Sampler, int, PromptLookup | None], Iterator[tuple[int, np.ndarray]]]


def pick_target(manifest: Manifest, backend: Backend, target: str | None = None) -> str:
    """The bundle target a backend runs: cpu -> "cpu"; HTP -> the one for the device's arch."""
    htp = {n: t for n, t in manifest.targets.items() if t.htp_arch is not None}
    if target is not None:
        if target not in manifest.targets:
            raise BackendError(f"the bundle has no target {target!r} (it has "
                               f"{', '.join(manifest.targets)})")
        return target
    if not backend.is_htp:
        if "cpu" not in manifest.targets:
            raise BackendError(f"the bundle holds only HTP targets ({', '.join(htp)}; built with "
                               "--device-only): run it with --backend qnn on a Snapdragon device "
                               "or qnn-sim on x86")
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


class Model(GenerationMethods):
    def __init__(self, bundle: str | Path, backend: str | Backend = "cpu",
                 arch: str | int | None = None, target: str | None = None,
                 allow_cpu_fallback: bool = False, check_digests: bool | None = None,
                 prefill_mode: str = "chunked"):
        self.bundle = Path(bundle)
        check_prefill_mode(prefill_mode)
        self.manifest = load_manifest(self.bundle)
        self.backend = (backend if isinstance(backend, Backend) else
                        Backend.resolve(backend, parse_arch(arch), allow_cpu_fallback))
        self.target = pick_target(self.manifest, self.backend, target)
        # before any graph is opened: a short or damaged file of this target is named here
        check_load(self.bundle, self.manifest, for_target(self.manifest, self.target),
                   check_digests)
        if self.backend.is_htp and self.backend.device_arch is None:
            # qnn-sim simulates the target's arch; on a device QNN itself checks the SoC
            self.backend.device_arch = self.manifest.targets[self.target].htp_arch
        tok_dir = confine(self.bundle, self.manifest.tokenizer.dir)
        self.tokenizer = TextTokenizer(tok_dir)
        self.chat_template = ChatTemplate.load(tok_dir)
        self.engine = Engine(self.bundle, self.manifest, self.target, self.backend, prefill_mode)
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

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.apply_chat_template(messages)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def session(self, system: str | None = None) -> ChatSession:
        """A multi-turn chat that keeps the model state between turns (prefills only new text)."""
        return ChatSession(self, system)

    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def decode_media(self, images: list | None, audios: list | None) -> dict:
        """Every item decoded before any model work (runtime/multimodal.py ``decode_media``):
        bad media fail here."""
        return decode_media(self.manifest, images, audios, self._preprocessors)

    def encode_media(self, images: list | None, audios: list | None) -> Encoded:
        """The items' soft tokens by placeholder id (runtime/multimodal.py ``encode_media``)."""
        return encode_media(self.engine, self.manifest, images, audios, self._preprocessors)

    def iterate(self, prompt: str | list[int], o: GenerationOptions | None = None,
                steps: Steps | None = None) -> Iterator[Piece | Done]:
        """The streaming API the others are made of: a ``Piece`` per piece of text as it is
        generated, then one ``Done`` with the result. Stop reading to stop generating.

        steps: (ids, sampler, max_new, drafter) -> a (token, logits) generator, instead of a
        fresh generate_step (chat sessions continue their state through it)."""
        o = o or GenerationOptions()
        g = self.generation
        max_new = g.max_new_tokens if o.max_new_tokens is None else o.max_new_tokens
        if not isinstance(max_new, int) or isinstance(max_new, bool):
            raise RequestError(f"max_new_tokens must be an integer, got {max_new!r}")
        t0 = time.perf_counter()
        ids = self.encode(prompt)
        media = None
        if o.images or o.audios:
            if steps is not None:  # its caller prefills: the media rows go to it
                raise RequestError("steps= takes no images / audio: a chat session's turn takes "
                                   "them (session.send(text, images=[...]))")
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
        eos = set() if o.ignore_eos else set(g.eos_token_ids)
        lps: list[dict] | None = [] if o.logprobs is not None else None

        def taken(token: int, logits: np.ndarray) -> None:
            history.append(token)
            if constraint is not None:
                constraint.advance(token)
            if lps is not None:
                lps.append(token_logprobs(logits, token, o.logprobs or 0))

        def ended() -> str | None:
            if constraint is not None and constraint.done:  # only EOS is left
                return "stop"
            return "cancelled" if o.should_stop is not None and o.should_stop() else None

        stops = Stops(eos | set(o.stop_token_ids or []),
                      StopStrings(list([o.stop] if isinstance(o.stop, str) else o.stop or [])),
                      taken, ended)
        if steps is None:
            steps = lambda ids, sampler, n, drafter: self.engine.generate_step(  # noqa: E731
                ids, sampler, n, o.prefill_mode and check_prefill_mode(o.prefill_mode),
                media=media, drafter=drafter)
        out = yield from emit(steps(ids, sampler, max_new, drafter), self.tokenizer.detokenizer(),
                              stops, max_new)
        tokens = out.tokens
        result = GenerationResult(
            text=out.text if stops.strings.stops else self.tokenizer.decode(tokens),
            token_ids=tokens, prompt_tokens=len(ids), finish_reason=out.finish,
            **request_clock(t0, out.t_first, len(tokens)), logprobs=lps,
            speculation=drafter.stats.to_dict() if drafter is not None else None,
        )
        yield Done(result)


def token_logprobs(logits, token: int, top: int) -> dict:
    """Log-softmax of the model's raw logits (before sampling processors), as OpenAI reports."""
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
         target: str | None = None, allow_cpu_fallback: bool = False,
         check_digests: bool | None = None, prefill_mode: str = "chunked",
         dialog: str = "basic") -> Model | GenieModel:
    """Load a bundle: backend "cpu" (default), "qnn", "qnn-sim" or "auto" (or a resolved
    ``Backend``); ``arch`` = the device's Hexagon arch (e.g. "v81") when running HTP targets.
    The files the target reads are checked against the manifest's sizes every time, and against
    its SHA-256 digests where ``check_digests`` is True, or (None) where this machine has not
    verified them as they are now (bundlefiles.py); False: sizes only.

    backend "genie": the bundle's Genie folder (build --genie) run by Qualcomm's libGenie
    (runtime/genie/model.py; with its pipeline for images / audio where it has one): the same
    generate / stream / chat / iterate, with the options Genie has a counterpart for.

    prefill_mode: how a request's prompt runs unless it says otherwise — "chunked" (the AR-N
    prefill graphs) or "decode" (the AR-1 graph a token at a time; the prefill graphs are not
    opened until a request asks for them, and a Genie dialog is given its AR-1 contexts alone:
    how a model whose two graph sets pass the x86 simulator's room runs there).

    dialog (backend "genie"): "basic" (default), or "lade" -- Genie's lookahead decoding, on a
    folder built with ``--genie-kv lade`` (whose graphs make its tokens basic's)."""
    if backend == "genie":
        from .genie.pipelinemodel import open_genie

        genie_arch = target.removeprefix("genie-") if target else arch
        return open_genie(bundle, None if genie_arch is None else str(genie_arch),
                          prefill_mode=prefill_mode, dialog=dialog)
    if dialog != "basic":
        raise BackendError(f"--dialog {dialog} is a Genie dialog: it needs --backend genie")
    return Model(bundle, backend, arch, target, allow_cpu_fallback, check_digests, prefill_mode)
