"""``hexforge build``: the stages, in order, into a temp dir renamed into place at the end.
``build_bundle`` calls one function a stage:

    _check_source     the options, the config vs its family, the context, the output path
    HF model loaded (mapped) ─▶ check_memory ─▶ the locked temp dir (forge/partial.py)
    _encoder_specs    the towers' manifest entries
    _calibrate_norms  RMSNorm prescales on the calibration text (and the towers' examples)
    _host_tensors     tokenizer, embedding tables, rope ─▶ host.safetensors; the disk needed
    _cpu_target       plan shards ─▶ export prefill/decode per shard + head ─▶ share weights;
                      the towers' float graphs; the manifest
    _htp_targets      per HTP target: calibrate, quantize, compile (forge/compile/stage.py), the towers;
                      --genie: the Genie folders
    _oracle           every target vs HF ─▶ report.json; ``_gate`` fails the build
    _seal             model card, every file's size + SHA-256 ─▶ rename temp dir -> bundle

A build interrupted anywhere leaves only ``.<name>.partial-*`` next to the output, never a
bundle that loads.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import __version__
from ..bundle.describe import encoder_input
from ..bundle.errors import BuildError, ParityGateError
from ..bundle.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    EncoderSpec,
    GenerationDefaults,
    GraphSpec,
    HostRecipe,
    Manifest,
    TargetSpec,
    TokenizerSpec,
    save_manifest,
)
from ..bundle.targets import Target, parse_targets
from ..families import encoder_families, family_name, load_family
from ..families.base import DecoderFamily, EncoderFamily
from .budget import check_memory, check_positions, fit_context
from .context import StageContext
from .export.encoders import (
    calibrate_encoder_norms,
    compile_encoders,
    example_feeds,
    export_encoders,
    quantize_cpu_encoders,
)
from .export.fuse import fuse_cpu_graph
from .export.graphs import disk_need, export_float, plan_target
from .export.hostwrite import write_host_tensors
from .export.onnxexport import share_weights
from .export.plan import weight_groups, weights_file
from .heap import release_mapped_pages
from .options import BuildOptions
from .partial import TempDir, remove_stale
from .progress import stage
from .quantize.nbits import check_cpu_weights, cpu_head_format, host_table_formats, quantize_cpu_graph
from .quantize.tiedembed import share_tied_embedding
from .source.checkpoint import Checkpoint, read_checkpoint

Log = Callable[[str], None]


@dataclass(frozen=True)
class BuildResult:
    """What ``build_bundle`` made: the bundle, and each stage's wall seconds (load_hf_s,
    export_s, verify_s, total_s)."""

    bundle: Path
    timings: dict[str, float]


def _say_disk(need: int, folder: Path, log) -> None:
    """One line on the disk the build's graphs will take, a warning when ``folder``'s disk has
    less free: said in its first minutes, not when a compile finds the disk full an hour in."""
    free = shutil.disk_usage(folder).free
    line = f"disk: the graphs need about {need / 1e9:.1f} GB at the build's peak, {folder} has " \
           f"{free / 1e9:.1f} GB free"
    log(f"warning: {line}: the build may stop with a full disk" if free < need else line)


def _generation_defaults(gen: dict, config: dict) -> GenerationDefaults:
    def ids(v):
        return [] if v is None else ([v] if isinstance(v, int) else [int(x) for x in v])

    eos = ids(gen.get("eos_token_id", config.get("eos_token_id")))
    sample = bool(gen.get("do_sample", False))
    return GenerationDefaults(
        eos_token_ids=eos, bos_token_id=gen.get("bos_token_id", config.get("bos_token_id")),
        pad_token_id=gen.get("pad_token_id", config.get("pad_token_id")),
        temperature=float(gen.get("temperature", 1.0)) if sample else 0.0,
        top_k=int(gen.get("top_k", 0) or 0) if sample else 0,
        top_p=float(gen.get("top_p", 1.0) or 1.0) if sample else 1.0,
    )


def _build_cpu_target(ctx: StageContext, target: Target) -> TargetSpec:
    opts, out, log = ctx.opts, ctx.root, ctx.log
    graphs, plan = export_float(ctx, plan_target(ctx.fam, ctx.hf, target, opts, log), target.name,
                                cpu=True)
    nbits = check_cpu_weights(opts.cpu_weights)
    if nbits:  # weight-only int8/int4: one graph in memory at a time, then re-shared per shard
        bits, block = nbits
        t = time.perf_counter()
        folder = out / target.name
        groups = weight_groups(plan, cpu=True)
        with stage(f"quantize cpu weights {opts.cpu_weights}", sum(map(len, groups))) as advance:
            for group in groups:
                for name in group:
                    quantize_cpu_graph(folder / f"{name}.onnx", bits, block, ctx.args.vocab_size)
                    advance()
                # q/k/v MatMulNBits packed into one (fuse.pack_sibling_matmuls) as re-shared
                share_weights([folder / f"{n}.onnx" for n in group], weights_file(group),
                              fuse_cpu_graph)
        for g in graphs:
            g.bytes = (out / g.file).stat().st_size
        head_bits, head_block = cpu_head_format(bits, block)
        log(f"[{target.name}] weights {opts.cpu_weights} (MatMulNBits, block {block}; head "
            f"int{head_bits}, block {head_block}) "
            f"({time.perf_counter() - t:.1f}s)")
    return TargetSpec(name=target.name, graphs=graphs, plan=plan, quant=opts.cpu_weights)


@dataclass(frozen=True)
class _Source:
    """What a build reads before any weight: the checkpoint, its family and config, the targets,
    the encoder towers; every check that needs no weights has passed."""

    checkpoint: str | Path  # as the user named it (the model card says where it came from)
    ckpt: Checkpoint
    fam: DecoderFamily
    args: Any  # the family's Args (its HF config fields)
    targets: list[Target]
    encoders: list[EncoderFamily]  # vision / audio towers of a multimodal checkpoint
    opts: BuildOptions  # as asked, --context's default fitted to the model (budget.fit_context)

    @property
    def htp_targets(self) -> list[Target]:
        return [tg for tg in self.targets if tg.is_htp]


@dataclass
class _Build:
    """One build as it goes, handed from stage to stage. The HF model is held here alone, so the
    oracle can free it before the graphs load (``hf = None``: at real sizes both do not fit)."""

    src: _Source
    hf: Any
    opts: BuildOptions
    out: Path  # the bundle, renamed into place at the end
    tmp: Path  # the locked temp dir every stage writes into
    log: Log
    timings: dict[str, float]

    def ctx(self) -> StageContext:
        """What a stage reads, made for one call (a stage keeps no HF model past it)."""
        return StageContext(self.src.fam, self.hf, self.src.args, self.opts, self.tmp, self.log)


def build(checkpoint: str | Path, output: str | Path, opts: BuildOptions | None = None,
          log: Log = print) -> Path:
    """``build_bundle``'s bundle path."""
    return build_bundle(checkpoint, output, opts, log).bundle


