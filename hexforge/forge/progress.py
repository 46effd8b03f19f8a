"""The build's progress display: a rich bar for each stage that takes minutes at real size
(export, weight quantization, calibration, the QDQ pass with GPTQ, compile, the oracle), with
its step count, elapsed time and ETA, on stderr; the build's log lines print above the bars.

Shown only where someone watches: ``hexforge build`` turns it on when stderr is a terminal and
``--json`` is off, and ``build()`` from Python shows nothing unless called inside a
``BuildProgress``. The stages reach the display through a context variable, so their signatures
and the ``log=`` callback contract stay as they are; with no display active, ``stage`` is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

_active: ContextVar[BuildProgress | None] = ContextVar("hexforge_build_progress", default=None)


class BuildProgress:
    """``with BuildProgress() as p: build(..., log=p.log)``: bars for the stages inside."""

    def __init__(self, console=None):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console or Console(stderr=True)
        self.bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"),
                             TimeRemainingColumn(), console=self.console, transient=True)
        self._token = None

    def log(self, message: str) -> None:
        """A build log line, printed above the live bars (markup and highlighting off: a line
        holding [brackets] or paths prints as it is)."""
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def __enter__(self) -> BuildProgress:
        self.bars.start()
        self._token = _active.set(self)
        return self

    def __exit__(self, *exc) -> bool:
        _active.reset(self._token)
        self.bars.stop()
        return False


class Advance(Protocol):
    """A stage's step counter: ``advance()`` one step, ``advance(n)`` n."""

    def __call__(self, n: int = 1) -> None: ...


@contextmanager
def stage(description: str, total: int) -> Iterator[Advance]:
    """A stage of ``total`` steps; yields ``advance(n=1)``. A bar with its ETA while a
    BuildProgress is active, nothing otherwise."""
    shown = _active.get()
    if shown is None:
        yield lambda n=1: None
        return
    task = shown.bars.add_task(description, total=total)
    try:
        yield lambda n=1: shown.bars.advance(task, n)
    finally:
        shown.bars.remove_task(task)
