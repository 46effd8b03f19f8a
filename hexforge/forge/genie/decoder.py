"""The decoder re-exported in the I/O contract of Qualcomm's Genie runtime, then compiled.

Genie (``libGenie.so``, what AI Hub's phone bundles run) drives QNN context binaries itself: it
makes the attention mask and the rope tables, keeps the KV cache, feeds token ids and reads
logits. It finds all of that by tensor name and shape (docs/genie.md has the evidence), so the
graphs hexforge's own runtime drives are wrapped into that contract by each family
(``fam.genie_step``, names and layout in ``families/genieio.py``), split as the planner splits
the target's graphs, the splits in AI Hub's order::

    prompt_ar<N>_cl<C>_<i>_of_<n>.bin   AR-N: a prompt in chunks of N
    token_ar1_cl<C>_<i>_of_<n>.bin      AR-1: a token a step
      split 1: input_ids ... residual_<b>;  split n: residual_<a> ... logits;  every split: the
      mask, the ropes and its own layers' caches

The inner modules are the family's own shard and head in the fp16 form, so the arithmetic is the
arithmetic the oracle checked; only the boundary changes. This module knows no family.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

from ...bundle.errors import BuildError
from ...runtime.genie.libgenie import x86_room_note
from ..context import StageContext


def graph_name(seq_len: int, context: int, split: int = 0, splits: int = 1) -> str:
    """AI Hub's naming (``prompt_ar128_cl4096_2_of_3``): Genie orders a model's splits by the
    ``_<i>_of_<n>`` suffix, and reads AR and CL from the name when the tensors do not tell it."""
    kind = "token" if seq_len == 1 else "prompt"
    return f"{kind}_ar{seq_len}_cl{context}_{split + 1}_of_{splits}"


def export_genie_graphs(ctx: StageContext, host, folder: Path, residual_scale: float,
                        shards: list[tuple[int, int]] | None = None, step=None,
                        finish: Callable[[list[Path], int, int], list[Path]] | None = None
                        ) -> list[list[Path]]:
    """Per split (the planner's ``shards``; default one), one ONNX graph per AR (the options'
    prefill, then decode) in ``folder``, the split's weights in one file; ``step`` (default
    ``fam.genie_step``) makes each module; ``finish(paths, split, splits)``, given each split as
    it is exported, returns the graphs to keep for it (its quantized ones: the float export of
    one split at a time on disk, not the whole model's in fp32). -> per split, its graph paths."""
    from ..export.onnxexport import export_module, share_weights

    fam, hf, args, log = ctx.fam, ctx.hf, ctx.args, ctx.log
    prefill_len, context, exporter = ctx.opts.prefill_len, ctx.opts.context, ctx.opts.exporter

    folder.mkdir(parents=True, exist_ok=True)
    shards = shards or [(0, args.num_hidden_layers)]
    out = []
    for s, (a, b) in enumerate(shards):
        paths = []
        last = b == args.num_hidden_layers
        with fam.float32(hf, layers=(a, b), head=last, towers=False):
            for T in dict.fromkeys((prefill_len, 1)):
                module = (step or fam.genie_step)(hf, args, host, (a, b), T, context,
                                                  residual_scale)
                path = folder / f"{graph_name(T, context, s, len(shards))}.onnx"
                t = time.perf_counter()
                export_module(module, path, exporter, fold=True)
                log(f"  exported {path.name} ({time.perf_counter() - t:.1f}s)")
                paths.append(path)
                module = None
                # the AR-1 graph's weights are the AR-N one's: into the split's file as each
                # comes, the split's weights on disk at most twice (three times, gathered after)
                share_weights(paths, f"genie_{s + 1}_of_{len(shards)}.weights", extend=True)
        out.append(finish(paths, s, len(shards)) if finish else paths)
    return out


def compile_genie_graphs(paths: list[Path], work: Path, out: Path | None, htp_arch: int,
                         soc_model: int, log) -> list[Path]:
    """Each graph to its own context binary in ``work`` (beside the EPContext model the oracle
    loads it by, ``genie_verify``), its QNN graph named as Genie orders splits
    (``name_for_genie``), linked into ``out/<name>.bin`` (Genie's ctx-bins list) unless ``out``
    is None (the unshared twins of a weight-shared bundle). -> the binaries in ``out``."""
    from ..compile.contexts import compile_graph

    work.mkdir(parents=True, exist_ok=True)
    bins = []
    for src in paths:
        name = src.name.split(".")[0]  # prompt_ar16_cl128_1_of_1(.wo).onnx
        res = compile_graph(src, work / f"{name}.ctx.onnx", htp_arch, soc_model, fp16=True)
        name_for_genie(res["ctx"], res["bin"], name)
        log(f"  compiled {name}: {res['bin_bytes']:,} B ({res['seconds']:.1f}s)")
        if out is not None:
            binary = out / f"{name}.bin"
            _link(res["bin"], binary)
            bins.append(binary)
    return bins


def name_for_genie(ctx: Path, binary: Path, name: str) -> str:
    """Give the QNN graph in ``binary`` Genie's split naming from ``name``
    (``prompt_ar16_cl128_2_of_3`` -> ``prompt<letters>_ar16_cl128_2_of_3``, forge/genie/ctxname.py:
    the form libGenie and GenieX's plugin both take)."""
    from .ctxname import rename_graph

    m = re.fullmatch(r"([a-z]+)(_ar\d+_cl\d+_\d+_of_\d+)", name)
    if m is None:
        raise BuildError(f"{name}: not a Genie split name")
    return rename_graph(ctx, binary, m.group(1), m.group(2), sep="", letters=True)


def _link(src: Path, dst: Path) -> None:
    """``dst`` the same bytes as ``src`` (a hard link where the filesystem allows)."""
    import os
    import shutil

    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def scatter_step(fam):
    """``fam.genie_step`` in the scatter form (``--genie-kv scatter``: a ``cache_index`` input,
    the past CL rows; ``genieio.GenieContract.cache_index``), for the families whose Genie step
    is the dense one (``DecoderFamily.genie_step``)."""
    from ...families.genieio import DenseGenieStep, GenieContract

    contract = GenieContract(cache_index=True)

    def step(hf, args, host, layers, seq_len, context, residual_scale):
        return DenseGenieStep.make(fam, hf, args, host, layers, seq_len, context, contract,
                                   residual_scale)
    return step


def lade_step(fam, spec):
    """``fam.genie_step`` in the scatter form with the lookahead guard (``--genie-kv lade``:
    ``fam.genie_lade_step``, families/genielade.py), its rope tables from the frequencies Genie
    computes for each of the family's ropes (``spec.ropes``, proven HF's by ``check_ropes``;
    zero past the ones a partial rope reads)."""
    from .folder import rope_block
    from .verify import genie_inv_freq

    inv_freq = {}
    for rope in spec.ropes:
        inv = genie_inv_freq(rope_block(rope))
        inv[rope.used or len(inv):] = 0.0
        inv_freq[rope.rope] = inv
    return fam.genie_lade_step(inv_freq)


def check_options(fam, args, opts) -> None:
    """Refuse a --genie build Genie bundles are not made for, before any work."""
    fam.check_genie(args)
    if opts.genie_kv == "scatter":
        from ...families.base import DecoderFamily

        if type(fam).genie_step is not DecoderFamily.genie_step:
            raise BuildError(f"--genie-kv scatter: {args.model_type}'s Genie graphs take the "
                             "concat form only (scatter: llama, qwen2, mistral, qwen3)")
    if opts.genie_kv == "lade":
        fam.check_genie_lade(args)
        from ...families.genielade import MAX_CONTEXT

        if opts.context > MAX_CONTEXT:
            raise BuildError(f"--genie-kv lade: --context {opts.context} is past {MAX_CONTEXT}, "
                             "the positions the guard computes in fp16 hold exactly")
    opts.recipe.check_genie()
    if opts.prefill_len >= opts.context or opts.prefill_len < 2:
        raise BuildError("--genie needs 2 <= --prefill-len < --context (Genie's AR-N graph)")
    if 2 * opts.prefill_len == opts.context:
        # the AR-N graph's cache then has as many rows as its chunk (CL - N == N), and libGenie
        # 1.21 misreads it: CL 128 / AR-64 and CL 64 / AR-32 hand the AR-1 graph a wrong cache
        # from the second token on (tiny Qwen3 and Qwen3-VL, dump-tensors); CL 256 / AR-128
        # is refused at load ("ShapeError : attention_mask - Expected [ 1, 65, 193]")
        raise BuildError(f"--genie: --prefill-len {opts.prefill_len} is half of --context "
                         f"{opts.context}, a shape libGenie misreads; give --prefill-len "
                         f"{opts.prefill_len // 2} or --context {2 * opts.context}")


def build_genie_bundles(ctx: StageContext, targets, manifest, residual_scale: float,
                        media_bound: float | None = 0.0) -> dict[str, Path]:
    """For each HTP target, ``root/genie-<target>/``: the decoder in Genie's contract
    (``GenieStep``), split as the planner splits the target's graphs, weight-only quantized like
    them when the recipe says so, compiled per arch, with genie_config.json,
    htp_backend_ext_config.json and tokenizer.json (forge/genie/folder.py).
    The embedding LUT is 16-bit fixed point (half the bytes; Genie copies its rows into a
    uint16 ``inputs_embeds``), its range covering ``media_bound`` too (0.0: no media rows; a
    bound on the media nodes' rows, forge/genie/towers.media_row_bound); None keeps it float32
    (a tower whose rows have no known bound). -> {target name: folder}."""
    from ..export.graphs import plan_genie
    from .folder import folder_name, lut_encoding, write_bundle_files
    from .geniex import write_geniex_files

    fam, hf, args, opts, root, log = ctx.fam, ctx.hf, ctx.args, ctx.opts, ctx.root, ctx.log
    recipe = opts.recipe
    work = root / "_work" / "genie"
    host = manifest.host
    spec = fam.genie_spec(hf, args)
    step = (lade_step(fam, spec) if opts.genie_kv == "lade"
            else scatter_step(fam) if opts.genie_kv == "scatter" else None)
    check_ropes(spec, root / "host.safetensors")
    if opts.genie_kv == "lade":  # the folder's config: the lade graphs' groups and rope
        spec = fam.genie_lade_spec(hf, args)
    lut = (lut_encoding(root / "host.safetensors", spec, media_bound)
           if spec.lut and media_bound is not None else None)
    if lut is not None and lut.per_row:  # for the oracle's emulator: Genie reads it from the binary
        from .folder import LUT_INPUT

        log("[genie] the embedding LUT would be 4 GiB or more at 16 bits, past what libGenie "
            "reads: it is 8-bit with a scale a row (docs/genie.md)")
        work.mkdir(parents=True, exist_ok=True)
        (work / LUT_INPUT).write_text(json.dumps([lut.scale, lut.zero_point]))
    # graphs that gather input_ids hold the token table, fp16 (genieio.TokenGather)
    gather = 0 if spec.lut else 2 * args.vocab_size * args.hidden_size

    def finish(split: list[Path], s: int, n: int) -> list[Path]:
        if lut is not None:  # Genie copies the LUT's 16-bit rows as they are
            for p in split:
                quantize_input(p, "inputs_embeds", lut.scale, lut.zero_point)
        graphs = recipe.genie_graphs(split, args.vocab_size, s, n)
        if graphs != split and not opts.keep_work:
            # the split's fp32 export goes once its quantized graphs exist: Qwen3.5-4B's two
            # splits were 16.5 GB of fp32 on disk at once, and its build stopped with a full disk
            drop_graphs(split, split[0].parent / f"genie_{s + 1}_of_{n}.weights")
        return graphs

    splits: dict[tuple, list[list[Path]]] = {}  # the graphs are arch-independent: per plan
    out = {}
    for target in targets:
        shards = plan_genie(fam, hf, target, opts, gather, log)
        key = tuple(shards)
        if key not in splits:
            t = time.perf_counter()
            paths = export_genie_graphs(ctx, host, work / f"onnx{len(splits)}", residual_scale,
                                        shards, step, finish)
            splits[key] = paths
            log(f"[genie] exported {len(shards)} split(s) x {len(paths[0])} graphs "
                f"({time.perf_counter() - t:.1f}s)")
        paths = splits[key]
        folder = root / folder_name(target.name)
        folder.mkdir()
        soc = target.default_soc.soc_model
        say = (lambda m, t=target.name: log(f"[{t}] genie {m.strip()}"))  # noqa: E731
        bins = []
        for s, split in enumerate(paths):
            if opts.share_weights:  # devices: one context per split for both variants
                from ..compile.contexts import compile_shared

                ctxs = [(p, work / f"{target.name}-{p.stem}.ctx.onnx") for p in split]
                res = compile_shared(ctxs, target.htp_arch, soc, fp16=True)
                for p, ctx in ctxs:
                    name_for_genie(ctx, res["bin"], p.name.split(".")[0])
                bins.append(folder / f"decoder_{s + 1}_of_{len(paths)}.bin")
                res["bin"].replace(bins[-1])
                if opts.verify:  # the simulator loads no shared context: the oracle's twins
                    compile_genie_graphs(split, work / target.name, None, target.htp_arch, soc,
                                         say)
            else:
                bins += compile_genie_graphs(split, work / target.name, folder, target.htp_arch,
                                             soc, say)
        write_bundle_files(ctx, folder, manifest, bins, target, spec, lut)
        # GenieX's metadata.json beside Genie's files, from the graphs the binaries hold
        write_geniex_files(folder, manifest.model_type, [p for split in paths for p in split],
                           root / manifest.tokenizer.dir)
        total = sum(b.stat().st_size for b in bins)
        largest = max(b.stat().st_size for b in bins)
        log(f"[{target.name}] Genie bundle {folder.name}/ ({len(bins)} context binaries, "
            f"{total / 1e9:.2f} GB, {len(paths)} split(s), the largest {largest / 1e9:.2f} GB "
            f"of the {target.max_context_bytes / 1e9:.1f} GB a context may hold)")
        note = None if opts.share_weights else x86_room_note(total)
        if note:
            log(f"[{target.name}] note: {note}")
        out[target.name] = folder
    return out


def drop_graphs(graphs: list[Path], weights: Path) -> None:
    """Remove ``graphs`` and the one weights file they share."""
    for p in [*graphs, weights]:
        p.unlink(missing_ok=True)


def quantize_input(path: Path, name: str, scale: float, zero_point: int) -> None:
    """Graph input ``name`` (if it has one) made uint16 in ``path``, a DequantizeLinear (com.microsoft: 16-bit
    on the graphs' opset) giving its readers the float they read before. The QNN EP claims it
    as a fixed-point input of that encoding, which is what Genie copies a 16-bit LUT's rows
    into as they are (``bundle.lut.LutEncoding``)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    found = [i for i in model.graph.input if i.name == name]
    if not found:  # a later split of a model whose LUT rows enter the first one only
        return
    (inp,) = found
    inp.type.tensor_type.elem_type = onnx.TensorProto.UINT16
    floated = f"{name}.dequantized"
    for node in model.graph.node:
        node.input[:] = [floated if x == name else x for x in node.input]
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array(scale, np.float32), f"{name}.scale"),
        numpy_helper.from_array(np.array(zero_point, np.uint16), f"{name}.zero_point")])
    model.graph.node.insert(0, helper.make_node(
        "DequantizeLinear", [name, f"{name}.scale", f"{name}.zero_point"], [floated],
        domain="com.microsoft"))
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(path))


def check_ropes(spec, host_file: Path) -> None:
    """Each rope Genie will compute from the config (``genie_verify.genie_inv_freq``) must be the
    host recipe's (HF's inv_freq): a rope Genie would compute otherwise is refused at build
    time, not found as wrong tokens on a phone."""
    import numpy as np
    from safetensors.numpy import safe_open

    from .folder import rope_block
    from .verify import genie_inv_freq

    with safe_open(str(host_file), "np") as f:
        for rope in spec.ropes:
            want = f.get_tensor(f"rope.{rope.rope}.inv_freq").astype(np.float64)
            got = genie_inv_freq(rope_block(rope))
            n = rope.used or len(got)  # the graph reads the first n; HF rotates no more
            if n > len(want) or not np.allclose(got[:n], want[:n], rtol=1e-5, atol=0) or (
                    np.abs(want[n:]) > 0).any():
                whole = "" if rope.theta == int(rope.theta) else " (Genie reads theta as an integer)"
                raise BuildError(f"--genie: Genie's rope {rope.prefix or 'default'} (theta "
                                 f"{rope.theta}, dim {rope.dim}) is not HF's "
                                 f"rope.{rope.rope} inv_freq{whole}")
