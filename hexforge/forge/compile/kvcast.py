"""The KV cache of fp16-activation HTP graphs fed and returned as fp16, not fp32.

    before:  past.L0.k fp32 [1, KVH, C, D] ─────────────▶ attention ...   (DDR read: 4 B a value)
    after:   past.L0.k fp16 [1, KVH, C, D] ─Cast(fp32)─▶ attention ...   (2 B a value)
             ... new.L0.k ─Cast(fp16)─▶ new.L0.k fp16 (graph output)

Under ``enable_htp_fp16_precision`` the HTP computes every fp32 tensor as fp16 already: a cache
row that comes out of a graph has been fp16 on the way, so holding it as fp16 on the host loses
nothing the HTP kept. What changes is the bytes: the HTP reads the whole cache every step, and at
fp32 that was half of a SmolLM2 decode step's DDR traffic at context 1024 (Hextimate: docs/htp.md
"Speed on the NPU"). Fixed-point graphs (uint16 activations) keep their own I/O (qdq.py).

``--kv-values u8`` goes one step further for the values (``u8_values``): uint8 rows with a
scale each, computed in the graph — a quarter of fp32's bytes for half the cache.

The graphs are rewritten after the float export, before anything reads them (the oracle's
twins, the weight-only pass and the compile all see the fp16 I/O); the manifest's TensorSpecs
say float16, and the runtime's state takes its buffers' dtypes from them (runtime/state.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...bundle.manifest import GraphSpec, StateSpec

KV_KINDS = ("kv_full", "kv_sliding", "kv_shared")


def kv_binds(state: list[StateSpec]) -> set[str]:
    """The binds of every KV cache: its buffer before the step and rows made earlier in it."""
    names = {s.name for s in state if s.kind in KV_KINDS}
    return {f"{kind}:{n}" for n in names for kind in ("state", "new")}


def _retype_io(path: Path, g: GraphSpec, binds: set[str], elem: int, dtype: str,
               to_float, from_float) -> GraphSpec:
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


V8_ZERO = 128  # uint8 value rows: q = round(v / s) + 128, s = the row's peak |v| / 127
V8_STEPS = 127.0
V8_MIN_SCALE = 2.0 ** -14  # fp16's smallest normal: a row of zeros keeps a finite scale


def value_caches(state: list[StateSpec]) -> list[StateSpec]:
    """The KV caches that hold values (``L<i>.v``), shared ones included."""
    return [s for s in state if s.kind in KV_KINDS and s.name.endswith(".v")]


def row_scale_state(name: str) -> str:
    """The state holding the per-row scales of value cache ``name``: "L3.v" -> "L3.vs"."""
    return name + "s"


def u8_value_state(state: list[StateSpec]) -> list[StateSpec]:
    """``state`` with a row-scale cache beside each value cache: same kind, group and donor,
    one value a row ([KVH, C, 1]). The runtime writes and masks it as any KV cache (its rows
    are the value rows' positions), so nothing else needs to know it is a scale."""
    have = {s.name for s in state}
    extra = [s.model_copy(update={
        "name": row_scale_state(s.name), "shape": [*s.shape[:-1], 1] if s.shape else [],
        "source": row_scale_state(s.source) if s.source else None})
        for s in value_caches(state) if row_scale_state(s.name) not in have]
    return [*state, *extra]


def u8_values_graph(path: Path, g: GraphSpec) -> GraphSpec:
    """Rewrite ``path`` so its value-cache I/O is uint8 with an fp16 scale per row (per head and
    position), computed in the graph from the row itself:

        past.L0.v  uint8 [1, KVH, C, D] ─DequantizeLinear(1, 128)─┐
        past.L0.vs fp16  [1, KVH, C, 1] ─Cast───────────────────Mul─▶ attention ...
        ... v [1, KVH, T, D] ─▶ s = max(ReduceMax|v| / 127, 2^-14) ─▶ new.L0.vs fp16 [1, KVH, T, 1]
                             └─▶ QuantizeLinear(v / s, 1, 128) ─▶ new.L0.v uint8

    A value row's peak is its own scale, so no calibration and no clipping: values vary row to
    row by orders of magnitude (the first token's are the largest), which one scale a cache
    lost to (SmolLM2: KL 1.6e-3 against 4e-5 a row, docs/htp.md). Keys stay as they were: their
    outlier channels cost 8-bit keys 15-30x the KL of 8-bit values on the real models.
    -> ``g`` with the value I/O uint8 and the scale I/O added. Idempotent."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def is_value(bind: str) -> bool:  # a graph's cache rows out are bound "state:" or "new:"
        k, _, name = bind.partition(":")
        return k in ("state", "new") and name.endswith(".v")

    # float32 I/O only: run before fp16_kv, whose Casts would sit between these and the graph
    ins = [t for t in g.inputs if is_value(t.bind) and t.dtype == "float32"]
    outs = [t for t in g.outputs if is_value(t.bind) and t.dtype == "float32"]
    if not ins and not outs:
        return g
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    f32 = TensorProto.FLOAT
    one, zero, steps, floor = "v8_one", "v8_zero", "v8_steps", "v8_min_scale"
    graph.initializer.extend([
        numpy_helper.from_array(np.array(1.0, np.float32), one),
        numpy_helper.from_array(np.array(V8_ZERO, np.uint8), zero),
        numpy_helper.from_array(np.array(1.0 / V8_STEPS, np.float32), steps),
        numpy_helper.from_array(np.array(V8_MIN_SCALE, np.float32), floor),
        numpy_helper.from_array(np.array([-1], np.int64), "v8_last_axis")])
    first, last = [], []
    new_inputs, new_outputs = [], []
    for t in ins:  # consumers read the dequantized fp32 copy
        vi = next(v for v in graph.input if v.name == t.name)
        inner, s_in = f"{t.name}__fp32", f"{t.name}s"
        for node in graph.node:
            node.input[:] = [inner if x == t.name else x for x in node.input]
        first += [helper.make_node("DequantizeLinear", [t.name, one, zero], [f"{t.name}__int"],
                                   name=f"v8_dq_{t.name}"),
                  helper.make_node("Cast", [s_in], [f"{s_in}__fp32"], to=f32,
                                   name=f"v8_cast_{s_in}"),
                  helper.make_node("Mul", [f"{t.name}__int", f"{s_in}__fp32"], [inner],
                                   name=f"v8_mul_{t.name}")]
        vi.type.tensor_type.elem_type = TensorProto.UINT8
        new_inputs.append(helper.make_tensor_value_info(s_in, TensorProto.FLOAT16,
                                                        [*t.shape[:-1], 1]))
    for t in outs:  # the producer writes fp32 rows; the outputs are their uint8 form + scales
        vo = next(v for v in graph.output if v.name == t.name)
        inner, s_out = f"{t.name}__fp32", f"{t.name}s"
        for node in graph.node:
            node.output[:] = [inner if x == t.name else x for x in node.output]
            node.input[:] = [inner if x == t.name else x for x in node.input]
        n = t.name
        last += [helper.make_node("Abs", [inner], [f"{n}__abs"], name=f"v8_abs_{n}"),
                 helper.make_node("ReduceMax", [f"{n}__abs", "v8_last_axis"], [f"{n}__peak"],
                                  keepdims=1, name=f"v8_peak_{n}"),
                 helper.make_node("Mul", [f"{n}__peak", steps], [f"{n}__raw_scale"],
                                  name=f"v8_step_{n}"),
                 helper.make_node("Max", [f"{n}__raw_scale", floor], [f"{n}__scale"],
                                  name=f"v8_floor_{n}"),
                 helper.make_node("Div", [inner, f"{n}__scale"], [f"{n}__steps"],
                                  name=f"v8_div_{n}"),
                 helper.make_node("QuantizeLinear", [f"{n}__steps", one, zero], [n],
                                  name=f"v8_q_{n}"),
                 helper.make_node("Cast", [f"{n}__scale"], [s_out], to=TensorProto.FLOAT16,
                                  name=f"v8_cast_{s_out}")]
        vo.type.tensor_type.elem_type = TensorProto.UINT8
        new_outputs.append(helper.make_tensor_value_info(s_out, TensorProto.FLOAT16,
                                                         [*t.shape[:-1], 1]))
    graph.input.extend(new_inputs)
    graph.output.extend(new_outputs)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(first + nodes + last)  # the input conversions first: topological order
    if not any(o.domain in ("", "ai.onnx") and o.version >= 18 for o in model.opset_import):
        raise ValueError(f"{path.name}: ReduceMax with axes as an input needs opset 18+")
    onnx.save(model, str(path))

    def scale_spec(t):
        kind, _, name = t.bind.partition(":")
        return t.model_copy(update={"name": f"{t.name}s", "bind": f"{kind}:{row_scale_state(name)}",
                                    "shape": [*t.shape[:-1], 1], "dtype": "float16",
                                    "keys_transposed": False})

    def u8(t):
        return t.model_copy(update={"dtype": "uint8"}) if t in ins or t in outs else t

    return g.model_copy(update={
        "inputs": [u8(t) for t in g.inputs] + [scale_spec(t) for t in ins],
        "outputs": [u8(t) for t in g.outputs] + [scale_spec(t) for t in outs]})


def fp16_kv(root: Path, graphs: list[GraphSpec], state: list[StateSpec]) -> list[GraphSpec]:
    """Every decoder graph's KV I/O as float16 (``fp16_kv_graph``), in place under ``root``."""
    binds = kv_binds(state)
    return [fp16_kv_graph(root / g.file, g, binds) if g.role in ("prefill", "decode", "verify")
            else g for g in graphs]


def u8_values(root: Path, graphs: list[GraphSpec]) -> list[GraphSpec]:
    """Every decoder graph's value-cache I/O as uint8 rows with a scale each
    (``u8_values_graph``), in place under ``root``; the manifest's state then needs
    ``u8_value_state``."""
    return [u8_values_graph(root / g.file, g) if g.role in ("prefill", "decode", "verify")
            else g for g in graphs]
