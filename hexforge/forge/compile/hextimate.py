"""Hextimate: QNN's on-host performance estimator, one ONNX graph at a time.

    X.onnx ──QNN EP, soc_model = the arch's estimator SoC (v81 -> SA8797), profiling basic──▶
        finalize (no run) ──▶ profile.csv: "Simulated (Accelerator exec cycles / time us)" with
        lower / upper estimates, DDR fill / spill bytes, "Missing Ops" (ops it has no cost for)

The x86 libQnnHtp.so carries the estimator; onnxruntime's QNN EP reaches it as it is. Facts it
rests on (QNN 2.51 / onnxruntime-qnn 2.7.0, docs/htp.md "Speed on the NPU: Hextimate"):
  * only some SoCs estimate (targets.Target.estimator); the phones' SoCs (SM8850, SM8750, ...)
    log "Performance Estimates unsupported" and write no estimate rows;
  * the estimate is written when the graph is finalized, so a plain session (no context binary
    written) is enough: the binary is never kept. A context binary already finalized gives only
    the simulator's wall times when loaded (host-dependent), never an estimate: estimating needs
    the ONNX graph the binary was compiled from;
  * the EP appends to an existing profile file: every estimate gets a fresh one;
  * deterministic: the same graph gives the same cycles in another process.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import tempfile
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ...bundle.errors import BackendError, HexforgeError
from ...bundle.targets import Soc

# the CSV rows read (column "Event Identifier"); several QNN graphs in one session add up
_ROWS = {
    "cycles": "Simulated (Accelerator exec cycles)",
    "cycles_low": "Simulated (Accelerator exec cycles (lower estimate))",
    "cycles_high": "Simulated (Accelerator exec cycles (upper estimate))",
    "us": "Simulated (Accelerator exec time us)",
    "us_low": "Simulated (Accelerator exec time us (lower estimate))",
    "us_high": "Simulated (Accelerator exec time us (upper estimate))",
    "missing_ops": "Missing Ops (Number of Ops with no Costs associated)",
}
# DDR -> VTCM reads (weights and graph inputs, spilled intermediates read back) and writes
_FILLS = ("Input Fill", "Intermediate Fill", "Inter HTP Fill")
_SPILLS = ("Output Spill", "Intermediate Spill", "Inter HTP Spill")


@dataclass(frozen=True)
class GraphEstimate:
    """One graph's estimate on the estimator SoC. ``us`` (and its bounds) is the estimator's own
    rounding to whole microseconds; ``cycles`` keeps its resolution. ``missing_ops``: ops the
    estimator has no cost for, counted as free (a graph with any is an underestimate)."""
    us: int
    us_low: int
    us_high: int
    cycles: int
    cycles_low: int
    cycles_high: int
    missing_ops: int
    fill_bytes: int  # bytes read from DDR: Input Fill (weights + inputs) + intermediate fills
    input_fill_bytes: int
    spill_bytes: int  # bytes written to DDR: outputs + intermediate spills

    def to_dict(self) -> dict:
        return asdict(self)


def parse_profile(text: str) -> GraphEstimate:
    """The estimate rows of a QNN EP profile CSV -> GraphEstimate (summed over the QNN graphs
    the session made); BackendError when the file holds no estimate."""
    sums: dict[str, int] = {}
    for row in csv.DictReader(io.StringIO(text)):
        name, value = row.get("Event Identifier"), row.get("Time")
        if name is None or value is None:
            continue
        try:
            sums[name] = sums.get(name, 0) + int(value)
        except ValueError:
            continue
    if _ROWS["cycles"] not in sums:
        raise BackendError("the QNN profile holds no performance estimate (the SoC has no "
                           "estimator, or the graph was not finalized)")
    values = {k: sums.get(row, 0) for k, row in _ROWS.items()}
    return GraphEstimate(**values, fill_bytes=sum(sums.get(r, 0) for r in _FILLS),
                         input_fill_bytes=sums.get("Input Fill", 0),
                         spill_bytes=sum(sums.get(r, 0) for r in _SPILLS))


def estimate_graph(src: Path, arch: int, soc: Soc, fp16: bool, level: str = "basic",
                   trace_dir: Path | None = None, options: dict[str, str] | None = None
                   ) -> GraphEstimate:
    """Finalize ``src`` (an ONNX graph the HTP target compiles: float, weight-only or QDQ) for
    ``soc`` with CPU fallback disabled, as the build compiles it (``options``: the compile's
    extra QNN EP options, forge/compile/contexts.compile_options), and read its estimate.
    ``level`` "optrace" with ``trace_dir``: the profile CSV, the per-op timeline QNN writes
    beside it (``profile_qnn.log``) and the graph's ``<graph>_schematic.bin`` (the op map that
    qnn-profile-viewer reads with the timeline) are kept there; otherwise all go with a temp
    dir."""
    import onnxruntime as ort

    from ...runtime import qnn
    from ...runtime.backends import explain_qnn_error
    from ..heap import release_heap

    src = Path(src).absolute()  # the session may be made from another working folder
    with tempfile.TemporaryDirectory(prefix="hextimate-") as tmp:
        folder = (Path(trace_dir) if trace_dir is not None else Path(tmp)).absolute()
        folder.mkdir(parents=True, exist_ok=True)
        prof = folder / "profile.csv"
        for stale in (prof, folder / "profile_qnn.log"):
            stale.unlink(missing_ok=True)  # the EP appends: a fresh file per estimate
        opts = qnn.provider_options(arch, soc.soc_model, fp16) | (options or {})
        opts |= {"profiling_level": level, "profiling_file_path": str(prof)}
        try:
            with qnn.native_stdout_to_stderr(), _working_folder(folder, level == "optrace"):
                sess = ort.InferenceSession(str(src), qnn.session_options(opts, {}))
            del sess
        except Exception as e:
            raise BackendError(str(explain_qnn_error(
                e, f"estimating {src.name} on {soc.name}", out_dir=folder))) from None
        finally:
            release_heap()  # the compiler's working memory, as after a build's compile
        if not prof.is_file():
            raise BackendError(f"estimating {src.name} on {soc.name} wrote no profile")
        try:
            return parse_profile(prof.read_text())
        except HexforgeError as e:
            raise BackendError(f"{src.name} on {soc.name}: {e}") from None


_chdir_lock = threading.Lock()


@contextlib.contextmanager
def _working_folder(folder: Path, move: bool) -> Iterator[None]:
    """Inside, the process works in ``folder`` (when ``move``). An optrace profile's graph
    finalize writes ``<graph>_schematic.bin`` into the working folder, whatever
    ``profiling_file_path`` says, and the QNN EP has no option to name another (onnxruntime-qnn
    2.7.0; the basic and detailed levels, compiles and simulator runs write nothing there): a
    run from the repository's root left one to be committed (issue 78). The working folder is
    the process's: one move at a time, paths made absolute before."""
    if not move:
        yield
        return
    with _chdir_lock:
        back = os.getcwd()
        os.chdir(folder)
        try:
            yield
        finally:
            os.chdir(back)


