"""Float graphs for a shard plan: prefill AR-N + decode AR-1 per shard (one weight file) + head.

Used by every target: the cpu target ships them; HTP targets calibrate on them, then quantize and
compile them. The cpu target also ships an AR-k verify graph per shard (speculative decoding,
runtime/speculative.py) on the same weight file: on cpu a k-row call costs little more than one
row while the AR-N prefill graph costs N rows' compute (bench/speculative.py measures both).
HTP targets get them with --htp-verify, and the head on k rows beside the one-row head: a
decode step streams every weight once for one row, so k rows cost about as much (Hextimate:
docs/speculative.md#on-the-npu-by-hextimate).
"""

from __future__ import annotations

from ...bundle.describe import layer_span
from ...bundle.errors import BuildError
from ...bundle.manifest import GraphSpec, RunPlan, ShardPlan
from ...bundle.targets import Target
from ..context import StageContext
from ..heap import release_heap, release_mapped_pages
from ..progress import stage
from .fuse import fuse_cpu_graph
from .onnxexport import export_modules, share_weights
from .plan import plan_shards, weight_groups, weights_file


def export_float(ctx: StageContext, shards: list[tuple[int, int]], rel_folder: str, *,
                 cpu: bool = False, fp16_residual_scale: float | None = None,
                 keys_transposed: bool = True) -> tuple[list[GraphSpec], RunPlan]:
    """Export prefill + decode per shard and the head as float ONNX into ctx.root/rel_folder.
    cpu: the cpu target's own graphs — fused onnxruntime nodes (``fuse``), prefill and decode
    graphs that update the cache in place (``fam.cpu_step_module``), the last decode graph with
    the head inside (``blocks.WithHead``) — not the static form the HTP targets calibrate and
    compile.

        HTP:  s0.prefill s0.decode -> s0.weights ...  head -> head.weights
        cpu:  s0.prefill s0.decode -> s0.weights ...  sK.prefill sK.decode+head head -> sK.weights

    The modules' form (families/form.py): CPU on cpu; with ``fp16_residual_scale`` (HTP graphs
    with fp16 activations) fused norms, the stream at 1/s and keys transposed where the shard
    has it (kvcast.py; ``keys_transposed`` False: as rows, a lever's baseline); else PLAIN, the
    decomposed graph the quantizer takes.
    """
    from ...families.blocks import OverRows, WithHead
    from ...families.form import CPU, PLAIN, fp16

    fam, hf, args, opts, root, log = ctx.fam, ctx.hf, ctx.args, ctx.opts, ctx.root, ctx.log
    form = CPU if cpu else PLAIN if fp16_residual_scale is None else fp16(fp16_residual_scale,
                                                                            keys_transposed)
    fuse = fuse_cpu_graph if cpu else None
    folder = root / rel_folder
    folder.mkdir(parents=True)
    graphs: list[GraphSpec] = []
    plan: list[ShardPlan] = []

    def export(items: list[tuple[str, str, object]], layers=None) -> list[GraphSpec]:
        """(name, role, module) items exported side by side (export_modules)."""
        paths = [folder / f"{n}.onnx" for n, _, _ in items]

        def done(i: int, seconds: float) -> None:
            log(f"  exported {rel_folder}/{items[i][0]} ({seconds:.1f}s)")
            advance()

        specs = export_modules([(m, p) for (_, _, m), p in zip(items, paths, strict=True)],
                               opts.exporter, fold=True, done=done)
        return [GraphSpec(name=n, role=r, file=f"{rel_folder}/{n}.onnx", seq_len=ins[0].shape[1],
                          layers=layers, inputs=ins, outputs=outs)
                for (n, r, _), (ins, outs) in zip(items, specs, strict=True)]

    verify_len = opts.verify_len if cpu or opts.htp_verify else 0  # AR-k rows, 0: none
    verify_head = bool(verify_len) and not cpu  # the cpu's last verify graph runs the head itself
    per_shard = 2 + (1 if verify_len else 0)  # prefill, decode (, verify)
    with stage(f"export {'cpu' if cpu else rel_folder}",
               len(shards) * per_shard + 1 + verify_head) as advance:
        last = len(shards) - 1
        for s, (a, b) in enumerate(shards):
            # a bf16 model: only this shard's layers (and the head it runs) in fp32
            with fam.float32(hf, layers=(a, b), head=cpu and s == last, towers=False):
                def step(rows: int, layers: tuple[int, int] = (a, b)):
                    if cpu:
                        return fam.cpu_step_module(hf, args, layers, rows, opts.context)
                    return fam.decoder_module(hf, args, layers, rows, opts.context, form)

                items = [(f"s{s}.prefill", "prefill", step(opts.prefill_len))]
                decode = step(1)
                if cpu and s == last:
                    decode = WithHead(decode, fam.head_module(hf, args, form))
                items.append((f"s{s}.decode", "decode", decode))
                if verify_len:
                    verify = step(verify_len)
                    if cpu and s == last:  # every row's logits: each checks the draft after it
                        verify = WithHead(verify, fam.head_module(hf, args, form))
                    items.append((f"s{s}.verify", "verify", verify))
                pre, dec, *ver = export(items, (a, b))
                # the modules hold the shard's fp32 copies: gone before its weights are shared
                items = decode = verify = None
                ver = ver[0] if ver else None
            graphs += [g for g in (pre, dec, ver) if g is not None]
            plan.append(ShardPlan(layers=(a, b), prefill=pre.name, decode=dec.name,
                                  verify=ver and ver.name))
            if s < last or not cpu:
                share_weights([folder / f"{n}.onnx" for n in plan[-1].names()], f"s{s}.weights",
                              fuse)
            release_mapped_pages(hf.name_or_path)  # the checkpoint pages this shard was read from
            release_heap()  # and what its exports freed (GBs: torch's and onnx's working copies)
        with fam.float32(hf, head=True, towers=False):
            heads = [("head", "head", fam.head_module(hf, args, form))]
            if verify_head:  # [1, k, H] -> [1, k, V]: a verify step's logits in one call
                heads.append(("head.verify", "head",
                              OverRows(fam.head_module(hf, args, form), verify_len)))
            head, *vhead = export(heads)
        graphs += [head, *vhead]
        release_mapped_pages(hf.name_or_path)
        release_heap()
    run_plan = RunPlan(prefill_len=opts.prefill_len, shards=plan, head=head.name,
                       verify_len=verify_len or None,
                       verify_head=vhead[0].name if vhead else None)
    group = weight_groups(run_plan, cpu)[-1]
    share_weights([folder / f"{n}.onnx" for n in group], weights_file(group), fuse)
    for g in graphs:
        g.bytes = (root / g.file).stat().st_size
    return graphs, run_plan


