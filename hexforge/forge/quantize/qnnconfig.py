"""ORT's QNN QDQ configuration, one for both of its readers: the calibration (which tensors get
ranges, calibstats.py) and the QDQ pass (which tensors get Q/DQ pairs, qdq.py) must select the same
tensors, or the pass would look up ranges the calibration never recorded.
"""

from __future__ import annotations

from pathlib import Path


def qnn_qdq_config(float_path: Path, reader, overrides: dict):
    """ORT's QNN QDQ config for ``float_path``: uint16 activations, MinMax ranges, ``overrides``
    (tensor -> fixed quantization params); external data past protobuf's 2 GB limit."""
    from onnxruntime.quantization import CalibrationMethod, QuantType
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    cfg = get_qnn_qdq_config(
        str(float_path), reader, calibrate_method=CalibrationMethod.MinMax,
        activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8, per_channel=False,
        init_overrides=overrides,
    )
    cfg.use_external_data_format = graph_bytes(float_path) > 1 << 30  # protobuf's 2 GB limit
    return cfg


def graph_bytes(path: Path) -> int:
    """The graph file plus the external weight files it references."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    model = onnx.load(str(path), load_external_data=False)
    files = {ExternalDataInfo(t).location for t in model.graph.initializer
             if t.data_location == onnx.TensorProto.EXTERNAL}
    return path.stat().st_size + sum((path.parent / f).stat().st_size for f in files)
