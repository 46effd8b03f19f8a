"""ORT session factory per backend.

    cpu      onnxruntime CPU EP on the bundle's float ``cpu`` graphs (default; the reference)
    qnn      onnxruntime-qnn on a Snapdragon's HTP (an HTP target's context binaries)
    qnn-sim  the same binaries on the x86 HTP simulator (slow; says nothing about device speed)
    auto     qnn on an ARM host with onnxruntime-qnn, else cpu

Before a session is made, every external-data location inside the ONNX file is checked to stay in
the bundle (an ONNX file can name any path as external data), and HTP binaries are checked for
arch / SoC / SDK (runtime/qnn.py).
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..bundle.errors import BackendError, BundleError
from ..bundle.manifest import GraphSpec, TargetSpec, confine
from . import qnn
from .bound import BoundSession
from .genie.libgenie import X86_PD_LOADED_BYTES, X86_PD_REFUSED_BYTES

BACKENDS = ("cpu", "qnn", "qnn-sim", "auto")


def check_external_data(bundle: Path, graph_file: Path) -> set[Path]:
    """Refuse a graph whose external data lies outside the bundle, is missing or is too short;
    -> the external data files it reads."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    try:
        model = onnx.load(str(graph_file), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise BundleError(f"graph {graph_file.name} is not a readable ONNX model: {e}") from None
    root = bundle.resolve()
    files = set()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = ExternalDataInfo(t).location
            p = (graph_file.parent / loc).resolve()
            if root not in p.parents:
                raise BundleError(f"graph {graph_file.name}: external data {loc!r} lies outside the "
                                  "bundle; refused")
            if not p.is_file():
                raise BundleError(f"graph {graph_file.name}: external data {loc!r} is missing")
            # a truncated weight file must be named here, not found by ORT mid-read
            info = ExternalDataInfo(t)
            offset, length = int(info.offset or 0), int(info.length or 0)
            if offset < 0 or length < 0 or offset + length > p.stat().st_size:
                raise BundleError(f"graph {graph_file.name}: tensor {t.name} needs bytes "
                                  f"[{offset}, {offset + length}) of {loc!r}, which has "
                                  f"{p.stat().st_size:,}; the file is truncated or corrupted")
            files.add(p)
    return files


def cpu_threads() -> int:
    """Intra-op threads of a cpu session: HEXFORGE_CPU_THREADS, else every core this process may
    use (see ``configure_threads``)."""
    env = os.environ.get("HEXFORGE_CPU_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, n)


def configure_threads(so) -> None:
    """Every core for every cpu session, its pool spinning while a run lasts and stopping when it
    ends. A step runs shard -> shard -> head, each session with its own pool: a pool that spins
    on after its run (onnxruntime's default) steals the cores the next session needs, and one
    that never spins (sleeping workers) pays a wake-up per op, ~100 ops per layer (the decode
    speeds of each setting: docs/notes/measurements.md). HEXFORGE_CPU_SPIN=0 turns spinning off (a
    loaded machine, where a spinning thread takes a core another process needs)."""
    so.intra_op_num_threads = cpu_threads()
    so.inter_op_num_threads = 1
    spin = os.environ.get("HEXFORGE_CPU_SPIN", "1")
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.force_spinning_stop", "1")


def physical_memory_bytes() -> int | None:
    """The machine's RAM (None where os.sysconf cannot tell, e.g. Windows)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


# an fp32 prefill prepacks when its packed copy is at most this share of the machine's RAM
PREPACK_PREFILL_MEMORY_SHARE = 1 / 6


def prepack_prefill(weights: str, weight_bytes: int) -> bool:
    """Whether a prefill session prepacks its weights (``weights``: the cpu target's quant;
    ``weight_bytes``: the weight files the target's prefill graphs read).

    onnxruntime packs every MatMul weight into its kernel's layout when a session is made, so
    the prefill and the decode session of a shard each hold a packed copy of the same weights.
    Unpacked, the prefill reads the weight file itself (mapped: page cache, not process memory)
    and its MatMuls pack each weight again on every call.
    - int8 / int4: always (MatMulNBits loses its int8 kernels unpacked: 3x the TTFT).
    - fp32: when the second copy is small next to the machine's RAM (at most 1/6 of it: Qwen3-0.6B's
      2.4 GB on a 16 GB laptop, not Gemma-4-E2B's 9 GB, ~2 x 7 GB packed on a 24 GB machine),
      where the faster prefill is worth the memory (docs/notes/measurements.md)."""
    if weights != "fp32":
        return True
    memory = physical_memory_bytes()
    return memory is not None and weight_bytes <= memory * PREPACK_PREFILL_MEMORY_SHARE


def disable_prepacking(so) -> None:
    """session.disable_prepacking = 1 on ``so``, once (onnxruntime warns on a second set)."""
    try:
        if so.get_session_config_entry("session.disable_prepacking") == "1":
            return
    except Exception:  # onnxruntime raises for an entry never set
        pass
    so.add_session_config_entry("session.disable_prepacking", "1")


@dataclass
class Backend:
    name: str  # "cpu" | "qnn" | "qnn-sim"
    device_arch: int | None = None  # the HTP the binaries must match (qnn-sim: the simulated one)
    allow_cpu_fallback: bool = False
    # every session writes onnxruntime's per-node profile to <profile_prefix>-<graph>_<time>.json
    # (``hexforge bench --op-profile``); None: no profiling
    profile_prefix: str | None = None
    # (bundle, target) -> bytes of its prefill graphs' weight files (prepack_prefill)
    _weight_bytes: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def resolve(cls, name: str, device_arch: int | None = None,
                allow_cpu_fallback: bool = False) -> Backend:
        if name not in BACKENDS:
            raise BackendError(f"backend {name!r} is unknown; choose from {', '.join(BACKENDS)}")
        if name == "auto":
            name = "qnn" if qnn.available() and qnn.is_arm_host() else "cpu"
        if name in ("qnn", "qnn-sim") and not qnn.available():
            raise BackendError(f"backend {name} needs onnxruntime-qnn (pip install onnxruntime-qnn)")
        if name == "qnn" and not qnn.is_arm_host():
            raise BackendError("backend qnn needs a Snapdragon (ARM) host; on x86 use --backend qnn-sim")
        return cls(name, device_arch, allow_cpu_fallback)

    @property
    def is_htp(self) -> bool:
        return self.name != "cpu"

    def configure_cpu_session(self, so, path: Path, graph: GraphSpec, packed: bool) -> None:
        """Extra cpu session options for one graph (the build's oracle maps weights once).
        packed: whether the runtime gives this target's prefill sessions their own packed copy
        of the weights (``prepack_prefill``)."""

    def _profile(self, so, graph: GraphSpec) -> None:
        if self.profile_prefix is not None:
            so.enable_profiling = True
            so.profile_file_prefix = f"{self.profile_prefix}-{graph.name}"

    def _prefill_weight_bytes(self, bundle: Path, target: TargetSpec) -> int:
        """The bytes of the weight files the target's prefill graphs read, each file once
        (worked out once per target, not per session)."""
        key = (bundle.resolve(), target.name)
        if key not in self._weight_bytes:
            files = set()
            for shard in target.plan.shards:
                files |= check_external_data(bundle,
                                             confine(bundle, target.graph(shard.prefill).file))
            self._weight_bytes[key] = sum(f.stat().st_size for f in files)
        return self._weight_bytes[key]

    def session(self, bundle: Path, target: TargetSpec, graph: GraphSpec):
        import onnxruntime as ort

        path = confine(bundle, graph.file)
        check_external_data(bundle, path)
        if not self.is_htp:
            if target.htp_arch is not None:
                raise BackendError(f"target {target.name} holds HTP binaries; the cpu backend runs "
                                   "the 'cpu' target")
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.log_severity_level = 3
            configure_threads(so)
            # the prefill graphs, and the head where the decode graph runs its own copy (then
            # the head serves one row per prompt): the decode session holds the packed weights
            prefill_only = graph.role == "prefill" or (graph.role == "head"
                                                       and target.decode_runs_head)
            quant = target.quant or "fp32"
            packed = prepack_prefill(
                quant, self._prefill_weight_bytes(bundle, target) if quant == "fp32" else 0)
            if prefill_only and not packed:
                disable_prepacking(so)
            self.configure_cpu_session(so, path, graph, packed)
            self._profile(so, graph)
            try:
                sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            except Exception as e:  # ORT raises its own Fail/InvalidGraph types
                raise BundleError(f"graph {graph.file} cannot be loaded by onnxruntime: {e}") from None
            return BoundSession(sess, graph)  # IO binding: no per-call binding of the state
        return self._htp_session(bundle, target, graph, path)

    def _htp_session(self, bundle: Path, target: TargetSpec, graph: GraphSpec, path: Path):
        import onnxruntime as ort

        from ..bundle.targets import get_target

        if target.htp_arch is None:
            raise BackendError(f"backend {self.name} runs HTP targets; {target.name} is a cpu target")
        if target.weight_shared and self.name == "qnn-sim":
            raise BackendError(f"target {target.name} holds weight-shared contexts (--share-weights), "
                               "which the x86 HTP simulator cannot load; run it on a device "
                               "(--backend qnn) or rebuild without --share-weights to simulate")
        spec = get_target(target.name)
        soc = next((s for s in spec.socs if s.soc_model == target.soc_model), None)
        if soc is None or spec.htp_arch != target.htp_arch:
            known = ", ".join(f"{s.name} (soc_model {s.soc_model})" for s in spec.socs)
            raise BundleError(f"target {target.name} says v{target.htp_arch} / soc_model "
                              f"{target.soc_model}, which is not a {target.name} SoC ({known}); "
                              "the bundle is inconsistent: rebuild it")
        installed = qnn.sdk_version()
        if target.qnn_sdk and qnn.version_tuple(target.qnn_sdk) > qnn.version_tuple(installed):
            raise BackendError(f"target {target.name} was built with QNN SDK {target.qnn_sdk}, newer "
                               f"than the installed {installed}; upgrade onnxruntime-qnn or rebuild")
        bin_path = confine(bundle, str(Path(graph.file).parent / qnn.context_binary_of(path).name))
        qnn.check_binary(bin_path, target.htp_arch, soc.name, self.device_arch)
        opts = qnn.provider_options(target.htp_arch, soc.soc_model, target.quant == "fp16")
        record = {"session.record_ep_graph_assignment_info": "1"}  # to name any CPU split
        so = qnn.session_options(opts, record, self.allow_cpu_fallback)
        self._profile(so, graph)
        try:
            with qnn.native_stdout_to_stderr():
                sess = ort.InferenceSession(str(path), so)
        except Exception as e:
            err = explain_qnn_error(e, graph.file, bin_path, graph.bytes, spec.max_context_bytes,
                                    target_bytes=None if self.name != "qnn-sim" else sum(
                                        g.bytes for g in target.graphs if g.role != "verify"))
            if FALLBACK_DISABLED in str(e):  # load it once more, split allowed, to name the nodes
                so = qnn.session_options(opts, record, allow_cpu_fallback=True)
                try:
                    with qnn.native_stdout_to_stderr():
                        split = describe_split(ort.InferenceSession(str(path), so))
                except Exception:
                    split = None
                if split:
                    err = BackendError(f"{graph.file}: {split}; CPU fallback is disabled: rebuild "
                                       "so the HTP claims every node, or pass --allow-cpu-fallback "
                                       "to run split")
            raise err from None
        split = describe_split(sess)
        if split:  # only reachable with --allow-cpu-fallback
            warnings.warn(f"{graph.file}: {split} (--allow-cpu-fallback)", stacklevel=2)
        return sess


FALLBACK_DISABLED = "fallback to CPU EP has been explicitly disabled"


def describe_split(sess) -> str | None:
    """'would run 1 of 2 nodes on the CPU (Trilu x1), 1 on the HTP' from a session made with
    ``session.record_ep_graph_assignment_info``; None when the HTP runs everything."""
    on: dict[str, list[str]] = {}
    for sub in sess.get_provider_graph_assignment_info():
        on.setdefault(sub.ep_name, []).extend(n.op_type for n in sub.get_nodes())
    cpu = [op for ep, ops in on.items() if ep != qnn.EP for op in ops]
    if not cpu:
        return None
    total = sum(len(ops) for ops in on.values())
    kinds = ", ".join(f"{op} x{cpu.count(op)}" for op in sorted(set(cpu)))
    return (f"the HTP does not support every node: it would run {len(cpu)} of {total} nodes on "
            f"the CPU ({kinds}), {total - len(cpu)} on the HTP")


def explain_qnn_error(e: Exception, what: str, bin_path: Path | None = None,
                      graph_bytes: int | None = None, ceiling: int | None = None,
                      out_dir: Path | None = None, target_bytes: int | None = None) -> BackendError:
    """out_dir: where a compile writes its context binary (a failed write is most often a full
    disk, which the EP reports only as "Failed to write context cache file"). target_bytes: the
    graphs a simulator session opens in all (every context of a process shares one HTP process
    domain there: a target over its room fails at some context however small each is)."""
    msg = str(e)
    if out_dir is not None and "Failed to write context" in msg:
        free = shutil.disk_usage(out_dir).free
        return BackendError(f"{what}: the context binary could not be written to {out_dir} "
                            f"({free / 2**30:.1f} GB free on its disk)")
    if FALLBACK_DISABLED in msg:
        return BackendError(f"{what}: some nodes are not supported by the HTP and would run on the CPU "
                            "(CPU fallback is disabled); pass --allow-cpu-fallback to run split")
    if re.search(r"MEM_ALLOC|\b1002\b|0x3ea", msg):
        sizes = [f"context binary {bin_path.stat().st_size:,} B" if bin_path else "",
                 f"graph + weights {graph_bytes:,} B" if graph_bytes else "",
                 f"target ceiling {ceiling:,} B per context" if ceiling else ""]
        detail = "; ".join(x for x in sizes if x)
        if target_bytes and target_bytes > X86_PD_LOADED_BYTES:
            return BackendError(f"{what}: the HTP ran out of memory creating the context (QNN 1002 "
                                f"/ 0x3ea): this target's graphs are {target_bytes / 1e9:.2f} GB in "
                                "all, and the x86 simulator holds every context a process opens in "
                                f"one HTP process domain ({X86_PD_LOADED_BYTES / 1e9:.2f} GB of "
                                f"contexts loaded, {X86_PD_REFUSED_BYTES / 1e9:.2f} GB did not): run "
                                "it on a device (--backend qnn) or build it with fewer bytes")
        return BackendError(f"{what}: the HTP ran out of memory creating the context (QNN 1002 / "
                            f"0x3ea{'; ' + detail if detail else ''}); rebuild with a smaller "
                            "--max-shard-bytes so each context fits")
    first = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
    return BackendError(f"{what}: QNN could not load the graph: {first}")
