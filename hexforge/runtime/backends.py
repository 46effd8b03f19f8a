"""ORT session factory per backend.

    cpu      onnxruntime CPU EP on the bundle's float ``cpu`` graphs (default; the reference)
    qnn      onnxruntime-qnn HTP on a Snapdragon (the target's context binaries)   [Hexagon issue]
    qnn-sim  the same binaries on the x86 HTP simulator                          [Hexagon issue]

Before a session is made, every external-data location inside the ONNX file is checked to stay in
the bundle (an ONNX file can name any path as external data).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import BackendError, BundleError
from ..manifest import confine

BACKENDS = ("cpu",)


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


def make_session(bundle: Path, rel_file: str, backend: str):
    import onnxruntime as ort

    if backend not in BACKENDS:
        raise BackendError(f"backend {backend!r} is not available; choose from {', '.join(BACKENDS)}")
    path = confine(bundle, rel_file)
    check_external_data(bundle, path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = cpu_threads()
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        raise BundleError(f"graph {rel_file} cannot be loaded by onnxruntime: {e}") from None
