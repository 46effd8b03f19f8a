"""Fold the shape arithmetic a torchscript export leaves when torch's shape inference is off.

torch's ONNX shape inference runs with the module's parameters attached to the graph: at real
size it is half of an export's time, mostly copying weights (docs/notes/realsize.md). Without it the
symbolic functions do not know the static shapes and emit them as ops:

    x ──Shape──Gather──Unsqueeze──Concat──> Reshape(x, ·)        (per reshape, per layer)

Every shape in these graphs is static, so each such chain is a constant. This pass finds them
on the graph alone (no weight is read): forge/export/tensorshapes.py gives every tensor's shape, contrib
ops included (onnx's own shape inference stops at the first com.microsoft op), a Shape
of a known shape becomes a constant, and a node whose inputs are all small constants is
evaluated by onnx's reference evaluator. Repeated until nothing folds; then what nothing reads
is dropped. Folded the same way, the export with torch's shape inference and this one are the
same graph node for node (tests/test_shapefold.py holds each family's graphs to that).
"""

from __future__ import annotations

import numpy as np

from .tensorshapes import static_shapes

MAX_ELEMENTS = 4096  # folded values are shape arithmetic, never weights or masks


def fold_shapes(model) -> int:
    """Fold ``model`` (an onnx ModelProto, external data not loaded) in place; -> nodes folded."""
    # a tensor's shape does not change when its producer folds to a constant: inferred once
    shapes = static_shapes(model, complete=False)
    total = 0
    while n := _fold_once(model, shapes):
        total += n
    _drop_unread(model)
    return total + _clip_scalar_bounds(model)


def _fold_once(model, shapes: dict[str, list[int]]) -> int:
    import onnx
    from onnx import helper, numpy_helper

    g = model.graph
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    values: dict[str, np.ndarray] = {}
    for t in g.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(t.dims)) <= MAX_ELEMENTS:
            values[t.name] = numpy_helper.to_array(t)
    kept, folded, n = [], [], 0
    for node in g.node:
        out = None
        if node.domain not in ("", "ai.onnx"):
            pass
        elif node.op_type == "Constant":
            v = np.asarray(_evaluate(node, opset, {})[0])
            if v.size <= MAX_ELEMENTS:
                values[node.output[0]] = v
        elif node.op_type == "Shape" and node.input[0] in shapes:
            a = {at.name: helper.get_attribute_value(at) for at in node.attribute}
            s = np.array(shapes[node.input[0]], dtype=np.int64)
            out = [s[a.get("start", 0):a.get("end", len(s))]]
        elif node.input and all(
                i == "" or i in values for i in node.input):
            out = [np.asarray(v) for v in _evaluate(
                node, opset, {i: values[i] for i in node.input if i})]
            if any(v.size > MAX_ELEMENTS for v in out):
                out = None
        if out is None:
            kept.append(node)
            continue
        n += 1
        for name, v in zip(node.output, out, strict=True):
            values[name] = v
            folded.append(numpy_helper.from_array(v, name))
    if n:
        del g.node[:]
        g.node.extend(kept)
        g.initializer.extend(folded)
    return n


def _clip_scalar_bounds(model) -> int:
    """Max(x, c) / Min(x, c) with c a one-value constant -> Clip(x, c, ) / Clip(x, , c).

    torch's clamp_min / clamp_max symbolics emit Clip when they know the bound is rank 0 and
    Max / Min when they do not, which is always without shape inference (the bound is a Cast
    of unknown rank). Once folded, the bound is a rank-0 constant: this is the op torch would
    have chosen. -> nodes rewritten."""
    from onnx import helper

    g = model.graph
    scalars = {t.name for t in g.initializer if len(t.dims) == 0} | {
        n.output[0] for n in g.node if n.op_type == "Constant" and any(
            a.name == "value" and len(a.t.dims) == 0 for a in n.attribute)}
    n = 0
    for i, node in enumerate(g.node):
        if (node.op_type in ("Max", "Min") and node.domain in ("", "ai.onnx")
                and len(node.input) == 2 and node.input[1] in scalars
                and node.input[0] not in scalars):
            x, c = node.input
            bounds = [c, ""] if node.op_type == "Max" else ["", c]
            g.node[i].CopyFrom(helper.make_node(
                "Clip", [x, *bounds], list(node.output), name=node.name))
            n += 1
    return n


def _evaluate(node, opset: int, feeds: dict) -> list:
    """``node``'s outputs by onnx's reference evaluator, given a copy of the node: an evaluator
    is a reference cycle (freed by the cyclic gc only), and a node of the graph keeps the whole
    model's protobuf memory alive (a real-size build held each export's GBs after it)."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    own = onnx.NodeProto.FromString(node.SerializeToString())
    return ReferenceEvaluator(own, opsets={"": opset}).run(None, feeds)


def _drop_unread(model) -> None:
    from .fuse import drop_unused_initializers

    g = model.graph
    outputs = {o.name for o in g.output}
    nodes = list(g.node)
    while True:
        read = {i for n in nodes for i in n.input} | outputs
        alive = [n for n in nodes if any(o in read for o in n.output)]
        if len(alive) == len(nodes):
            break
        nodes = alive
    if len(nodes) != len(g.node):
        del g.node[:]
        g.node.extend(nodes)
    drop_unused_initializers(g)
