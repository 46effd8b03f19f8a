"""The KV cache of fp16-activation HTP graphs fed and returned as fp16, not fp32.

    before:  past.L0.k fp32 [1, KVH, C, D] ─────────────▶ attention ...   (DDR read: 4 B a value)
    after:   past.L0.k fp16 [1, KVH, C, D] ─Cast(fp32)─▶ attention ...   (2 B a value)
             ... new.L0.k ─Cast(fp16)─▶ new.L0.k fp16 (graph output)

Under ``enable_htp_fp16_precision`` the HTP computes every fp32 tensor as fp16 already: a cache
row that comes out of a graph has been fp16 on the way, so holding it as fp16 on the host loses
nothing the HTP kept. What changes is the bytes: the HTP reads the whole cache every step, and at
fp32 that was half of a SmolLM2 decode step's DDR traffic at context 1024 (Hextimate: docs/htp.md
"Speed on the NPU"). Fixed-point graphs (uint16 activations) keep their own I/O (qdq.py).

The graphs are rewritten after the float export, before anything reads them (the oracle's
twins, the weight-only pass and the compile all see the fp16 I/O); the manifest's TensorSpecs
say float16, and the runtime's state takes its buffers' dtypes from them (runtime/state.py).
"""

from __future__ import annotations

from pathlib import Path

from ...manifest import GraphSpec, StateSpec

KV_KINDS = ("kv_full", "kv_sliding", "kv_shared")


def kv_binds(state: list[StateSpec]) -> set[str]:
    """The binds of every KV cache: its buffer before the step and rows made earlier in it."""
    names = {s.name for s in state if s.kind in KV_KINDS}
    return {f"{kind}:{n}" for n in names for kind in ("state", "new")}


def fp16_kv_graph(path: Path, g: GraphSpec, binds: set[str]) -> GraphSpec:
    """Rewrite ``path`` (its external weights untouched) so the KV inputs and outputs of ``g``
    are float16; -> ``g`` with those TensorSpecs float16. Idempotent: fp16 I/O is left alone."""
    import onnx
    from onnx import TensorProto, helper

    ins = {t.name for t in g.inputs if t.bind in binds and t.dtype == "float32"}
    outs = {t.name for t in g.outputs if t.bind in binds and t.dtype == "float32"}
    if not ins and not outs:
        return g
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    casts = []
    for vi in graph.input:
        if vi.name in ins:  # consumers read the fp32 copy; the graph input becomes fp16
            inner = f"{vi.name}__fp32"
            for node in graph.node:
                node.input[:] = [inner if x == vi.name else x for x in node.input]
            casts.append(helper.make_node("Cast", [vi.name], [inner], to=TensorProto.FLOAT,
                                          name=f"kv_in_cast_{vi.name}"))
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    for vo in graph.output:
        if vo.name in outs:  # the producer writes an fp32 tensor; the output is its fp16 cast
            inner = f"{vo.name}__fp32"
            for node in graph.node:
                node.output[:] = [inner if x == vo.name else x for x in node.output]
                node.input[:] = [inner if x == vo.name else x for x in node.input]
            casts.append(helper.make_node("Cast", [inner], [vo.name], to=TensorProto.FLOAT16,
                                          name=f"kv_out_cast_{vo.name}"))
            vo.type.tensor_type.elem_type = TensorProto.FLOAT16
    graph.node.extend(casts)  # appended: the input casts must come first in topological order
    nodes = list(graph.node)
    first = [n for n in nodes if n.name.startswith("kv_in_cast_")]
    del graph.node[:]
    graph.node.extend(first + [n for n in nodes if not n.name.startswith("kv_in_cast_")])
    onnx.save(model, str(path))

    def cast(t):
        return t.model_copy(update={"dtype": "float16"}) if t.name in ins | outs else t

    return g.model_copy(update={"inputs": [cast(t) for t in g.inputs],
                                "outputs": [cast(t) for t in g.outputs]})


def fp16_kv(root: Path, graphs: list[GraphSpec], state: list[StateSpec]) -> list[GraphSpec]:
    """Every decoder graph's KV I/O as float16 (``fp16_kv_graph``), in place under ``root``."""
    binds = kv_binds(state)
    return [fp16_kv_graph(root / g.file, g, binds) if g.role in ("prefill", "decode", "verify")
            else g for g in graphs]
