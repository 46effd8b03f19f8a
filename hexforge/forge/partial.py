"""Temp dirs beside what they become, ``.<name>.partial-<pid>``, and the next run's clean-up.

A build (or a GGUF conversion) writes into a temp dir renamed into place at the end, and removes
it on any error it can see. A process the kernel kills (the OOM killer, kill -9, power loss) runs
no ``except``: its temp dir stays, hidden. The next run next to it removes every temp dir whose
owner is gone. "Gone" is decided by a lock, not by the pid alone: the owner holds an exclusive
``flock`` on the dir for its whole run, which the kernel drops with the process however it dies,
while its pid may by then belong to another process (pids are reused, quickly in a container),
which kept a dead build's dir forever.

    .b.partial-4242/   locked by pid 4242 while it runs ──kill -9──▶ unlocked: the next run's
    .b.old-4242/       the bundle being replaced (same lock, moved)        clean-up removes it
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; the pid check alone decides
    fcntl = None

_TEMP = re.compile(r"^\..+\.(partial|old)-(\d+)$")


class TempDir:
    """``.<dest name>.partial-<pid>`` beside ``dest``, made empty and locked; ``publish()``
    renames it to ``dest`` (an old ``dest`` is moved aside first and removed after), ``discard()``
    removes it. The lock is held until one of them."""

    def __init__(self, dest: Path):
        self.dest = dest
        self.path = dest.parent / f".{dest.name}.partial-{os.getpid()}"
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir()
        self._fd = _lock(self.path)

    def publish(self) -> None:
        """Swap the finished temp dir into place; an old bundle is removed only after the swap."""
        try:
            if self.dest.exists():
                old = self.dest.parent / f".{self.dest.name}.old-{os.getpid()}"
                os.replace(self.dest, old)
                old_fd = _lock(old)  # a kill between the two renames leaves it to the clean-up
                try:
                    os.replace(self.path, self.dest)
                    shutil.rmtree(old, ignore_errors=True)
                finally:
                    _unlock(old_fd)
            else:
                os.replace(self.path, self.dest)
        finally:
            self._release()

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        _unlock(self._fd)
        self._fd = None


def remove_stale(folder: Path) -> list[Path]:
    """Remove the temp dirs in ``folder`` whose run is over (killed: no ``except`` ran) — every
    ``.*.partial-<pid>`` / ``.*.old-<pid>`` dir nobody holds the lock of; a live run keeps its
    own. -> the dirs removed."""
    removed = []
    if not folder.is_dir():
        return removed
    for d in folder.iterdir():
        m = _TEMP.match(d.name)
        if m is None or not d.is_dir() or d.is_symlink() or _running(d, int(m[2])):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _running(d: Path, pid: int) -> bool:
    """Whether the run that made ``d`` is still going: its lock is held (flock), else (no flock
    on this system) its pid is alive."""
    if fcntl is not None:
        try:
            fd = os.open(d, os.O_RDONLY)
        except OSError:
            return True  # not ours to judge (gone meanwhile, or unreadable)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False  # nobody holds it: its owner is gone, however it died
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True


def _lock(d: Path) -> int | None:
    """An exclusive flock on dir ``d`` held through the returned fd (None without flock)."""
    if fcntl is None:
        return None
    fd = os.open(d, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the fd drops the flock
