"""Float graphs for a shard plan: prefill AR-N + decode AR-1 per shard (one weight file) + head.

Used by every target: the cpu target ships them; HTP targets calibrate on them, then quantize and
compile them.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import BuildError
from ..manifest import GraphSpec, RunPlan, ShardPlan
from ..targets import Target
from .export import export_module, share_weights
from .plan import plan_shards
from .quantize import get_recipe


def export_float(fam, hf, args, shards: list[tuple[int, int]], opts, root: Path,
                  rel_folder: str, log, cpu: bool = False) -> tuple[list[GraphSpec], RunPlan]:
    """Export prefill + decode per shard and the head as float ONNX into root/rel_folder.
    cpu: the cpu target's own graphs — fused onnxruntime norms, and decode graphs that update the
    cache in place (``fam.cpu_decode_module``) — not the static form the HTP targets calibrate
    and compile."""
    from ..families.blocks import use_cpu_kernels

    folder = root / rel_folder
    folder.mkdir(parents=True)
    graphs: list[GraphSpec] = []
    plan: list[ShardPlan] = []

    def export(name: str, role: str, module, layers=None) -> GraphSpec:
        path = folder / f"{name}.onnx"
        t = time.perf_counter()
        ins, outs = export_module(module, path, opts.exporter)
        log(f"  exported {rel_folder}/{name} ({time.perf_counter() - t:.1f}s)")
        return GraphSpec(name=name, role=role, file=f"{rel_folder}/{name}.onnx",
                         seq_len=ins[0].shape[1], layers=layers, inputs=ins, outputs=outs)

    for s, (a, b) in enumerate(shards):
        with fam.float32(hf, layers=(a, b)):  # a bf16 model: only this shard's layers in fp32
            prefill = fam.decoder_module(hf, args, (a, b), opts.prefill_len, opts.context)
            pre = export(f"s{s}.prefill", "prefill",
                         use_cpu_kernels(prefill) if cpu else prefill, (a, b))
            dec = export(f"s{s}.decode", "decode",
                         fam.cpu_decode_module(hf, args, (a, b), opts.context) if cpu else
                         fam.decoder_module(hf, args, (a, b), 1, opts.context), (a, b))
        share_weights([folder / f"s{s}.prefill.onnx", folder / f"s{s}.decode.onnx"],
                      f"s{s}.weights")
        graphs += [pre, dec]
        plan.append(ShardPlan(layers=(a, b), prefill=pre.name, decode=dec.name))
    with fam.float32(hf, head=True):
        head = export("head", "head", fam.head_module(hf, args))
    share_weights([folder / "head.onnx"], "head.weights")
    graphs.append(head)
    for g in graphs:
        g.bytes = (root / g.file).stat().st_size
    return graphs, RunPlan(prefill_len=opts.prefill_len, shards=plan, head=head.name)


def plan_target(fam, hf, target: Target, opts, log) -> list[tuple[int, int]]:
    bpw = 4.0 if not target.is_htp else get_recipe(opts.quant).bytes_per_weight
    limit = opts.max_shard_bytes
    ceiling = (limit.get(target.name) if isinstance(limit, dict) else limit) or target.max_context_bytes
    shards = plan_shards(fam.layer_weight_bytes(hf, bpw), ceiling)
    head = fam.head_weight_bytes(hf, bpw)
    if head > ceiling:
        raise BuildError(f"the head holds {head:,} weight bytes > the per-graph ceiling {ceiling:,}")
    log(f"[{target.name}] {len(shards)} shard(s) under {ceiling:,} B: "
        + " ".join(f"[{a},{b})" for a, b in shards))
    return shards
