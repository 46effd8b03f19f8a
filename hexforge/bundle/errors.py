"""Typed errors. The CLI maps every HexforgeError to one line + exit code 2; the server maps them to
OpenAI-style error bodies with ``http_status``. Anything else escaping is a bug."""

from __future__ import annotations


class HexforgeError(Exception):
    """Base of every error a user can cause (bad input, bad bundle, bad checkpoint)."""

    http_status = 400


class BundleError(HexforgeError):
    """A bundle that is malformed, incomplete, escapes its directory or has the wrong schema."""


class CheckpointError(HexforgeError):
    """A HF checkpoint directory hexforge cannot (or will not) read."""


class UnsupportedModelError(CheckpointError):
    """No family file for this model_type."""


class BuildError(HexforgeError):
    """A build stage failed (export, compile, or an oracle gate)."""

    http_status = 500


class ParityGateError(BuildError):
    """The bundle does not match the HF oracle within the gate thresholds."""


class RequestError(HexforgeError):
    """A generation request that cannot be served as asked (bad params, bad ids)."""


class ContextOverflowError(RequestError):
    """Prompt tokens + max_new_tokens do not fit in the bundle's context."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context: int):
        self.prompt_tokens, self.max_new_tokens, self.context = prompt_tokens, max_new_tokens, context
        super().__init__(
            f"prompt has {prompt_tokens} tokens + max_new_tokens {max_new_tokens} = "
            f"{prompt_tokens + max_new_tokens} > the bundle's context of {context} tokens; "
            f"shorten the prompt, lower -n, or rebuild with a larger --context"
        )


class MediaError(RequestError):
    """An image or audio input that is not one, is empty, too big or too long (refused before
    its pixels / frames are decoded)."""


class BackendError(HexforgeError):
    """A backend that is unavailable or does not fit the bundle (arch/SoC/SDK mismatch, OOM)."""

    http_status = 500
