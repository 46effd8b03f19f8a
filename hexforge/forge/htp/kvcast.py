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


def _retype_io(path: Path, g: GraphSpec, binds: set[str], elem: int, dtype: str,
               to_float, from_float, inits=()) -> GraphSpec:
    """Rewrite ``path`` (its external weights untouched) so the float32 KV inputs / outputs of
    ``g`` (TensorSpec bind in ``binds``) are ``elem`` (``dtype``); ``to_float(input, inner,
    bind)`` / ``from_float(inner, output, bind)`` make the node between the new I/O and the
    float32 tensor the graph computes with. -> ``g`` with those TensorSpecs retyped.
    Idempotent: I/O that is not float32 is left alone."""
    import onnx

    ins = {t.name: t.bind for t in g.inputs if t.bind in binds and t.dtype == "float32"}
    outs = {t.name: t.bind for t in g.outputs if t.bind in binds and t.dtype == "float32"}
    if not ins and not outs:
        return g
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    first, last = [], []
    for vi in graph.input:
        if vi.name in ins:  # consumers read the fp32 copy; the graph input changes type
            inner = f"{vi.name}__fp32"
            for node in graph.node:
                node.input[:] = [inner if x == vi.name else x for x in node.input]
            first.append(to_float(vi.name, inner, ins[vi.name]))
            vi.type.tensor_type.elem_type = elem
    for vo in graph.output:
        if vo.name in outs:  # the producer writes an fp32 tensor; the output is its conversion
            inner = f"{vo.name}__fp32"
            for node in graph.node:
                node.output[:] = [inner if x == vo.name else x for x in node.output]
                node.input[:] = [inner if x == vo.name else x for x in node.input]
            last.append(from_float(inner, vo.name, outs[vo.name]))
            vo.type.tensor_type.elem_type = elem
    graph.initializer.extend(inits)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(first + nodes + last)  # the input conversions first: topological order
    onnx.save(model, str(path))

    def retype(t):
        return t.model_copy(update={"dtype": dtype}) if t.name in ins.keys() | outs.keys() else t

    return g.model_copy(update={"inputs": [retype(t) for t in g.inputs],
                                "outputs": [retype(t) for t in g.outputs]})


def fp16_kv_graph(path: Path, g: GraphSpec, binds: set[str]) -> GraphSpec:
    """Rewrite ``path`` so the KV inputs and outputs of ``g`` are float16 (a Cast each side);
    -> ``g`` with those TensorSpecs float16. Idempotent: fp16 I/O is left alone."""
    from onnx import TensorProto, helper

    def to_float(src, dst, _bind):
        return helper.make_node("Cast", [src], [dst], to=TensorProto.FLOAT, name=f"kv_in_cast_{src}")

    def from_float(src, dst, _bind):
        return helper.make_node("Cast", [src], [dst], to=TensorProto.FLOAT16,
                                name=f"kv_out_cast_{dst}")

    return _retype_io(path, g, binds, TensorProto.FLOAT16, "float16", to_float, from_float)


def kv_scale_name(bind: str) -> str:
    """The graph initializer holding the uint8 scale of the cache ``bind`` names (its state)."""
    return "kv_u8_scale." + bind.partition(":")[2]


def u8_kv_graph(path: Path, g: GraphSpec, binds: set[str], absmax: dict[str, float]) -> GraphSpec:
    """Rewrite ``path`` so the KV inputs and outputs of ``g`` are uint8, one symmetric scale per
    cache (``absmax``: state name -> its calibrated peak |x|; zero point 128):

        past.L0.k uint8 ─DequantizeLinear(s, 128)─▶ attention ...      (1 B a value)
        ... new.L0.k ─QuantizeLinear(s, 128)─▶ new.L0.k uint8

    A state's prefill, decode and verify graphs get the same scale (it names the buffer's
    format). -> ``g`` with those TensorSpecs uint8."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    states = {t.bind.partition(":")[2] for t in [*g.inputs, *g.outputs] if t.bind in binds}
    inits = [numpy_helper.from_array(np.array(kv_u8_scale(absmax[s]), np.float32),
                                     kv_scale_name("state:" + s)) for s in sorted(states)]
    inits.append(numpy_helper.from_array(np.array(KV_U8_ZERO, np.uint8), "kv_u8_zero"))

    def to_float(src, dst, bind):
        return helper.make_node("DequantizeLinear", [src, kv_scale_name(bind), "kv_u8_zero"], [dst],
                                name=f"kv_in_dq_{src}")

    def from_float(src, dst, bind):
        return helper.make_node("QuantizeLinear", [src, kv_scale_name(bind), "kv_u8_zero"], [dst],
                                name=f"kv_out_q_{dst}")

    return _retype_io(path, g, binds, TensorProto.UINT8, "uint8", to_float, from_float, inits)


KV_U8_ZERO = 128
KV_U8_MARGIN = 1.25  # unseen text exceeds the calibration text's peak; past it a value clips


def kv_u8_scale(absmax: float) -> float:
    """uint8 step of a cache whose calibrated peak is ``absmax``: [-127, 127] steps cover
    absmax x KV_U8_MARGIN."""
    return max(absmax, 1e-3) * KV_U8_MARGIN / 127.0


def fp16_kv(root: Path, graphs: list[GraphSpec], state: list[StateSpec]) -> list[GraphSpec]:
    """Every decoder graph's KV I/O as float16 (``fp16_kv_graph``), in place under ``root``."""
    binds = kv_binds(state)
    return [fp16_kv_graph(root / g.file, g, binds) if g.role in ("prefill", "decode", "verify")
            else g for g in graphs]


def u8_kv(root: Path, graphs: list[GraphSpec], state: list[StateSpec], absmax: dict[str, float]
          ) -> list[GraphSpec]:
    """Every decoder graph's KV I/O as uint8 (``u8_kv_graph``), in place under ``root``;
    ``absmax``: state name -> calibrated peak |x| (a KV-shared state reads its donor's buffer,
    so it takes its donor's scale: ``kv_source``)."""
    binds = kv_binds(state)
    peaks = {s.name: absmax[kv_source(state, s.name)] for s in state if s.kind in KV_KINDS}
    return [u8_kv_graph(root / g.file, g, binds, peaks) if g.role in ("prefill", "decode", "verify")
            else g for g in graphs]


def kv_source(state: list[StateSpec], name: str) -> str:
    """The state whose buffer ``name`` reads (itself, or a KV-shared state's donor)."""
    specs = {s.name: s for s in state}
    while specs[name].kind == "kv_shared":
        src = specs[name].source
        assert src is not None, name  # the manifest refuses a kv_shared state without one
        name = src
    return name
