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
from dataclasses import dataclass
from pathlib import Path

from ..errors import BackendError, BundleError
from ..manifest import GraphSpec, TargetSpec, confine
from . import qnn

BACKENDS = ("cpu", "qnn", "qnn-sim", "auto")


def check_external_data(bundle: Path, graph_file: Path) -> None:
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    try:
        model = onnx.load(str(graph_file), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise BundleError(f"graph {graph_file.name} is not a readable ONNX model: {e}") from None
    root = bundle.resolve()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = ExternalDataInfo(t).location
            p = (graph_file.parent / loc).resolve()
            if root not in p.parents:
                raise BundleError(f"graph {graph_file.name}: external data {loc!r} lies outside the "
                                  "bundle; refused")
            if not p.is_file():
                raise BundleError(f"graph {graph_file.name}: external data {loc!r} is missing")


def cpu_threads() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, n)


@dataclass
class Backend:
    name: str  # "cpu" | "qnn" | "qnn-sim"
    device_arch: int | None = None  # the HTP the binaries must match (qnn-sim: the simulated one)
    allow_cpu_fallback: bool = False

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
            so.intra_op_num_threads = cpu_threads()
            so.inter_op_num_threads = 1
            so.log_severity_level = 3
            try:
                return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            except Exception as e:  # ORT raises its own Fail/InvalidGraph types
                raise BundleError(f"graph {graph.file} cannot be loaded by onnxruntime: {e}") from None
        return self._htp_session(bundle, target, graph, path)

    def _htp_session(self, bundle: Path, target: TargetSpec, graph: GraphSpec, path: Path):
        import onnxruntime as ort

        from ..targets import get_target

        if target.htp_arch is None:
            raise BackendError(f"backend {self.name} runs HTP targets; {target.name} is a cpu target")
        if target.weight_shared and self.name == "qnn-sim":
            raise BackendError(f"target {target.name} holds weight-shared contexts (--share-weights), "
                               "which the x86 HTP simulator cannot load; run it on a device "
                               "(--backend qnn) or rebuild without --share-weights to simulate")
        soc = next((s for s in get_target(target.name).socs if s.soc_model == target.soc_model), None)
        bin_path = confine(bundle, str(Path(graph.file).parent / qnn.context_binary_of(path).name))
        qnn.check_binary(bin_path, target.htp_arch, soc.name if soc else None, self.device_arch)
        opts = qnn.provider_options(target.htp_arch, target.soc_model, target.quant == "fp16")
        so = qnn.session_options(opts, {}, self.allow_cpu_fallback)
        try:
            with qnn.native_stdout_to_stderr():
                return ort.InferenceSession(str(path), so)
        except Exception as e:
            raise explain_qnn_error(e, graph.file, bin_path) from None


def explain_qnn_error(e: Exception, what: str, bin_path: Path | None = None) -> BackendError:
    msg = str(e)
    if "fallback to CPU EP has been explicitly disabled" in msg:
        return BackendError(f"{what}: some nodes are not supported by the HTP and would run on the CPU "
                            "(CPU fallback is disabled); pass --allow-cpu-fallback to run split")
    if re.search(r"MEM_ALLOC|1002|0x3ea", msg):
        size = f" (context binary {bin_path.stat().st_size:,} B)" if bin_path else ""
        return BackendError(f"{what}: the HTP could not allocate the context{size}; rebuild with a "
                            "smaller --max-shard-bytes so each context fits")
    first = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
    return BackendError(f"{what}: QNN could not load the graph: {first}")
