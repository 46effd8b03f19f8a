"""Per-tensor accuracy of an HTP target: where its graphs leave the float model.

An HTP target that misses its oracle gate says how far the logits moved, not which op moved them.
This probe answers that for one graph call of a bundle built with ``--keep-work`` (its float and
quantized ONNX stay under ``_work/``). Fixed-point (QDQ) targets:

    feeds of call STEP of GRAPH, captured from the QDQ graphs on the CPU EP on the oracle prompt
            │
            ├─▶ float graph            (the build's fp32 export)          ──▶ reference tensors
            ├─▶ QDQ graph, CPU EP      (the quantization alone)           ──▶ error vs float
            └─▶ QDQ graph, HTP         (compiled for the arch, run on the simulator or a device)
                                                                          ──▶ error vs float

Every activation the QDQ graph re-quantizes (QuantizeLinear -> DequantizeLinear of an op's output)
is exposed as an extra output of all three graphs, so each row is one op's output: its relative
error ``|x - float| / |float|`` on the CPU EP and on the HTP, in graph order. A ratio HTP / CPU far
above 1 marks an op the HTP computes worse than its QDQ arithmetic (it found the act x act
MatMul's 16-bit inputs this way: ``qdq._act_matmul_inputs``).

Targets with fp16 activations (fp16, and the weight-only recipes, whose CPU column is the
MatMulNBits graph on the CPU EP): every output of the ops that make values (``FLOAT_PROBED``),
so the first row whose HTP error jumps is where fp16 loses the model (an overflow reads ~1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...bundle.manifest import Manifest, confine, load_manifest
from ...runtime import qnn
from ...runtime.backends import Backend
from ...runtime.engine import Engine
from ...runtime.text import TextTokenizer
from ..oracle.ortrun import run_graph
from ..quantize.recipes import built_recipe


@dataclass
class TensorError:
    tensor: str  # the float graph's name for it
    op: str  # the op that produced it ("output" for the graph's own outputs)
    node: str
    cpu: float  # relative error vs float: the QDQ graph on the CPU EP
    htp: float  # ... and compiled for the HTP

    @property
    def ratio(self) -> float:
        """HTP / CPU error; 1e-6 (float32 noise) added to both, so exact rows read ~1."""
        return (self.htp + 1e-6) / (self.cpu + 1e-6)


def qdq_graph_files(bundle: Path, manifest: Manifest, target: str) -> dict[str, Path]:
    """Graph name -> the ONNX it was compiled from (QDQ, weight-only or the float graph itself),
    under the bundle's ``_work/``."""
    spec = manifest.targets[target]
    suffix = built_recipe(spec).compiled_suffix
    names = [g.name for g in spec.graphs if g.role not in ("vision", "audio")]
    for folder in sorted((bundle / "_work").glob(f"{spec.quant}-*")):
        files = {n: folder / f"{n}{suffix}" for n in names}
        if all(f.is_file() and f.with_name(f"{n}.onnx").is_file() for n, f in files.items()):
            return files
    raise FileNotFoundError(f"{bundle} has no float + QDQ graphs of target {target} under _work/: "
                            "build it with --keep-work")


def capture_feeds(bundle: Path, manifest: Manifest, target: str, files: dict[str, Path],
                  graph: str, step: int) -> dict[str, np.ndarray]:
    """The inputs of call ``step`` of ``graph`` while the QDQ twin feeds the oracle prompt token
    by token (decode graphs) or in AR-N chunks (prefill graphs)."""
    from ..oracle.verify import oracle_prompt, qdq_twin

    m, name = qdq_twin(manifest, target, {g: str(f.relative_to(bundle)) for g, f in files.items()})
    engine = Engine(bundle, m, name, Backend("cpu"))
    calls: list[dict[str, np.ndarray]] = []

    def observe(g, feeds, outputs, positions):
        if g.name == graph and len(calls) <= step:
            calls.append({k: np.array(v) for k, v in feeds.items()})

    engine.observer = observe
    engine.reset()
    tok = TextTokenizer(confine(bundle, manifest.tokenizer.dir))
    spec = manifest.targets[target]
    prompt = oracle_prompt(tok, spec.plan.prefill_len, manifest.context, 16)
    decode = graph.endswith(".decode") or graph == "head"
    engine.prefill(prompt if not decode else prompt[:step + 1], "decode" if decode else "chunked")
    if len(calls) <= step:
        raise ValueError(f"{graph} ran {len(calls)} times on the oracle prompt; no call {step}")
    return calls[step]


