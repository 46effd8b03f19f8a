"""The calibration text: activation ranges (QDQ), norm prescales, GPTQ Hessians all come from it.

Deliberately not the oracle's text (forge/oracle/verify.py), so the oracle's numbers are
calibration-independent. ``--calib FILE`` replaces it.
"""

from __future__ import annotations

from pathlib import Path

from ...bundle.errors import BuildError

CALIB_TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat. "
    "Every morning he rowed out beyond the reef, counted the gulls, and sang songs about the tide. "
    "Question: what is 17 times 23? Answer: 391. def add(a, b): return a + b  # simple code\n"
    "Les montagnes sont hautes; die Flüsse sind lang; 山は高く、川は長い。Numbers 3.14, 2048, 1e-5."
)

MAX_CALIB_BYTES = 1 << 20


def calibration_text(path: str | None) -> str:
    return read_text_option("--calib", path) if path else CALIB_TEXT


def read_text_option(flag: str, path: str, max_bytes: int = MAX_CALIB_BYTES) -> str:
    """The UTF-8 text of a file a build option names (``--calib``, ``--eval-text``), or a
    one-line BuildError naming the option: missing, too large, not UTF-8, empty."""
    p = Path(path)
    if not p.is_file():
        raise BuildError(f"{flag} {path}: no such file")
    if p.stat().st_size > max_bytes:
        raise BuildError(f"{flag} {path} is larger than {max_bytes} bytes")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BuildError(f"{flag} {path} is not UTF-8 text") from None
    if not text.strip():
        raise BuildError(f"{flag} {path} is empty")
    return text