def build_bundle(checkpoint: str | Path, output: str | Path, opts: BuildOptions | None = None,
                 log: Log = print) -> BuildResult:
    """Build ``checkpoint`` into the bundle ``output`` (a bundle there is replaced): the stages of
    the module's sketch in order, into a locked temp dir renamed into place at the end; -> the
    bundle and each stage's wall seconds."""
    opts = opts or BuildOptions()
    t_start = time.perf_counter()
    out = Path(output).absolute()
    remove_stale(out.parent)  # temp dirs of builds killed here earlier (the OOM killer runs no except)
    src = _check_source(checkpoint, out, opts, log)
    opts = src.opts  # the context's default fitted to the model: what every stage reads
    t = time.perf_counter()
    hf = src.fam.load_hf(src.ckpt.dir)  # as stored (mapped): seconds, and what the memory check reads
    timings = {"load_hf_s": time.perf_counter() - t}
    said_memory = check_memory(src.fam, hf, src.args, src.targets, opts)  # before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = TempDir(out)  # .<name>.partial-<pid>, locked while this build runs (forge/partial.py)
    b = _Build(src, hf, opts, out, temp.path, log, timings)
    del hf  # held by the build alone (see _Build)
    try:
        log(f"read {src.ckpt.dir} ({src.ckpt.model_type} -> families/"
            f"{family_name(src.ckpt.model_type)}.py) in {timings['load_hf_s']:.1f}s")
        log(said_memory)
        enc_specs = _encoder_specs(b)
        residual_peak = _calibrate_norms(b, enc_specs)
        host = _host_tensors(b)
        t = time.perf_counter()
        manifest, enc_graphs = _cpu_target(b, host, enc_specs)
        qdq, estimates = _htp_targets(b, manifest, enc_graphs, enc_specs, residual_peak)
        quantize_cpu_encoders(enc_graphs, b.tmp, opts.cpu_weights, log)  # the HTP's are compiled
        timings["export_s"] = time.perf_counter() - t
        save_manifest(b.tmp, manifest)
        if opts.verify:
            _oracle(b, manifest, qdq, estimates, enc_graphs)
        elif estimates:  # report.json holds the estimates alone
            from .compile.steptime import add_to_report

            (b.tmp / "report.json").write_text(json.dumps(add_to_report({}, estimates), indent=1))
        _drop_verify_twins(b.tmp, manifest)
        if opts.device_only:  # the towers' float graphs served the compiles and the oracle
            shutil.rmtree(b.tmp / "cpu", ignore_errors=True)
        _seal(b.tmp, out.name, checkpoint, log)
        temp.publish()
    except BaseException:
        temp.discard()
        raise
    timings["total_s"] = time.perf_counter() - t_start
    log(f"wrote {out} in {timings['total_s']:.1f}s")
    return BuildResult(out, timings)