# A compiled context holds more than its weights: 2-4 % more at real size (docs/htp.md). The
# target's ceiling is the context's, so the planner gives the weights the ceiling less this;
# --max-shard-bytes names the weights' own ceiling.
CONTEXT_OVERHEAD = 1.04


def _ceiling(target: Target, opts) -> tuple[int, bool]:
    """(a graph's weight-byte ceiling on ``target``, whether --max-shard-bytes named it)."""
    limit = opts.max_shard_bytes
    given = limit.get(target.name) if isinstance(limit, dict) else limit
    return given or (int(target.max_context_bytes / CONTEXT_OVERHEAD) if target.is_htp
                     else target.max_context_bytes), bool(given)


def plan_genie(fam, hf, target: Target, opts, gather_bytes: int, log) -> list[tuple[int, int]]:
    """Genie's splits: one context holds a split's layers *and* the head (the last split) and
    the token table (the first, where its graphs gather ``input_ids``; ``gather_bytes``), where
    the target's graphs keep the head apart -- so the target's plan with those bytes on the end
    layers, that each context stays under the device's per-context ceiling (1.8 GB on v81).
    A --max-shard-bytes the user gave is the target's plan as it stands."""
    ceiling, given = _ceiling(target, opts)
    shards = plan_target(fam, hf, target, opts, lambda m: None)
    if given:
        return shards
    recipe = opts.recipe
    layers = list(fam.layer_weight_bytes(hf, recipe.bytes_per_weight))
    layers[-1] += fam.head_weight_bytes(hf, recipe.head_bytes_per_weight())
    layers[0] += gather_bytes
    if max(layers) > ceiling:  # no split can hold it: the target's, said
        log(f"[{target.name}] genie: a split's layers with the head ({max(layers):,} B) pass "
            f"the {target.max_context_bytes / 1e9:.1f} GB per-context ceiling a phone holds")
        return shards
    genie = plan_shards(layers, ceiling)
    if len(genie) != len(shards):
        log(f"[{target.name}] genie: {len(genie)} splits, not the target's {len(shards)}: each "
            f"context holds its layers and the head or token table under "
            f"{target.max_context_bytes / 1e9:.1f} GB")
    return genie


