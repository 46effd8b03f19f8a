"""The CPU EP's weight-only GEMM kernels at a decoder's shapes, interleaved: how fast each is at a
decode row (M = 1) and a prefill chunk (M = 64 ... 256), and how far its product is from fp32.

    python bench/experiments/cpu_kernels.py [--shapes 1024x3072,3072x1024] [--rows 1,64,128,256] [--rounds 7]

Contenders (one MatMul [M, K] x [K, N] each, in its own session, threads as the backend sets them):
    fp32         MatMul
    int8-bB      MatMulNBits 8-bit, blocks of B along K, accuracy_level 4 (hexforge's
    int4-bB      --cpu-weights; made by the build's own quantize_cpu_graph)
    dqmm-int8    DynamicQuantizeMatMul: int8 weights per output channel, the activations quantized
                 to uint8 per TENSOR at run time (onnxruntime's quantize_dynamic; MLAS's QGEMM)
The error is the product's ||y - y_fp32|| / ||y_fp32|| on two activations: Gaussian, and the
same with one input channel x 100 (the outlier channels real LLM activations have; random weights
do not make them, so the build's oracle never sees them). A per-tensor activation scale spreads one
outlier over every row of the chunk; MatMulNBits' per-block scale keeps it in its block.

Speed does not depend on the values. Reported: median GOPS (2 M K N / s) with min-max over the
rounds, and each contender's median ratio to int8-b128 (the default int8 format) in the same round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

CONTENDERS = ("fp32", "int8-b128", "int8-b256", "int8-b32", "int4-b128", "dqmm-int8")


def matmul_model(w: np.ndarray, contender: str, work: Path):
    """An onnx model of y = x @ w as ``contender`` computes it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from hexforge.forge.quantize.nbits import quantize_cpu_graph

    K, N = w.shape
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])
    if contender == "dqmm-int8":
        scale = np.abs(w).max(0) / 127  # [N]: per output channel, symmetric
        wq = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
        node = helper.make_node("DynamicQuantizeMatMul", ["x", "wq", "scale"], ["y"],
                                domain="com.microsoft")
        inits = [numpy_helper.from_array(wq, "wq"),
                 numpy_helper.from_array(scale.astype(np.float32), "scale")]
    else:
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        inits = [numpy_helper.from_array(w, "w")]
    graph = helper.make_graph([node], "gemm", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    path = work / f"{contender}-{K}x{N}.onnx"
    onnx.save(model, str(path))
    if contender.startswith(("int8-b", "int4-b")):
        bits, block = int(contender[3]), int(contender.split("-b")[1])
        assert quantize_cpu_graph(path, bits, block) == 1
    return path


def session(path: Path):
    import onnxruntime as ort

    from hexforge.runtime.backends import configure_threads

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    configure_threads(so)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def relative_error(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def product_errors(sess, w: np.ndarray, x: np.ndarray) -> dict[str, float]:
    """The session's x @ w vs fp32 on activations x [M, K] ("gaussian") and on the same with
    input channel 7 x 100 ("outlier_channel")."""
    outlier = x.copy()
    outlier[:, 7] *= 100
    return {name: relative_error(sess.run(None, {"x": v})[0], v @ w)
            for name, v in (("gaussian", x), ("outlier_channel", outlier))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1024x3072,3072x1024", help="KxN,... (Qwen3-0.6B's MLP)")
    ap.add_argument("--rows", default="1,64,128,256", help="M values: 1 = decode, N = AR-N chunk")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    a = ap.parse_args()
    contenders = a.contenders.split(",")
    rng = np.random.default_rng(0)
    report = []
    with tempfile.TemporaryDirectory(prefix="hexforge-kernels-") as tmp:
        for shape in a.shapes.split(","):
            K, N = (int(v) for v in shape.split("x"))
            w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
            sess = {c: session(matmul_model(w, c, Path(tmp))) for c in contenders}
            x = rng.standard_normal((64, K)).astype(np.float32)
            errors = {c: product_errors(s, w, x) for c, s in sess.items()}
            for M in (int(v) for v in a.rows.split(",")):
                xm = rng.standard_normal((M, K)).astype(np.float32)
                reps = 200 if M == 1 else 10
                secs: dict[str, list[float]] = {c: [] for c in contenders}
                for s in sess.values():
                    s.run(None, {"x": xm})
                for _ in range(a.rounds):
                    for c, s in sess.items():
                        t = time.perf_counter()
                        for _ in range(reps):
                            s.run(None, {"x": xm})
                        secs[c].append((time.perf_counter() - t) / reps)
                gops = {c: [2 * M * K * N / v / 1e9 for v in t] for c, t in secs.items()}
                base = secs.get("int8-b128")
                row = {"K": K, "N": N, "M": M, "gops": {
                    c: {"median": round(statistics.median(g), 1), "min": round(min(g), 1),
                        "max": round(max(g), 1),
                        **({"vs_int8_b128": round(statistics.median(
                            b / t for b, t in zip(base, secs[c], strict=True)), 3)}
                           if base else {}),
                        "error": {k: float(f"{e:.2g}") for k, e in errors[c].items()}}
                    for c, g in gops.items()}}
                report.append(row)
                print(f"K={K} N={N} M={M}: " + "  ".join(
                    f"{c} {v['median']:.0f}" for c, v in row["gops"].items()) + " GOPS", flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
