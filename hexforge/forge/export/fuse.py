"""Node fusions for the cpu target's onnxruntime graphs, applied to the exported ONNX.

onnxruntime's own optimizer leaves both patterns alone in our graphs, and at AR-1 a node costs
about as much as the arithmetic in it (a few us whatever its size: docs/notes/measurements.md),
so nodes count:

    Add(x, d) ─┬▶ SimplifiedLayerNormalization(γ)     SkipSimplifiedLayerNormalization(x, d, γ)
               └▶ other users of x + d           ⟶      ├▶ normed
                                                         └▶ x + d (output 3) ─▶ other users

    h ─┬▶ MatMulNBits(Wq)                              h ─▶ MatMulNBits([Wq | Wk | Wv]) ─▶ Split
       ├▶ MatMulNBits(Wk)                      ⟶                                       ├▶ q
       └▶ MatMulNBits(Wv)                                                              ├▶ k
                                                                                       └▶ v

The residual fusion (any graph) is the same arithmetic in one kernel; the packed MatMulNBits
(int8/int4 graphs) reads the same weights in one call. fp32 MatMuls are not packed: one larger
fp32 MatMul ran slower than three (docs/notes/measurements.md).
Both are pure rewiring, the values stay bit-identical (packing concatenates the quantized blocks
along N; each output column still sees its own blocks).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np

from .tensorshapes import static_shapes

MS = "com.microsoft"


def fuse_cpu_graph(model) -> dict[str, int]:
    """Both fusions on ``model`` (an onnx ModelProto, with its weights loaded: packing concatenates
    them), in place; -> how many of each were made."""
    return {"skip_norms": fuse_skip_norms(model), "packed_matmuls": pack_sibling_matmuls(model)}


def fuse_skip_norms(model) -> int:
    """Add + SimplifiedLayerNormalization -> SkipSimplifiedLayerNormalization where the Add sums
    two activations of one rank-3 shape (the residual stream). -> fusions made."""
    from onnx import helper

    g = model.graph
    inits = {t.name for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    pairs = []  # (add, norm): an Add of two activations feeding a norm's input
    for norm in g.node:
        if norm.op_type != "SimplifiedLayerNormalization" or norm.domain not in ("", "ai.onnx"):
            continue
        add = producer.get(norm.input[0])
        if add is not None and add.op_type == "Add" and len(norm.input) == 2 and \
                not set(add.input) & inits:
            pairs.append((add, norm))
    if not pairs:  # e.g. the int8/int4 re-share of graphs fused at export: no shape inference
        return 0
    shapes = static_shapes(model)
    fused: dict[int, object] = {}  # id(norm node) -> its replacement
    dead: set[int] = set()  # ids of the Adds taken in
    for add, norm in pairs:
        a, b = add.input
        s = shapes.get(a)
        if id(add) in dead or s is None or len(s) != 3 or shapes.get(b) != s:
            continue
        attrs = {x.name: helper.get_attribute_value(x) for x in norm.attribute}
        if attrs.get("axis", -1) not in (-1, 2) or s[-1] != shapes.get(norm.input[1], [None])[-1]:
            continue
        total = add.output[0]
        # the sum keeps its name: its other users (and a graph output of that name) are unchanged
        fused[id(norm)] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [a, b, norm.input[1]],
            [norm.output[0], "", "", total], name=f"{norm.name}_skip", domain=MS,
            epsilon=float(attrs.get("epsilon", 1e-5)))
        dead.add(id(add))
    if not fused:
        return 0
    _replace_nodes(g, [fused.get(id(n), n) for n in g.node if id(n) not in dead])
    _ensure_opset(model, MS)
    return len(fused)


def pack_sibling_matmuls(model, min_group: int = 3) -> int:
    """MatMulNBits nodes reading the same activation with the same K / bits / block / accuracy
    (q, k and v of an attention; Qwen3.5's four in-projections) -> one MatMulNBits over the
    concatenated weights + a Split. Groups smaller than ``min_group`` stay as they are: gate/up
    pairs, which genai leaves apart too: packed, they gained on an MLP chain alone but nothing past
    the noise in a decode token, which streams its weights from memory (docs/notes/measurements.md).
    -> nodes removed."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    groups: dict[tuple, list] = defaultdict(list)
    for n in g.node:
        if n.op_type != "MatMulNBits" or n.domain != MS or len(n.input) != 3:
            continue
        if n.input[1] not in inits or n.input[2] not in inits:
            continue
        attrs = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if set(attrs) - {"K", "N", "bits", "block_size", "accuracy_level"}:
            continue  # zero points, g_idx, bias: not ours
        key = (n.input[0], attrs["K"], attrs["bits"], attrs["block_size"],
               attrs.get("accuracy_level", 0))
        groups[key].append((n, attrs))
    replace: dict[int, list] = {}
    dead: set[int] = set()
    for (x, K, bits, block, acc), members in groups.items():
        if len(members) < min_group:
            continue
        # in an order set by the weights themselves, not by where the exporter put the nodes: a
        # shard's prefill and decode graphs then pack the same bytes, which share_weights stores
        # once (Qwen3.5's in-projections came out b, a in one graph and a, b in the other: 96 MB
        # of Qwen3.5-0.8B's int4 weight file held twice)
        ws = sorted(((numpy_helper.to_array(inits[n.input[1]]), n, a) for n, a in members),
                    key=lambda m: hashlib.sha1(m[0].tobytes()).digest())
        nodes = [n for _, n, _ in ws]
        sizes = [a["N"] for _, _, a in ws]
        base = nodes[0].name or nodes[0].output[0]
        w = np.concatenate([w for w, _, _ in ws], axis=0)
        del ws
        # scales [N * blocks] or [N, blocks]: either way N-major, so they stack along N too
        sc = np.concatenate([numpy_helper.to_array(inits[n.input[2]]) for n in nodes], axis=0)
        names = (f"{base}_packed_B", f"{base}_packed_scales", f"{base}_packed_split")
        g.initializer.extend([numpy_helper.from_array(w, names[0]),
                              numpy_helper.from_array(sc, names[1]),
                              numpy_helper.from_array(np.array(sizes, np.int64), names[2])])
        packed_out = f"{base}_packed_out"
        mm = helper.make_node("MatMulNBits", [x, names[0], names[1]], [packed_out],
                              name=f"{base}_packed", domain=MS, K=K, N=int(sum(sizes)),
                              bits=bits, block_size=block, accuracy_level=acc)
        split = helper.make_node("Split", [packed_out, names[2]], [n.output[0] for n in nodes],
                                 name=f"{base}_packed_split", axis=-1)
        replace[id(nodes[0])] = [mm, split]
        dead.update(id(n) for n in nodes[1:])
    if not replace:
        return 0
    out = []
    for n in g.node:
        if id(n) in replace:
            out += replace[id(n)]
        elif id(n) not in dead:
            out.append(n)
    _replace_nodes(g, out)
    drop_unused_initializers(g)
    return len(dead)


# ---- helpers -------------------------------------------------------------------------------------


def _replace_nodes(g, nodes) -> None:
    """``nodes`` as the graph's, in a topological order (stable: each node as early as its inputs
    allow, ties in the given order): a fused node stands where one of those it replaced stood,
    which may be before the producer of an input it took over, or after a user of an output."""
    import heapq

    produced = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps = [{produced[x] for x in n.input if x in produced and produced[x] != i}
            for i, n in enumerate(nodes)]
    users: dict[int, list[int]] = defaultdict(list)
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    waiting = [len(d) for d in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise ValueError("fused graph has a cycle")  # a bug in a fusion, never user input
    del g.node[:]
    g.node.extend(order)


def drop_unused_initializers(g) -> None:
    """Remove the initializers no node and no graph output reads (also forge/export/shapefold.py)."""
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    # in place: clearing the field and extending it with the kept ones copies every kept
    # weight (a real-size graph's inline GBs, beside the originals until the model is freed)
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name not in used:
            del g.initializer[i]


def _ensure_opset(model, domain: str, version: int = 1) -> None:
    if not any(o.domain == domain for o in model.opset_import):
        from onnx import helper

        model.opset_import.append(helper.make_opsetid(domain, version))
