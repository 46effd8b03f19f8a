"""The calibration text: activation ranges (QDQ), norm prescales, GPTQ Hessians all come from it.

Deliberately not the oracle's text (build/verify.py), so the oracle's numbers are
calibration-independent. ``--calib FILE`` replaces it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import BuildError

CALIB_TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat. "
    "Every morning he rowed out beyond the reef, counted the gulls, and sang songs about the tide. "
    "Question: what is 17 times 23? Answer: 391. def add(a, b): return a + b  # simple code\n"
    "Les montagnes sont hautes; die Flüsse sind lang; 山は高く、川は長い。Numbers 3.14, 2048, 1e-5."
)

MAX_CALIB_BYTES = 1 << 20


def calibration_text(path: str | None) -> str:
    if not path:
        return CALIB_TEXT
    p = Path(path)
    if not p.is_file():
        raise BuildError(f"--calib {path}: no such file")
    if p.stat().st_size > MAX_CALIB_BYTES:
        raise BuildError(f"--calib {path} is larger than {MAX_CALIB_BYTES} bytes")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BuildError(f"--calib {path} is not UTF-8 text") from None
    if not text.strip():
        raise BuildError(f"--calib {path} is empty")
    return text
