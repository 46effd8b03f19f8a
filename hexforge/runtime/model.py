"""The Python API: ``hexforge.load(bundle)`` -> Model with ``generate`` and ``stream``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import BackendError, RequestError
from ..manifest import Manifest, confine, load_manifest
from .backends import Backend
from .engine import Engine
from .sampling import make_sampler
from .text import ChatTemplate, TextTokenizer


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS / stop token) | "length" (max_new_tokens)
    ttft_ms: float  # prompt in -> first token out (tokenize + prefill + first sample)
    decode_tok_s: float  # tokens after the first / time after the first
    total_ms: float
    timings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


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


class Model:
    def __init__(self, bundle: str | Path, backend: str = "cpu", arch: str | int | None = None,
                 target: str | None = None, allow_cpu_fallback: bool = False):
        self.bundle = Path(bundle)
        self.manifest = load_manifest(self.bundle)
        self.backend = Backend.resolve(backend, parse_arch(arch), allow_cpu_fallback)
        self.target = pick_target(self.manifest, self.backend, target)
        if self.backend.is_htp and self.backend.device_arch is None:
            # qnn-sim simulates the target's arch; on a device QNN itself checks the SoC
            self.backend.device_arch = self.manifest.targets[self.target].htp_arch
        tok_dir = confine(self.bundle, self.manifest.tokenizer.dir)
        self.tokenizer = TextTokenizer(tok_dir)
        self.chat_template = ChatTemplate.load(tok_dir)
        self.engine = Engine(self.bundle, self.manifest, self.target, self.backend)
        self.generation = self.manifest.generation

    @property
    def context(self) -> int:
        return self.manifest.context

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise RequestError("this bundle's checkpoint has no chat template (a base model?): "
                               "use a plain completion prompt")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def chat(self, messages: list[dict], **kw) -> GenerationResult:
        """Render ``messages`` with the checkpoint's chat template and generate the reply."""
        text = self.apply_chat_template(messages)
        return self.generate(self.tokenizer.encode(text, add_special_tokens=False), **kw)

    def stream_chat(self, messages: list[dict], **kw) -> Iterator[str]:
        text = self.apply_chat_template(messages)
        return self.stream(self.tokenizer.encode(text, add_special_tokens=False), **kw)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise RequestError("prompt must be a string or a list of token ids")

    def _iterate(self, prompt, max_new_tokens=None, temperature=None, top_k=None, top_p=None,
                 seed=None, ignore_eos=False, prefill_mode="chunked"
                 ) -> Iterator[tuple[str, int | None, GenerationResult | None]]:
        """Yields (text piece, token id, None) per token, then ("", None, result) once."""
        g = self.generation
        max_new = g.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not isinstance(max_new, int) or isinstance(max_new, bool):
            raise RequestError(f"max_new_tokens must be an integer, got {max_new!r}")
        sampler = make_sampler(g.temperature if temperature is None else temperature,
                               g.top_k if top_k is None else top_k,
                               g.top_p if top_p is None else top_p, seed)
        t0 = time.perf_counter()
        ids = self.encode(prompt)
        eos = set() if ignore_eos else set(g.eos_token_ids)
        detok = self.tokenizer.detokenizer()
        tokens: list[int] = []
        finish, t_first = "length", None
        for token, _ in self.engine.generate_step(ids, sampler, max_new, prefill_mode):
            if t_first is None:
                t_first = time.perf_counter()
            if token in eos:
                finish = "stop"
                break
            tokens.append(token)
            piece = detok.add(token)
            if piece:
                yield piece, token, None
        tail = detok.flush()
        if tail:
            yield tail, None, None
        t_end = time.perf_counter()
        t_first = t_first or t_end
        n_after = max(len(tokens) - 1, 0)
        result = GenerationResult(
            text=self.tokenizer.decode(tokens), token_ids=tokens, prompt_tokens=len(ids),
            finish_reason=finish, ttft_ms=(t_first - t0) * 1e3,
            decode_tok_s=n_after / (t_end - t_first) if n_after and t_end > t_first else 0.0,
            total_ms=(t_end - t0) * 1e3,
        )
        yield "", None, result

    def generate(self, prompt: str | list[int], **kw) -> GenerationResult:
        for _, _, result in self._iterate(prompt, **kw):
            if result is not None:
                return result
        raise AssertionError("unreachable")

    def stream(self, prompt: str | list[int], **kw) -> Iterator[str]:
        for piece, _, result in self._iterate(prompt, **kw):
            if result is None:
                yield piece


def parse_arch(arch: str | int | None) -> int | None:
    if arch is None or isinstance(arch, int):
        return arch
    digits = str(arch).lower().removeprefix("v")
    if not digits.isdigit():
        raise BackendError(f"--arch must look like v81, got {arch!r}")
    return int(digits)


def load(bundle: str | Path, backend: str = "cpu", arch: str | int | None = None,
         target: str | None = None, allow_cpu_fallback: bool = False) -> Model:
    """Load a bundle: backend "cpu" (default), "qnn", "qnn-sim" or "auto"; ``arch`` = the device's
    Hexagon arch (e.g. "v81") when running HTP targets."""
    return Model(bundle, backend, arch, target, allow_cpu_fallback)