def _check_source(checkpoint: str | Path, out: Path, opts: BuildOptions, log: Log) -> _Source:
    """The options, the checkpoint's config against its family, the context against the model's
    positions, the encoder options, the output path: every check that needs no weights, before
    any is loaded."""
    opts.validate()  # the options alone, before the checkpoint is read
    ckpt = read_checkpoint(checkpoint, log)
    targets = parse_targets(opts.targets)
    if opts.verify:  # a bad --eval-text fails before any work
        from .oracle.verify import EvalText

        EvalText.of(opts.eval_text, opts.eval_tokens)
    fam = load_family(ckpt.model_type).FAMILY
    fam.check_config(ckpt.config)
    args = fam.Args.from_config(ckpt.config)
    fam.check_supported(args)
    opts = fit_context(ckpt.config, opts, log)  # before anything reads the context
    if opts.genie:
        from .genie.decoder import check_options

        check_options(fam, args, opts)
    check_positions(ckpt.config, opts.context)  # the model's; the memory's once it is loaded
    encoders = encoder_families(ckpt.config)
    _check_encoder_options(encoders, opts)
    if out.exists() and not (out / MANIFEST_NAME).is_file() and any(out.iterdir()):
        raise BuildError(f"{out} exists and is not a hexforge bundle; refusing to replace it")
    return _Source(checkpoint, ckpt, fam, args, targets, encoders, opts)


def _encoder_specs(b: _Build) -> list[EncoderSpec]:
    """Each tower's manifest entry (bad encoder options fail here), said in the log."""
    specs = [_encoder_spec(e, b.hf, b.src.ckpt.config, b.opts) for e in b.src.encoders]
    for spec in specs:
        b.log(f"encoder {spec.name}: {encoder_input(spec)['text']}, up to "
              f"{spec.max_soft_tokens} soft tokens")
    return specs


def _calibrate_norms(b: _Build, enc_specs: list[EncoderSpec]) -> float:
    """The RMSNorm prescales recorded on the calibration text (and the towers' example inputs);
    -> the residual stream's peak |x|."""
    from ..families.blocks import calibrate_norm_scales
    from ..runtime.text import TextTokenizer
    from .quantize.calibtext import calibration_text

    fam, hf = b.src.fam, b.hf
    calib_ids = TextTokenizer(b.src.ckpt.dir).encode(calibration_text(b.opts.calib))[:b.opts.context]
    with fam.float32_forward(hf):  # a bf16/fp16 model computes as fp32 (no-op on fp32)
        residual_peak = calibrate_norm_scales(hf, calib_ids, fam.reference_layers(hf))
        calibrate_encoder_norms(b.src.encoders, enc_specs, hf)
    b.log(f"calibrated norm prescales on {len(calib_ids)} tokens"
          + (" and the encoders' example inputs" if b.src.encoders else "")
          + f" (residual stream peak |x| {residual_peak:.4g})")
    return residual_peak


def _genie_row_scales(b: _Build, tensors: dict) -> dict:
    """A ``--genie-host-rows`` build whose embedding LUT a 16-bit one would make 4 GiB or more
    (libGenie reads no further: forge/genie/folder.LUT_CEILING): the LUT's tables' per-row
    scales (folder.joint_row_scales), so the host holds the 8-bit rows Genie's LUT holds; else
    {}. Not the default: on the trained Gemma-3-270M those rows cost the cpu target its fp32
    gate (held-out KL 6.2e-4, top-1 0.976) and the v81 fp16 one its top-1 (0.969 < 0.98)."""
    from .genie.folder import joint_row_scales, needs_row_lut

    if not b.opts.genie_host_rows:
        return {}
    spec = b.src.fam.genie_spec(b.hf, b.src.args)
    if not spec.lut:
        return {}
    parts = [(tensors[name], factor) for name, factor in spec.lut]
    width = sum(int(t.shape[1]) for t, _ in parts) + int(spec.media_flag)
    if not needs_row_lut(int(parts[0][0].shape[0]), width):
        return {}
    return dict(zip((name for name, _ in spec.lut), joint_row_scales(parts), strict=True))


