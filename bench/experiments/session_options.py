"""CPU EP session options A/B on one graph (e.g. a real-shape decode graph), interleaved runs.

    python bench/experiments/session_options.py GRAPH.onnx [--runs 15]

Variants: the backend's defaults (ORT_ENABLE_ALL, intra-op threads = cores, spinning on), spinning
off, prepacking off, 1 thread. Feeds are random (speed does not depend on values).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("graph")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--variants", default="default,no_spin,no_prepack,one_thread")
    a = ap.parse_args()

    import onnxruntime as ort

    from hexforge.runtime.backends import cpu_threads

    def make(variant: str):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = 1 if variant == "one_thread" else cpu_threads()
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        if variant == "no_spin":
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if variant == "no_prepack":
            so.add_session_config_entry("session.disable_prepacking", "1")
        return ort.InferenceSession(a.graph, so, providers=["CPUExecutionProvider"])

    sess = {v: make(v) for v in a.variants.split(",")}
    rng = np.random.default_rng(0)
    first = next(iter(sess.values()))
    feeds = {}
    for i in first.get_inputs():
        dt = np.float32 if "float" in i.type else np.int64
        feeds[i.name] = (rng.standard_normal(i.shape) * 0.5).astype(dt)
    for s in sess.values():
        s.run(None, feeds)
    times: dict[str, list[float]] = {v: [] for v in sess}
    for _ in range(a.runs):
        for v, s in sess.items():
            t = time.perf_counter()
            s.run(None, feeds)
            times[v].append(1e3 * (time.perf_counter() - t))
    base = statistics.median(times["default"]) if "default" in times else None
    print(json.dumps({"graph": a.graph, "runs": a.runs, "ms": {
        v: {"median": round(statistics.median(t), 1), "min": round(min(t), 1),
            "max": round(max(t), 1),
            **({"speedup_vs_default": round(base / statistics.median(t), 3)} if base else {})}
        for v, t in times.items()}}, indent=1))


if __name__ == "__main__":
    main()
