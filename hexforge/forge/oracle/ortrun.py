"""One onnxruntime call on one graph file: the checks that compare graphs run through it.

A leaf of the forge (it imports only onnxruntime and the runtime's QNN helpers), so the HTP
checks (forge/compile/graphcheck.py, forge/compile/probe.py) share it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...runtime import qnn


def run_graph(path: Path, feeds: dict[str, np.ndarray], so=None) -> dict[str, np.ndarray]:
    """The graph at ``path`` on ``feeds`` (those it does not take are dropped); -> output name ->
    value. ``so``: session options naming an execution provider (the HTP's: QNN's native
    stdout goes to stderr); None: the CPU EP."""
    import onnxruntime as ort

    if so is None:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    else:
        with qnn.native_stdout_to_stderr():
            sess = ort.InferenceSession(str(path), so)
    want = {i.name for i in sess.get_inputs()}
    values = sess.run(None, {k: v for k, v in feeds.items() if k in want})
    return dict(zip([o.name for o in sess.get_outputs()], values, strict=True))