def _host_tensors(b: _Build) -> HostRecipe:
    """The tokenizer files and the host tensors (embedding tables, rope, ...) into the temp dir,
    each table in the format its targets read; then the disk the graphs will need, said."""
    src, hf, opts, tmp = b.src, b.hf, b.opts, b.tmp
    tok_dir = tmp / "tokenizer"
    tok_dir.mkdir()
    for f in src.ckpt.tokenizer_files:
        shutil.copy2(src.ckpt.dir / f, tok_dir / f)
    host = src.fam.host_recipe(hf, src.args)
    if opts.int4_per_layer_tables and not host.extra_embeds:
        raise BuildError(f"--int4-per-layer-tables: a {src.ckpt.model_type} checkpoint has no "
                         "per-layer tables (Gemma-4's per-layer embeddings have)")
    tensors = src.fam.host_tensors(hf, src.args)
    formats = host_table_formats(
        opts.cpu_weights, host.embed.table, [e.table for e in host.extra_embeds], tensors,
        int8_embedding=bool(src.htp_targets), int4_extras=opts.int4_per_layer_tables)
    rows = _genie_row_scales(b, tensors)
    for name in rows:
        formats.pop(name, None)
    write_host_tensors(tmp / "host.safetensors", tensors, formats, rows)
    del tensors
    if rows:
        b.log(f"--genie-host-rows: the embedding LUT would be 4 GiB or more at 16 bits; it is "
              f"8-bit with a scale a row, and {', '.join(rows)} are held in those rows")
    release_mapped_pages(src.ckpt.dir)  # the whole checkpoint has been read once by now
    tables = ", ".join(f"{name} int{bits} (blocks of {block})"
                       for name, (bits, block) in formats.items())
    b.log(f"wrote host tensors ({(tmp / 'host.safetensors').stat().st_size / 1e9:.2f} GB"
          + (f"; {tables}" if tables else "") + ")")
    lut = (tmp / "host.safetensors").stat().st_size if opts.genie else 0  # the LUT's bound
    _say_disk(disk_need(src.fam, hf, src.targets, opts, src.fam.tower_parameters(hf), lut),
              b.out.parent, b.log)
    return host


def _cpu_target(b: _Build, host: HostRecipe, enc_specs: list[EncoderSpec]
                ) -> tuple[Manifest, list[GraphSpec]]:
    """The cpu target's graphs and the towers' float graphs, and the manifest that names them;
    -> (manifest, the towers' float graphs)."""
    src, hf, opts, tmp, log = b.src, b.hf, b.opts, b.tmp, b.log
    # --device-only: no cpu decoder graphs (the bundle would drop them); the towers' float
    # graphs are still exported to cpu/: the HTP compiles them and calibration runs them
    cpu = None if opts.device_only else _build_cpu_target(b.ctx(), src.targets[0])
    if cpu is not None and not src.htp_targets:  # a tied quantized head holds the quantized
        # embedding's bytes: stored once (--device-only has HTP targets)
        host.embed.shared = share_tied_embedding(tmp, cpu, host.embed.table)
        if host.embed.shared is not None:
            log(f"host embedding: the head's int{host.embed.shared.bits} rows in "
                f"{host.embed.shared.file} "
                f"(host tensors now {(tmp / 'host.safetensors').stat().st_size / 1e9:.2f} GB)")
    with src.fam.float32(hf):  # the encoder towers (and the text model's small tensors)
        enc_graphs = export_encoders(src.encoders, enc_specs, hf, tmp, "cpu", opts.exporter, log)
    if cpu is not None:
        cpu.graphs += enc_graphs
    return _manifest(b, host, cpu, enc_specs), enc_graphs