def optrace(log: Path) -> dict:
    """The Chrome trace QNN embeds in ``profile_qnn.log`` under ``profiling_level`` optrace
    (``estimate_graph(..., level="optrace", trace_dir=...)``): {"traceEvents": [...],
    "Hextimate Configuration": {soc, VTCM, clocks, DDR / NoC widths}, ...}. Times in cycles."""
    data = Path(log).read_bytes()
    at = data.find(b'"traceEvents"')
    start = data.rfind(b"{", 0, at)
    if at < 0 or start < 0:
        raise BackendError(f"{Path(log).name} holds no optrace timeline (profiling_level optrace?)")
    obj, _ = json.JSONDecoder().raw_decode(data[start:].decode("utf-8", "replace"))
    return obj


_UNITS = ("HVX", "HMX", "DMA")


def op_breakdown(trace: dict) -> list[dict]:
    """Where a graph's cycles go, per op and unit: each op's busy cycles on the HVX threads, the
    HMX and the DMA engines, and the DRAM bytes it moves, largest first. Units overlap in time
    (a DMA fills VTCM while HVX computes), so the rows add up to more than the graph's span."""
    threads = {e["tid"]: e["args"]["name"].rstrip(":") for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    rows: dict[tuple[str, str], dict] = defaultdict(lambda: {"cycles": 0, "calls": 0,
                                                            "dram_read": 0, "dram_write": 0})
    for e in trace["traceEvents"]:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "scalar" in args.get("flags", ()):
            continue  # scalar events: the scheduler spawning and waiting, not the work
        unit = next((u for u in _UNITS if threads.get(e["tid"], "").startswith(u)), "other")
        m = re.search(r"\(q::(.+)\)", e["name"])  # "default_dma (q::Op)" -> the op it serves
        op = m.group(1) if m else e["name"].removeprefix("q::")
        r = rows[(op, unit)]
        r["cycles"] += int(e.get("dur", 0))
        r["calls"] += 1
        bw = args.get("bw_info") or {}
        r["dram_read"] += int(bw.get("dram_read", 0))
        r["dram_write"] += int(bw.get("dram_write", 0))
    out = [{"op": op, "unit": unit, **r} for (op, unit), r in rows.items()]
    return sorted(out, key=lambda r: -r["cycles"])