def plan_target(fam, hf, target: Target, opts, log) -> list[tuple[int, int]]:
    bpw = 4.0 if not target.is_htp else opts.recipe.bytes_per_weight
    ceiling, _ = _ceiling(target, opts)
    shards = plan_shards(fam.layer_weight_bytes(hf, bpw), ceiling)
    head = fam.head_weight_bytes(hf, bpw)
    # a context's ceiling is the HTP's; the cpu target's head has no layers to split and its
    # weights are external (Qwen3.5-4B's tied 248,320 x 2,560 head is 2.5 GB in fp32)
    if head > ceiling and target.is_htp:
        raise BuildError(f"the head holds {head:,} weight bytes > the per-graph ceiling {ceiling:,}")
    log(f"[{target.name}] {len(shards)} shard(s) under {ceiling:,} B of weights: "
        + " ".join(layer_span(s) for s in shards))
    return shards


def disk_need(fam, hf, targets: list[Target], opts, tower_params: int = 0,
              lut_bytes: int = 0) -> int:
    """About how many bytes of free disk a build's graphs take at its peak, beside the host
    tensors (measured on Gemma-4-E4B: docs/notes/realsize.md):

        cpu target      fp32 graphs, all the build long (the bundle ships them), the encoder
                        towers' (``tower_params`` parameters) among them; --device-only: the
                        towers' alone
        + the larger of
          float graphs  the HTP float graphs, fp32 again, and the more of: the largest shard's
                        exporter side files (before they are gathered into one weights file),
                        the quantized graphs (made before the float graphs go)
          compiles      the quantized graphs (fp16: the float ones), per HTP target the unshared
                        binaries and with --share-weights the shared ones, each ~ the quantized
                        bytes; then the towers' fp16 binaries, up to 4 bytes a parameter (their
                        baked tables: E4B's 2.9 and 3.5)
            + --genie   which comes after the compiles, their sources and binaries still there:
                        the Genie graphs (quantized: all splits' quantized graphs and one
                        split's fp32 export twice, its AR-1 graph's beside its AR-N graph's,
                        forge/genie/decoder.py; fp16: the fp32 exports of all), per HTP
                        target their binaries (unshared: an AR-N and an AR-1 one a split),
                        the towers' nodes again, and the LUT (``lut_bytes``: at most the
                        host tensors' bytes, 16 bits a value as theirs)

    and 10 % over that: the stages' own temporary files and the free space move by a GB or so.
    Qwen3.5-4B's --genie build at w4-fp16 stopped with a full disk where this said 26.4 GB
    before the Genie term was in it."""
    fp32 = fam.layer_weight_bytes(hf, 4.0)
    full = sum(fp32) + fam.head_weight_bytes(hf, 4.0) + 4 * tower_params  # every graph in fp32
    cpu = 4 * tower_params if opts.device_only else full
    htp = [t for t in targets if t.is_htp]
    if not htp:
        return int(1.1 * cpu)
    recipe = opts.recipe
    shards = plan_target(fam, hf, htp[0], opts, lambda m: None)
    quant = (sum(fam.layer_weight_bytes(hf, recipe.bytes_per_weight))
             + fam.head_weight_bytes(hf, recipe.bytes_per_weight))
    side_files = max(sum(fp32[a:b]) for a, b in shards)
    floats = full + max(side_files, quant if recipe.quantized else 0)
    binaries = len(htp) * ((3 if opts.share_weights else 2) * quant + 4 * tower_params)
    sources = quant if recipe.quantized else full  # what the compiles are given
    genie = 0
    if opts.genie:
        decoder = full - 4 * tower_params
        # the largest split's fp32 export (Genie's last split holds the head: plan_genie), its
        # AR-1 graph exported while the AR-N one's weights are there: twice, that once
        split = side_files + fam.head_weight_bytes(hf, 4.0)
        exports = quant + 2 * split if recipe.quantized else decoder + split
        compiled = quant if recipe.quantized else decoder // 2
        # unshared: an AR-N and an AR-1 binary a split; shared: one, and the oracle's twins
        per = (3 if opts.verify else 1) if opts.share_weights else 2
        genie = exports + len(htp) * (per * compiled + 4 * tower_params) + lut_bytes
    return int(1.1 * (cpu + max(floats, sources + binaries + genie)))