def _manifest(b: _Build, host: HostRecipe, cpu: TargetSpec | None, enc_specs: list[EncoderSpec]
              ) -> Manifest:
    src, args, context = b.src, b.src.args, b.opts.context
    return Manifest(
        schema_version=SCHEMA_VERSION, hexforge_version=__version__,
        family=family_name(src.ckpt.model_type), model_type=src.ckpt.model_type,
        hf_config=src.ckpt.config, context=context, vocab_size=args.vocab_size,
        hidden_size=args.hidden_size, num_layers=args.num_hidden_layers, host=host,
        mask_groups=src.fam.mask_groups(args, context), state=src.fam.state_spec(args, context),
        tokenizer=TokenizerSpec(files=src.ckpt.tokenizer_files,
                                chat_template=_has_chat_template(src.ckpt)),
        generation=_generation_defaults(src.ckpt.generation, src.ckpt.config),
        targets={} if cpu is None else {"cpu": cpu},
        encoders=enc_specs,
        report="report.json" if b.opts.verify or b.opts.estimate else None,
    )


def _htp_targets(b: _Build, manifest: Manifest, enc_graphs: list[GraphSpec],
                 enc_specs: list[EncoderSpec], residual_peak: float
                 ) -> tuple[dict[str, dict[str, str]], dict[str, dict]]:
    """Each HTP target's graphs (forge/compile/stage.py) and towers, added to the manifest, and its Genie
    folder under --genie; -> (the QDQ graphs each target was compiled from: the oracle's CPU
    twins of failed targets, the --estimate sections of report.json)."""
    src, hf, opts, tmp, log = b.src, b.hf, b.opts, b.tmp, b.log
    htp_targets = src.htp_targets
    if not htp_targets:
        return {}, {}
    from .compile.stage import build_htp_targets

    specs, qdq, estimates = build_htp_targets(b.ctx(), htp_targets, manifest, enc_graphs,
                                              residual_peak)
    manifest.targets.update(specs)
    items = None if opts.verify else [  # no oracle: each tower checked on the HTP
        example_feeds(e, spec) for e, spec in zip(src.encoders, enc_specs, strict=True)]
    for tg in htp_targets:
        soc = tg.default_soc
        assert soc is not None  # every HTP target names its SoCs (targets.py)
        manifest.targets[tg.name].graphs += compile_encoders(enc_graphs, tmp, tg, soc.soc_model,
                                                             log, items)
    if opts.genie:
        from .genie.decoder import build_genie_bundles
        from .genie.towers import build_genie_pipelines, export_nodes, media_row_bound
        from .quantize.recipe import fp16_scale

        # the towers as nodes of a Genie pipeline beside the decoder, exported first: the
        # decoder's 16-bit LUT covers the rows they can emit
        nodes = (export_nodes(b.ctx(), src.encoders, enc_specs, manifest,
                              tmp / "_work" / "genie-nodes") if src.encoders else {})
        build_genie_bundles(b.ctx(), htp_targets, manifest,
                            fp16_scale(src.fam, residual_peak, lambda m: None),
                            media_row_bound(src.encoders, enc_specs, nodes, hf, log))
        build_genie_pipelines(nodes, enc_specs, htp_targets, tmp, log)
    if not opts.verify and not opts.keep_work:
        shutil.rmtree(tmp / "_work", ignore_errors=True)
    return qdq, estimates


def _oracle(b: _Build, manifest: Manifest, qdq: dict[str, dict[str, str]],
            estimates: dict[str, dict], enc_graphs: list[GraphSpec]) -> None:
    """Every target judged against HF (forge/oracle/verify.py; the Genie folders as Genie feeds them),
    report.json written; a failed gate raises, its report kept beside the output."""
    from .oracle.quality import oracle_line
    from .oracle.verify import EvalText, Judge, hf_references, verify_bundle

    src, opts, tmp = b.src, b.opts, b.tmp
    t = time.perf_counter()
    evaluation = EvalText.of(opts.eval_text, opts.eval_tokens)
    judge = Judge.of(tmp, manifest, src.fam, b.hf, opts.verify_tokens, evaluation)
    refs = hf_references(judge)
    release_mapped_pages(src.ckpt.dir)  # the HF forward read all of it; the graphs come next
    b.log("oracle: HF references computed")
    if not manifest.encoders:  # the graphs are judged against refs alone: free the HF
        b.hf = None  # model before they load (at real sizes both do not fit)
        judge = replace(judge, hf=None)
        gc.collect()
    report = verify_bundle(tmp, judge, references=refs, qdq_twins=qdq, encoders=enc_graphs)
    if opts.genie:  # Genie returns no logits: its graphs, fed as Genie feeds them
        from .genie.verify import verify_genie_bundles

        report |= verify_genie_bundles(tmp, manifest, src.args, refs, opts.verify_tokens,
                                       evaluation.name)
    if estimates:
        from .compile.steptime import add_to_report

        report = add_to_report(report, estimates)
    if not opts.keep_work:
        shutil.rmtree(tmp / "_work", ignore_errors=True)
    b.timings["verify_s"] = time.perf_counter() - t
    (tmp / "report.json").write_text(json.dumps(report, indent=1))
    for name, r in report.items():
        b.log(f"[{name}] oracle: {oracle_line(r)}")
    _gate(report, b.out)


