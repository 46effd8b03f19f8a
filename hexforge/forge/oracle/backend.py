"""The cpu backend the oracle and calibration run a bundle's graphs on (forge/oracle/verify.py,
forge/compile/stage.py): the runtime's, with each weights file mapped once where the runtime would not
pack the weights.

Below both of its users, so neither imports the other for it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...bundle.manifest import GraphSpec
from ...runtime.backends import Backend, disable_prepacking


class OracleCpuBackend(Backend):
    """The cpu backend as the runtime configures it, except where the runtime keeps a target's
    prefill weights unpacked (fp32 weights too large to hold a second packed copy: Gemma-4-E2B's
    graphs are 9 GB on disk): there every weights file is mapped once and handed to each session
    reading it as shared initializers, unpacked, so prefill and decode of a shard hold one copy.
    Elsewhere it shares nothing: unpacked, MatMulNBits leaves its int8 kernels (an int8 SmolLM2
    decode step ~45x slower in the oracle; docs/notes/measurements.md, ``prepack_prefill``)."""

    def __init__(self, prepack: bool = True):
        """prepack=False: no session packs its weights, whatever their size (a few calls per
        graph, where a packed copy would be the graph's weights once more in memory)."""
        super().__init__("cpu")
        self.prepack = prepack
        self._maps: dict[Path, np.ndarray] = {}
        self._values: list = []  # the OrtValues must outlive the sessions

    def configure_cpu_session(self, so, path: Path, graph: GraphSpec, packed: bool) -> None:
        import onnx
        import onnxruntime as ort
        from onnx.external_data_helper import ExternalDataInfo

        if not self.prepack:
            disable_prepacking(so)
            packed = False
        if packed or graph.role not in ("prefill", "decode"):
            # only a shard's prefill + decode share a weights file; and an encoder graph's
            # overridden initializers (its baked rope tables) broke a broadcast in onnxruntime
            # (Qwen3-VL vision: "Mul ... 2 by 64"), which the plain session runs fine
            return

        model = onnx.load(str(path), load_external_data=False)
        shared = 0
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = ExternalDataInfo(t)
            f = (path.parent / info.location).resolve()
            if f not in self._maps:
                self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
            raw = self._maps[f][info.offset:info.offset + info.length]
            value = ort.OrtValue.ortvalue_from_numpy(raw.view(dtype).reshape(tuple(t.dims)))
            self._values.append(value)
            so.add_initializer(t.name, value)
            shared += 1
        if shared:
            disable_prepacking(so)
