"""What a MatMulNBits weight costs in a QNN context binary: one [1, 1, K] x [K, N] MatMulNBits
(symmetric, int8 / int4, blocks of 32 / 128, fp16 or fp32 activations) compiled for v81 with
CPU fallback disabled; prints the binary's bytes per weight. The planner's and the roofline's
`bytes_per_weight` (forge/quantize/recipes.py) should match it.

    python bench/experiments/nbits_binary.py [--k 2560] [--n 9216] [--work W]

Results: docs/htp.md ("Ops").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def matmul(k: int, n: int, elem: int):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    w = (np.random.default_rng(0).standard_normal((k, n)) * 0.02).astype(
        onnx.helper.tensor_dtype_to_np_dtype(elem))
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", elem, [1, 1, k])],
        [helper.make_tensor_value_info("y", elem, [1, 1, n])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=2560)
    ap.add_argument("--n", type=int, default=9216)
    ap.add_argument("--work", default=None)
    a = ap.parse_args()

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from hexforge.bundle.targets import get_target
    from hexforge.forge.compile.contexts import compile_graph

    v81 = get_target("v81")
    work = Path(a.work or tempfile.mkdtemp(prefix="nbits-"))
    work.mkdir(parents=True, exist_ok=True)
    print("activations bits block  binary bytes  bytes/weight")
    for act, elem in (("fp32", onnx.TensorProto.FLOAT), ("fp16", onnx.TensorProto.FLOAT16)):
        for bits in (8, 4):
            for block in (32, 128):
                # a fresh model each time: the quantizer rewrites the one it is given in place
                q = MatMulNBitsQuantizer(matmul(a.k, a.n, elem), block_size=block,
                                         is_symmetric=True, bits=bits)
                q.process()
                src = work / f"{act}-int{bits}-b{block}.onnx"
                onnx.save(q.model.model, src)
                r = compile_graph(src, src.with_suffix(".ctx.onnx"), v81.htp_arch, v81.socs[0].soc_model,
                                  fp16=True)
                print(f"{act:>11} {bits:>4} {block:>5} {r['bin_bytes']:>13,} "
                      f"{r['bin_bytes'] / (a.k * a.n):>13.4f}", flush=True)


if __name__ == "__main__":
    main()
