"""What a position-ordered attention would add to a Genie step, by Hextimate, SA8797 (v81): per
layer, the past keys [kv_dim, CL] and values [CL, kv_dim] permuted by one one-hot [CL, CL] (built
from a rank vector: the attended slots first, in position order), so that the sums of attention
meet the same values at the same slots whatever slots a dialog wrote them to.

    python bench/attention_perm_cost.py --layers 30 --kv-dim 192 --context 1024   # SmolLM2

A graph of just those ops, compiled for v81 and costed (its Equal / Cast / Transpose may go
uncosted: the figure is a lower bound). Results: docs/genie.md, "What bit-equal tokens at ties
would cost".
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def permutation_graph(layers: int, kv_dim: int, context: int) -> onnx.ModelProto:
    """rank [CL, 1] -> P = one-hot(rank) [CL, CL]; per layer k @ P and P^T @ v."""
    f16 = TensorProto.FLOAT16
    slots = numpy_helper.from_array(np.arange(context, dtype=np.float16)[None], "slots")
    nodes = [helper.make_node("Equal", ["rank", "slots"], ["hit"]),
             helper.make_node("Cast", ["hit"], ["P"], to=f16),
             helper.make_node("Transpose", ["P"], ["PT"], perm=[1, 0])]
    inputs = [helper.make_tensor_value_info("rank", f16, [context, 1])]
    outputs = []
    for i in range(layers):
        inputs += [helper.make_tensor_value_info(f"k{i}", f16, [kv_dim, context]),
                   helper.make_tensor_value_info(f"v{i}", f16, [context, kv_dim])]
        nodes += [helper.make_node("MatMul", [f"k{i}", "P"], [f"ko{i}"]),
                  helper.make_node("MatMul", ["PT", f"v{i}"], [f"vo{i}"])]
        outputs += [helper.make_tensor_value_info(f"ko{i}", f16, [kv_dim, context]),
                    helper.make_tensor_value_info(f"vo{i}", f16, [context, kv_dim])]
    graph = helper.make_graph(nodes, "attention_perm", inputs, outputs, initializer=[slots])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--kv-dim", type=int, required=True, help="KV heads x head dim")
    ap.add_argument("--context", type=int, required=True)
    a = ap.parse_args()

    from hexforge.bundle.targets import get_target
    from hexforge.forge.compile.hextimate import estimate_graph

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "attention_perm.onnx"
        onnx.save(permutation_graph(a.layers, a.kv_dim, a.context), path)
        est = estimate_graph(path, 81, get_target("v81").estimator, fp16=True)
    print(f"{a.layers} layers, kv dim {a.kv_dim}, CL {a.context}: {est.us:,.0f} us "
          f"(Hextimate, SA8797 (v81)); uncosted ops {est.missing_ops}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
