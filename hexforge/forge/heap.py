"""Giving memory back to the machine between a build's stages.

A real-size build runs for hours in one process on a machine its peak nearly fills: what a stage
freed must not stay in the process for the next one (docs/notes/realsize.md)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

# ---- giving back the pages of mapped files ----------------------------------------------------
# transformers maps the safetensors (MAP_PRIVATE) and the build's calibration sessions map their
# weight files: every page the build has read once stays in this process's RSS until unmapped.
# After the host tensors, that is the whole checkpoint (Gemma-4-E2B: half the build's peak;
# docs/notes/cpu-performance.md), though each later stage reads one shard of it. The pages are
# clean copies of their files: dropping them costs a page-cache fault on the next read. A
# mapping holding private (copy-on-write) pages is left alone: MADV_DONTNEED would throw those
# writes away.
MADV_DONTNEED = 4


def release_mapped_pages(*roots: str | Path) -> int:
    """Drop this process's resident pages of files mapped from under ``roots`` (nothing is
    unmapped: the next read faults them back in). -> bytes given back (0 where there is no
    /proc/self/smaps: Linux only)."""
    # the files themselves: a HF cache snapshot holds symlinks into the repo's blobs/
    found = {Path(r).resolve() for r in roots}
    for r in roots:
        if Path(r).is_dir():
            found |= {f.resolve().parent for f in Path(r).iterdir() if f.is_symlink()}
    dirs = [str(d) + "/" for d in found]
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    spans, cur = [], None  # (start, end, rss bytes) of clean mappings under roots
    for line in smaps.splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)", line)
        if m:
            cur = None
            if any(m[3].startswith(d) for d in dirs):
                cur = [int(m[1], 16), int(m[2], 16), 0]
                spans.append(cur)
        elif cur is not None and line.startswith("Rss:"):
            cur[2] = int(line.split()[1]) * 1024
        elif cur is not None and line.startswith("Anonymous:") and int(line.split()[1]):
            spans.remove(cur)  # copy-on-write pages: its own data, not the file's
            cur = None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    freed = 0
    for start, end, rss in spans:
        if rss and libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            freed += rss
    return freed


def release_heap() -> int:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``). The QNN compiler
    and onnxruntime free their working memory into glibc's arenas, which keep it: at real size
    each compile left ~2 GB resident that no later stage could use. -> bytes given back (0 where
    the C library is not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # no glibc (TypeError: Windows' CDLL(None))
        return 0
    before = _anon_bytes()
    trim(0)
    return max(0, before - _anon_bytes())


def _anon_bytes() -> int:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    m = re.search(r"^RssAnon:\s+(\d+) kB", status, re.M)
    return int(m[1]) * 1024 if m else 0


# ---- what a graph's export takes ------------------------------------------------------------
# One export (torch's trace, the fold, the proto) adds to the process, measured alone on
# SmolLM2-135M's and Gemma-3-270M's cpu shards at 4k-32k contexts (bench/export_memory.py,
# docs/notes/measurements.md): ~9 B a weight of the module for these small ones, 5 at real size
# (Qwen3-VL-2B's 28-layer HTP shard, docs/notes/realsize.md); and 2.9-3.0 x its example inputs' bytes
# (the caches at --context: the trace holds them, their updated copies and the attention over
# them), counted 3.5, which also covers the HTP compile of that graph (3.4 x, SmolLM2 v81 fp16).
# Two bounds for the weights' part: the export scheduler's must not start a child that does not
# fit (the upper one), the build's refusal must not refuse a build that would (the lower one).
EXPORT_BYTES_PER_WEIGHT = 8
EXPORT_BYTES_PER_WEIGHT_LEAST = 5
EXPORT_INPUT_FACTOR = 3.5
# the build process besides its graphs: Python, torch, onnxruntime, the tokenizer (~0.3 GB measured)
PROCESS_BYTES = 500 * 10**6


def export_need_bytes(weights: int, input_bytes: int, least: bool = False) -> int:
    """Bytes one export of a module with ``weights`` parameters and example inputs of
    ``input_bytes`` adds at its peak (least: the lower bound)."""
    per_weight = EXPORT_BYTES_PER_WEIGHT_LEAST if least else EXPORT_BYTES_PER_WEIGHT
    return int(per_weight * weights + EXPORT_INPUT_FACTOR * input_bytes)


def available_bytes() -> int | None:
    """What the machine can still give (Linux MemAvailable: free memory and the page cache it
    can drop); None where it does not say."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M)
    return int(m[1]) * 1024 if m else None
