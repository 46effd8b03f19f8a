"""Static shapes of every tensor in an exported graph, without reading a weight.

onnxruntime's symbolic shape inference (it knows the com.microsoft ops, onnx's own stops at the
first of them), plus the contrib ops ``families/ortops.py`` emits that it does not know, run on
the graph's outline: every initializer of 4 KB or more, or stored outside, enters as a typed
graph input, so no weight bytes are copied (the inference copies the model it is given and reads initializers'
data, external files included). Used by the cpu graphs' fusions (forge/export/fuse.py) and the shape
fold after an export (forge/export/shapefold.py).
"""

from __future__ import annotations

import numpy as np

SMALL_BYTES = 4096  # initializers under this stay in the outline: shape constants and the like


def static_shapes(model, complete: bool = True) -> dict[str, list[int]]:
    """{tensor: shape} for every tensor whose shape is static, initializers included.
    complete: raise unless every tensor got one (a bug in an export, never user input)."""
    inference = _shape_inference_class()(2**31 - 1, True, False, 0)  # int_max, auto_merge
    inference._preprocess(_outline(model))
    done = False
    while inference.run_:
        done = inference._infer_impl()
    if complete and not done:
        raise ValueError(f"{model.graph.name}: incomplete shape inference")
    inference._update_output_from_vi()
    inferred = inference.out_mp_
    out = {}
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        tt = v.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            out[v.name] = [d.dim_value for d in tt.shape.dim]
    # its dispatch tables of bound methods make the instance a reference cycle, which only the
    # cyclic gc frees: cleared, its models go now (the fold's evaluators were such cycles and
    # held a real-size graph's GBs per export: shapefold._evaluate)
    del inferred
    inference.__dict__.clear()
    for t in model.graph.initializer:
        out[t.name] = list(t.dims)
    return out


def nbytes(t) -> int:
    """An initializer's size from its dims and type (its data may be stored outside)."""
    from onnx import helper

    n = int(np.prod(t.dims)) if len(t.dims) else 1
    return n * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def _outline(model):
    import onnx
    from onnx import helper

    g = model.graph
    inline = [t for t in g.initializer
              if nbytes(t) < SMALL_BYTES and t.data_location != onnx.TensorProto.EXTERNAL]
    names = {t.name for t in inline}
    big = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
           for t in g.initializer if t.name not in names]
    outline = helper.make_graph(list(g.node), g.name, list(g.input) + big, list(g.output),
                                initializer=inline)
    return helper.make_model(outline, opset_imports=list(model.opset_import),
                             ir_version=model.ir_version)


def _shape_inference_class():
    from onnx import helper
    from onnxruntime.tools.symbolic_shape_infer import (
        SymbolicShapeInference,
        get_elem_type_from_type_proto,
    )

    from ...families.ortops import OUTPUT_LIKES

    class ShapeInference(SymbolicShapeInference):
        """onnxruntime's symbolic inference, plus the contrib ops ``families/ortops.py`` emits
        that it does not know (GatedDeltaNet's): each output has one input's type and shape.
        Driven as its own ``infer_shapes`` drives it (those private members are what its
        subclass hook is), less the sym_shape_infer_temp.onnx that one writes into the working
        directory when it fails."""

        def __init__(self, *args):
            super().__init__(*args)
            for op in OUTPUT_LIKES:
                self.dispatcher_[op] = self._like_inputs

        def _like_inputs(self, node):
            for out, i in zip(node.output, OUTPUT_LIKES[node.op_type], strict=False):
                elem = get_elem_type_from_type_proto(self.known_vi_[node.input[i]].type)
                self.known_vi_[out].CopyFrom(
                    helper.make_tensor_value_info(out, elem, self._get_shape(node, i)))

    return ShapeInference
