"""Media encoder graphs (vision, audio): float export for cpu, fp16 compile per HTP target, gates.

    encoder_families(config) ─spec─▶ EncoderSpec (manifest) ─encoder_module─▶ <target>/<name>.onnx
        cpu: the float graph ships        HTP: the float graph compiled with fp16 precision
    oracle (verify.verify_encoders): the family's example inputs through each target's graph vs
    HF's own soft tokens, judged against ``encoder_gate``

Encoders stay in fp16 on the HTP: they run once per image / clip, so their cost is small next to
the decoder, and 16-bit activation quantization of attention-heavy towers costs accuracy
(docs/htp.md: act x act ops are where A16 loses it).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ...bundle.manifest import EncoderSpec, GraphSpec
from ..heap import release_heap
from .onnxexport import export_module, share_weights

# encoder gates, cosine of the valid soft-token rows vs HF, per where the tower runs: fp32 on the
# cpu, int8 weights on the cpu (nbits.CPU_ENCODER_WEIGHTS), fp16 on the HTP
ENCODER_GATES = {"cpu": 0.99999, "cpu-int8": 0.999, "htp": 0.999}
ROLE = {"image": "vision", "audio": "audio"}


def example_feeds(encoder, spec: EncoderSpec) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(v) for k, v in encoder.example_inputs(spec).items()}


def calibrate_encoder_norms(encoders: list, specs: list[EncoderSpec], hf) -> dict[str, float]:
    """Record the towers' RMSNorm prescales on each encoder's example inputs (HF forward): the
    decoder's text calibration never reaches them. Must run before ``export_encoders`` builds the
    modules. Regression (fp16 vision on the simulator, cos 0.99888 on CI's host vs 0.999999 here):
    the tiny tower's post-FFN norm input has rms ~1e-3, its squares are fp16 subnormals, and an
    HTP that flushes those to zero loses the norm's scale."""
    from ...families.blocks import record_norm_prescales

    out = {}
    for enc, spec in zip(encoders, specs, strict=True):
        feeds = example_feeds(enc, spec)
        out.update(record_norm_prescales(hf, lambda enc=enc, feeds=feeds: enc.reference(hf, feeds)))
    return out


def export_encoders(encoders: list, specs: list[EncoderSpec], hf, root: Path, rel_folder: str,
                    exporter: str, log) -> list[GraphSpec]:
    """Export each encoder's static module as float ONNX into root/rel_folder/<name>.onnx."""
    import torch

    graphs = []
    for enc, spec in zip(encoders, specs, strict=True):
        module = enc.encoder_module(hf, spec)
        feeds = example_feeds(enc, spec)
        keys = [bind.removeprefix("media:") for _, bind in module.io.inputs]
        module.example_inputs = lambda feeds=feeds, keys=keys: tuple(
            torch.from_numpy(feeds[k]) for k in keys)
        path = root / rel_folder / f"{spec.name}.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        ins, outs = export_module(module, path, exporter)
        share_weights([path], f"{spec.name}.weights")
        del module
        release_heap()  # the export's working copies (a GB at real size), before the next stage
        log(f"  exported {rel_folder}/{spec.name} ({time.perf_counter() - t:.1f}s)")
        graphs.append(GraphSpec(name=spec.name, role=ROLE[spec.modality],
                                file=f"{rel_folder}/{spec.name}.onnx", seq_len=spec.max_soft_tokens,
                                inputs=ins, outputs=outs,
                                bytes=sum(f.stat().st_size for f in (path, path.with_name(
                                    f"{spec.name}.weights")) if f.is_file())))
    return graphs


def compile_encoders(float_graphs: list[GraphSpec], root: Path, target, soc_model: int,
                     log, check_items: list[dict[str, np.ndarray]] | None = None
                     ) -> list[GraphSpec]:
    """The float encoder graphs compiled for one HTP target with fp16 precision. With
    ``check_items`` (a build without the oracle: one example item per encoder) each compiled
    graph runs once on the HTP against its float graph (forge/compile/graphcheck.py), whose error bar
    fails the build."""
    from ...runtime import qnn
    from ..compile import graphcheck
    from ..compile.contexts import compile_graph

    out = []
    for g in float_graphs:
        res = compile_graph(root / g.file, root / target.name / f"{g.name}.ctx.onnx",
                            target.htp_arch, soc_model, fp16=True)
        log(f"[{target.name}] compiled {g.name} (fp16): {res['bin_bytes']:,} B "
            f"({res['seconds']:.1f}s)")
        out.append(g.model_copy(update={"file": f"{target.name}/{g.name}.ctx.onnx",
                                        "bytes": res["bin_bytes"] + res["ctx"].stat().st_size}))
    if check_items is not None:
        so = qnn.session_options(qnn.provider_options(target.htp_arch, soc_model, fp16=True), {})
        out = graphcheck.gate(target.name, out, graphcheck.check_encoders(
            root, target.name, so, float_graphs, out, check_items, log))
    return out


def quantize_cpu_encoders(graphs: list[GraphSpec], root: Path, cpu_weights: str, log) -> None:
    """The cpu target's tower graphs with weight-only MatMulNBits per ``CPU_ENCODER_WEIGHTS``, in
    place (after the HTP targets compiled their fp16 towers from the float graphs)."""
    from ..quantize.nbits import CPU_ENCODER_WEIGHTS, check_cpu_weights, quantize_cpu_graph

    weights = CPU_ENCODER_WEIGHTS[cpu_weights]
    nbits = check_cpu_weights(weights)
    if not nbits:
        return
    for g in graphs:
        t = time.perf_counter()
        path = root / g.file
        n = quantize_cpu_graph(path, *nbits)
        share_weights([path], f"{g.name}.weights")
        g.bytes = sum(f.stat().st_size for f in (path, path.with_name(f"{g.name}.weights"))
                      if f.is_file())
        log(f"  {g.file}: weights {weights} ({n} MatMulNBits, {g.bytes / 1e6:.1f} MB, "
            f"{time.perf_counter() - t:.1f}s)")


def encoder_gate(htp: bool, cpu_weights: str | None) -> float:
    """The soft-token cosine a tower must reach on a target (cpu_weights: the cpu target's)."""
    from ..quantize.nbits import CPU_ENCODER_WEIGHTS

    if htp:
        return ENCODER_GATES["htp"]
    return ENCODER_GATES["cpu" if CPU_ENCODER_WEIGHTS[cpu_weights or "fp32"] == "fp32"
                         else "cpu-int8"]
