"""Wall time and peak RSS per build stage of a (real-size) checkpoint.

    python bench/build_profile.py CKPT OUT [every `hexforge build` flag, its defaults] [--json FILE]

Every build log line closes a stage: its wall time and the process's peak RSS since the previous
line (Linux VmHWM, reset through /proc/self/clear_refs after each line) are recorded next to it,
with the peak of its anonymous memory (RssAnon, sampled every 0.1 s): VmHWM also counts the pages
of mapped files (the checkpoint, the weight files being written), which the kernel can drop, so
the anonymous peak is the one that says whether a machine has enough memory; while the build has
children (a shard's graphs exported side by side in forked processes) it is the whole tree's
proportional anonymous memory (Pss_Anon: a page the fork shares counted once). Its CPU seconds
(this process and the children it waited for) over its wall time say how many cores it kept busy.
The disk the build has taken (the output's filesystem's used bytes over those at the start,
sampled every 0.5 s) is recorded the same way, its peak per stage: what `disk_need` estimates.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path


def status_kb(field: str) -> int:
    """A /proc/self/status field in KiB (VmHWM, VmRSS, RssAnon, RssFile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _children() -> list[int]:
    kids = []
    for task in Path("/proc/self/task").iterdir():
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def _pss_anon_kb(pid: str | int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_Anon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_anon_kb() -> int:
    """This process's anonymous memory, with its children's while it has any (Pss_Anon of each:
    the pages a fork shares are split between the processes, not counted twice)."""
    kids = _children()
    if not kids:
        return status_kb("RssAnon")
    return _pss_anon_kb("self") + sum(_pss_anon_kb(k) for k in kids)


class AnonPeak:
    """Peak of ``read()`` (default: anonymous memory, ``tree_anon_kb``) since the last
    ``take()``, sampled by a daemon thread."""

    def __init__(self, every_s: float = 0.1, read=tree_anon_kb):
        self.peak = 0
        self.every_s = every_s
        self.read = read
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            now = self.read()  # read first: a Pss walk is slow, and take() may reset meanwhile
            self.peak = max(self.peak, now)
            time.sleep(self.every_s)

    def take(self) -> int:
        peak, self.peak = max(self.peak, self.read()), 0
        return peak


def disk_taken(folder: Path):
    """-> a reader of the bytes ``folder``'s filesystem has used since this call."""
    start = shutil.disk_usage(folder).used
    return lambda: max(0, shutil.disk_usage(folder).used - start)


def profile_build(checkpoint: str, output: str, opts) -> dict:
    """Build ``checkpoint`` into ``output`` with BuildOptions ``opts``, one row per log line:
    its wall time, peak RSS and peak anonymous memory; -> the table and the totals."""
    from hexforge.forge.pipeline import build_bundle

    stages: list[dict] = []
    t0 = last = time.perf_counter()
    cpu_last = _cpu_s()
    overall_peak = overall_anon = overall_disk = 0
    anon = AnonPeak()
    disk = AnonPeak(0.5, disk_taken(Path(output).resolve().parent))

    def log(msg: str) -> None:
        nonlocal last, cpu_last, overall_peak, overall_anon, overall_disk
        now, cpu = time.perf_counter(), _cpu_s()
        peak, anon_peak, disk_peak = status_kb("VmHWM"), anon.take(), disk.take()
        overall_peak, overall_anon = max(overall_peak, peak), max(overall_anon, anon_peak)
        overall_disk = max(overall_disk, disk_peak)
        stages.append({"stage": msg, "wall_s": round(now - last, 1),
                       "peak_rss_gb": round(peak / 2**20, 2),
                       "peak_anon_gb": round(anon_peak / 2**20, 2),
                       "rss_gb": round(status_kb("VmRSS") / 2**20, 2),
                       "peak_disk_gb": round(disk_peak / 1e9, 2),
                       "cpu_s": round(cpu - cpu_last, 1)})
        print(f"[{now - t0:7.1f}s +{now - last:6.1f}s cpu {cpu - cpu_last:6.1f}s peak "
              f"{peak / 2**20:5.2f} GB, anon {anon_peak / 2**20:5.2f} GB, disk "
              f"{disk_peak / 1e9:5.1f} GB] {msg}", file=sys.stderr,
              flush=True)
        last, cpu_last = now, cpu
        _reset_peak()

    _reset_peak()
    timings = build_bundle(checkpoint, output, opts, log=log).timings
    log("end")
    return {"checkpoint": str(checkpoint), "targets": opts.targets, "quant": opts.quant,
            "cpu_weights": opts.cpu_weights, "context": opts.context,
            "total_s": round(time.perf_counter() - t0, 1),
            "peak_rss_gb": round(overall_peak / 2**20, 2),
            "peak_anon_gb": round(overall_anon / 2**20, 2),
            "peak_disk_gb": round(overall_disk / 1e9, 2),
            "timings": {k: round(v, 1) for k, v in timings.items()}, "stages": stages}


def main() -> None:
    from hexforge.forge.options import add_build_flags, options_from_args

    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("output")
    add_build_flags(ap)  # every `hexforge build` flag, with its default
    ap.add_argument("--json", default=None, help="also write the result to this file")
    a = ap.parse_args()
    opts = options_from_args(a)
    out = profile_build(a.checkpoint, a.output, opts)
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