def _expose(src: Path, dst: Path, names: list[str]) -> list[str]:
    """``src`` with ``names`` (those it produces) added as outputs, saved as ``dst`` beside it
    (its weight file is shared); -> the output names in order."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    have = {o.name for o in model.graph.output}
    produced = {o for n in model.graph.node for o in n.output}
    for n in names:
        if n in produced and n not in have:
            model.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
            have.add(n)
    onnx.save(model, str(dst))
    return [o.name for o in model.graph.output]


def _rel(x: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    return float(np.linalg.norm(x.astype(np.float64) - ref) / (np.linalg.norm(ref) + 1e-30))


def _requantized(model, outputs: list[str]) -> list[tuple[str, str, str, str]]:
    """Every activation a QDQ graph re-quantizes: (DQ output in the QDQ graph, the float tensor
    it stands for, op, node)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    picked = []
    for n in model.graph.node:
        q = producer.get(n.input[0]) if n.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear" or n.output[0] in outputs:
            continue  # weights (no QuantizeLinear) and the graph's outputs (compared below)
        op = producer.get(q.input[0])
        if op is not None and op.op_type not in ("Constant", "QuantizeLinear", "DequantizeLinear"):
            picked.append((n.output[0], q.input[0], op.op_type, op.name))
    return picked


# the ops whose outputs a graph with fp16 activations is probed at: where values are made
# (projections, norms, the residual adds, attention), not where they are moved
FLOAT_PROBED = {"MatMul", "MatMulNBits", "SimplifiedLayerNormalization", "RMSNormalization",
                "Add", "Softmax", "Mul", "Sigmoid", "Exp", "Div", "Sqrt", "ReduceMean"}


def _float_tensors(model, outputs: list[str]) -> list[tuple[str, str, str, str]]:
    """Every output of a FLOAT_PROBED op of a graph with fp16 activations (the weight-only
    graph keeps the float graph's tensor names): (name, name, op, node)."""
    return [(o, o, n.op_type, n.name) for n in model.graph.node if n.op_type in FLOAT_PROBED
            for o in n.output[:1] if o not in outputs]


def tensor_errors(bundle: Path, target: str = "v81", graph: str | None = None,
                  step: int = 8) -> list[TensorError]:
    """One row per re-quantized activation of ``graph`` (default: the first decode graph), then
    one per graph output, for call ``step`` on the oracle prompt. Compiles the exposed QDQ graph
    for the target's arch and runs it on the HTP (the simulator on x86)."""
    import onnx

    from .contexts import compile_graph

    bundle = Path(bundle)
    manifest = load_manifest(bundle)
    spec = manifest.targets.get(target)
    if spec is None or spec.htp_arch is None:
        raise ValueError(f"{bundle} has no HTP target {target!r}")
    files = qdq_graph_files(bundle, manifest, target)
    graph = graph or next(n for n in files if n.endswith(".decode"))
    if graph not in files:
        raise ValueError(f"target {target} has no graph {graph!r} (it has {', '.join(files)})")
    feeds = capture_feeds(bundle, manifest, target, files, graph, step)

    qdq = files[graph]
    model = onnx.load(str(qdq), load_external_data=False)
    outputs = [o.name for o in model.graph.output]
    fixed_point = any(n.op_type == "QuantizeLinear" for n in model.graph.node)
    picked = (_requantized(model, outputs) if fixed_point else _float_tensors(model, outputs))
    probe = qdq.with_name(f"{graph}.probe.q.onnx")
    _expose(qdq, probe, [p[0] for p in picked])
    float_probe = qdq.with_name(f"{graph}.probe.onnx")
    _expose(qdq.with_name(f"{graph}.onnx"), float_probe, [p[1] for p in picked])
    ctx = qdq.with_name(f"{graph}.probe.ctx.onnx")
    fp16 = not fixed_point  # fp16 activations: the float and weight-only recipes
    try:
        ref = run_graph(float_probe, feeds)
        cpu = run_graph(probe, feeds)
        compile_graph(probe, ctx, spec.htp_arch, spec.soc_model, fp16=fp16)
        so = qnn.session_options(qnn.provider_options(spec.htp_arch, spec.soc_model, fp16), {})
        htp = run_graph(ctx, feeds, so)
    finally:
        for f in (probe, float_probe, ctx, ctx.with_name(ctx.stem + "_qnn.bin")):
            f.unlink(missing_ok=True)
    rows = [TensorError(fname, op, node, _rel(cpu[name], ref[fname]), _rel(htp[name], ref[fname]))
            for name, fname, op, node in picked if fname in ref and name in htp]
    rows += [TensorError(o, "output", o, _rel(cpu[o], ref[o]), _rel(htp[o], ref[o]))
             for o in outputs if o in ref and o in htp and ref[o].dtype.kind == "f"]
    return rows