def _gate(report: dict[str, dict], out: Path) -> None:
    """A target that failed its gate fails the build: the per-graph cosines say which graph lost
    the accuracy, kept beside the output, not in it (no bundle is written)."""
    from .oracle.verify import qdq_verdict

    failed = {n: r["failures"] for n, r in report.items() if not r["passed"]}
    if not failed:
        return
    kept = out.with_name(out.name + ".report.json")
    kept.write_text(json.dumps(report, indent=1))
    detail = "; ".join(f"{n}: {', '.join(f)}{qdq_verdict(report[n])}" for n, f in failed.items())
    raise ParityGateError(f"parity gate failed ({detail}); the bundle was not written (its "
                          f"oracle report: {kept}; use --no-verify to skip the oracle)")


# the build option each modality's encoders may take: (spec keyword, BuildOptions field, CLI flag)
ENCODER_OPTIONS = {"audio": ("max_seconds", "audio_seconds", "--audio-seconds"),
                   "image": ("image_size", "image_size", "--image-size")}


def _check_encoder_options(encoders: list, opts: BuildOptions) -> None:
    """An encoder option given for a modality the checkpoint has no encoder for is refused, not
    dropped: a build that ignores a flag the user typed comes out unlike what was asked for."""
    have = {e.modality for e in encoders}
    for modality, (_, field_name, flag) in ENCODER_OPTIONS.items():
        if getattr(opts, field_name) is not None and modality not in have:
            raise BuildError(f"{flag} was given but this checkpoint has no {modality} encoder")


def _encoder_spec(encoder, hf, config: dict, opts: BuildOptions):
    """The encoder's manifest entry, with the build's option for its modality if one was set."""
    import inspect

    keyword, field_name, flag = ENCODER_OPTIONS[encoder.modality]
    value = getattr(opts, field_name)
    if value is None:
        return encoder.spec(hf, config)
    if keyword not in inspect.signature(encoder.spec).parameters:
        raise BuildError(f"{flag} does not apply to this checkpoint's {encoder.modality} encoder "
                         f"({type(encoder).__name__} sizes its inputs from the processor config)")
    return encoder.spec(hf, config, **{keyword: value})


def _drop_verify_twins(root: Path, manifest: Manifest) -> None:
    """The unshared twins of weight-shared targets were for the oracle only: drop them."""
    changed = False
    for t in manifest.targets.values():
        for g in t.graphs:
            if g.verify_file:
                g.verify_file = None
                changed = True
        shutil.rmtree(root / t.name / "verify", ignore_errors=True)
    if changed:
        save_manifest(root, manifest)


def _seal(tmp: Path, name: str, checkpoint, log: Log) -> None:
    """The bundle's last writes, once every other file is final: its model card, then every
    file's size and SHA-256 into the manifest (bundlefiles.py), all inside the temp dir, so the
    rename publishes them together."""
    from ..bundle.bundlefiles import record
    from ..bundle.manifest import load_manifest
    from . import modelcard
    from .source.hub import is_hub_id

    t = time.perf_counter()
    manifest = load_manifest(tmp)  # as saved: the stages after the export may have saved it again
    hub = is_hub_id(checkpoint)
    modelcard.write(tmp, manifest, name, source=str(checkpoint) if hub else Path(checkpoint).name,
                    base_model=str(checkpoint) if hub else None)
    manifest.file_records = record(tmp)
    save_manifest(tmp, manifest)
    total = sum(f.bytes for f in manifest.file_records)
    log(f"recorded {len(manifest.file_records)} files' SHA-256 ({total / 1e9:.2f} GB, "
        f"{time.perf_counter() - t:.1f}s) and the model card {modelcard.CARD}")


def _has_chat_template(ckpt) -> bool:
    if (ckpt.dir / "chat_template.jinja").is_file() or (ckpt.dir / "chat_template.json").is_file():
        return True
    cfg = ckpt.dir / "tokenizer_config.json"
    return cfg.is_file() and "chat_template" in json.loads(cfg.read_text())
