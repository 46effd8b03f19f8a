"""The decoder re-exported in the I/O contract of Qualcomm's Genie runtime, then compiled.

Genie (``libGenie.so``, what AI Hub's phone bundles run) drives QNN context binaries itself: it
makes the attention mask and the rope tables, keeps the KV cache, feeds token ids and reads
logits. It finds all of that by tensor name and shape (docs/genie.md has the evidence), so the
graphs hexforge's own runtime drives (``hidden`` in, host-made cos/sin, ``past.L{i}.k``
[1, KVH, S, D], head as a graph of its own) are wrapped into AI Hub's contract:

    per AR in (prefill_len, 1), one graph with every decoder layer and the head:
      input_ids          int32 [1, AR]           the embedding gather is in the graph
      attention_mask     f32   [1, 1, AR, CL]    additive; Genie writes it
      position_ids_cos   f32   [1, 1, AR, D/2]   Genie computes them (rope-theta, rope-dim D/2)
      position_ids_sin   f32   [1, 1, AR, D/2]
      past_key_{L}_in    f32   [KVH, 1, D, CL-AR]   keys transposed
      past_value_{L}_in  f32   [KVH, 1, CL-AR, D]
    ->
      logits             f32   [1, AR, V]
      past_key_{L}_out   f32   [KVH, 1, D, AR]
      past_value_{L}_out f32   [KVH, 1, AR, D]

The inner modules are hexforge's own (``fam.decoder_module`` / ``fam.head_module`` in the fp16
form), so the arithmetic is the arithmetic the oracle checked; only the boundary changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import BuildError
from ..families.graphio import GraphIO


@dataclass(frozen=True)
class GenieForm:
    """Which parts of the Genie contract an export takes (the probe walks them one by one;
    ``GenieForm()`` is the whole contract)."""

    names: bool = True  # Genie's tensor names (else hexforge's: hidden, mask_full, past.L0.k ..)
    genie_kv_layout: bool = True  # keys [KVH, 1, D, S], values [KVH, 1, S, D] (else [1, KVH, S, D])
    past_is_cl_minus_ar: bool = True  # past rows CL - AR, mask CL wide (else past CL, mask CL + AR)
    half_rope: bool = True  # cos/sin [1, 1, AR, D/2] (else hexforge's [1, AR, D])
    with_head: bool = True  # logits out of the same graph (else hidden_out, head separate)
    token_ids: bool = True  # input_ids + the gather in the graph (else the embedded hidden)
    embeds_name: str = "input_embeds"  # the embedded input's name without token_ids (AI Hub's)
    sanitize_past: bool = True  # masked past slots zeroed in the graph (Genie leaves them dirty)


class GenieStep(nn.Module):
    """A whole-decoder step in Genie's I/O contract around hexforge's shard and head modules."""

    def __init__(self, shard: nn.Module, head: nn.Module | None, embed: torch.Tensor | None,
                 embed_scale: float, args, seq_len: int, past_len: int, form: GenieForm):
        super().__init__()
        self.shard, self.head, self.form = shard, head, form
        self.embed = nn.Parameter(embed, requires_grad=False) if embed is not None else None
        self.embed_scale = float(embed_scale)
        self.n_kv, self.head_dim, self.hidden = args.num_key_value_heads, args.head_dim, args.hidden_size
        self.T, self.S = seq_len, past_len
        layers = shard.layer_ids
        f = form
        n = (lambda genie, ours: genie if f.names else ours)  # noqa: E731
        ins = [(n("input_ids" if f.token_ids else f.embeds_name, "hidden"), "tokens"),
               (n("attention_mask", "mask_full"), "mask"),
               (n("position_ids_cos", "cos"), "rope_cos"), (n("position_ids_sin", "sin"), "rope_sin")]
        outs = [(n("logits", "logits") if f.with_head else n("hidden_states", "hidden_out"),
                 "logits" if f.with_head else "hidden")]
        for i in layers:
            for kv, word in (("k", "key"), ("v", "value")):
                ins.append((n(f"past_{word}_{i}_in", f"past.L{i}.{kv}"), f"state:L{i}.{kv}"))
                outs.append((n(f"past_{word}_{i}_out", f"new.L{i}.{kv}"), f"state:L{i}.{kv}"))
        self.io = GraphIO(inputs=ins, outputs=outs)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        f, T, S, KV, D = self.form, self.T, self.S, self.n_kv, self.head_dim
        tokens = (torch.zeros(1, T, dtype=torch.int32) if f.token_ids
                  else torch.randn(1, T, self.hidden))
        mask = torch.zeros(1, 1, T, S + T)
        R = D // 2 if f.half_rope else D
        rope_shape = (1, 1, T, R) if f.half_rope else (1, T, R)
        past = []
        for _ in self.shard.layer_ids:
            if f.genie_kv_layout:
                past += [torch.zeros(KV, 1, D, S), torch.zeros(KV, 1, S, D)]
            else:
                past += [torch.zeros(1, KV, S, D), torch.zeros(1, KV, S, D)]
        return (tokens, mask, torch.ones(rope_shape), torch.zeros(rope_shape), *past)

    def forward(self, tokens, mask, cos, sin, *past):
        f = self.form
        if f.token_ids:
            # int32 ids gathered as they come: a Cast to int64 would be a node the HTP refuses
            hidden = torch.nn.functional.embedding(tokens, self.embed)
            if self.embed_scale != 1.0:
                hidden = hidden * self.embed_scale
        else:
            hidden = tokens
        if f.half_rope:  # Genie's tables hold each frequency once; HF's cos is cat(f, f)
            cos = torch.cat([cos, cos], dim=-1)[:, 0]
            sin = torch.cat([sin, sin], dim=-1)[:, 0]
        if f.genie_kv_layout:
            ours = []
            for j in range(0, len(past), 2):
                ours += [past[j].permute(1, 0, 3, 2), past[j + 1].permute(1, 0, 2, 3)]
            past = ours
        if f.sanitize_past:
            # Genie does not clear float caches: a dialog made after another in one process
            # reads the freed buffers' bytes (5e27 in a masked slot: q.k overflows fp16 and the
            # -1000 of Genie's mask no longer masks it). A past slot row 0 does not attend to
            # is zeroed, so nothing read from a masked slot can reach the output.
            keep = (mask[:, :, :1, :self.S] > -1.0).transpose(2, 3)  # [1, 1, S, 1]
            past = [torch.where(keep, p, torch.zeros_like(p)) for p in past]
        out, *new = self.shard(hidden, cos, sin, mask, *past)
        if f.genie_kv_layout:
            new = [t.permute(1, 0, 3, 2) if j % 2 == 0 else t.permute(1, 0, 2, 3)
                   for j, t in enumerate(new)]
        if self.head is not None:
            out = self.head(out)
        return (out, *new)


def genie_step(fam, hf, args, host, seq_len: int, context: int, form: GenieForm,
               residual_scale: float) -> GenieStep:
    """The whole decoder (one shard) + head for AR ``seq_len`` and context ``context``, in the
    fp16 form of HTP graphs."""
    from ..families.blocks import use_fp16_form

    past = context - seq_len if form.past_is_cl_minus_ar else context
    layers = (0, args.num_hidden_layers)
    shard = use_fp16_form(fam.decoder_module(hf, args, layers, seq_len, past), residual_scale)
    head = (use_fp16_form(fam.head_module(hf, args), residual_scale) if form.with_head else None)
    embed = (fam.text_model(hf).embed_tokens.weight.detach().float().clone()
             if form.token_ids else None)
    return GenieStep(shard, head, embed, host.embed.scale, args, seq_len, past, form)


def graph_name(seq_len: int, context: int) -> str:
    """AI Hub's naming (``prompt_ar128_cl4096_1_of_1``): Genie reads AR and CL from names like it
    when the tensors do not tell it."""
    kind = "token" if seq_len == 1 else "prompt"
    return f"{kind}_ar{seq_len}_cl{context}_1_of_1"


def export_genie_graphs(fam, hf, args, host, folder: Path, prefill_len: int, context: int,
                        form: GenieForm, residual_scale: float, exporter: str, log) -> list[Path]:
    """One ONNX graph per AR (prefill, then decode) in ``folder``, weights shared in one file.
    -> the graph paths."""
    from .export import export_module, share_weights

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    with fam.float32(hf, layers=(0, args.num_hidden_layers), head=True, towers=False):
        for T in dict.fromkeys((prefill_len, 1)):
            module = genie_step(fam, hf, args, host, T, context, form, residual_scale)
            path = folder / f"{graph_name(T, context)}.onnx"
            t = time.perf_counter()
            export_module(module, path, exporter, fold=True)
            log(f"  exported {path.name} ({time.perf_counter() - t:.1f}s)")
            paths.append(path)
    share_weights(paths, "genie.weights")
    return paths


def compile_genie_graphs(paths: list[Path], work: Path, out: Path | None, htp_arch: int,
                         soc_model: int, log) -> list[Path]:
    """Each graph to its own context binary in ``work`` (beside the EPContext model the oracle
    loads it by, ``genie_verify``), linked into ``out/<name>.bin`` (Genie's ctx-bins list) unless
    ``out`` is None (the unshared twins of a weight-shared bundle). -> the binaries in ``out``."""
    from .htp.compile import compile_graph

    work.mkdir(parents=True, exist_ok=True)
    bins = []
    for src in paths:
        name = src.name.split(".")[0]  # prompt_ar16_cl128_1_of_1(.wo).onnx
        res = compile_graph(src, work / f"{name}.ctx.onnx", htp_arch, soc_model, fp16=True)
        log(f"  compiled {name}: {res['bin_bytes']:,} B ({res['seconds']:.1f}s)")
        if out is not None:
            binary = out / f"{name}.bin"
            _link(res["bin"], binary)
            bins.append(binary)
    return bins


def _link(src: Path, dst: Path) -> None:
    """``dst`` the same bytes as ``src`` (a hard link where the filesystem allows)."""
    import os
    import shutil

    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def check_family(fam, args) -> None:
    """Genie's decoder model types express a dense decoder with one KV cache group: refuse the
    families whose state or inputs it has no place for (docs/genie.md says which and why)."""
    from ..families.base import DecoderFamily

    own = type(fam).decoder_module is not DecoderFamily.decoder_module
    if own or getattr(args, "layer_types", None):
        raise BuildError(f"--genie: {args.model_type} is not a dense single-cache decoder; Genie "
                         "bundles are built for llama / qwen2 / qwen3 (docs/genie.md)")


def check_options(fam, args, opts) -> None:
    """Refuse a --genie build Genie bundles are not made for, before any work."""
    from .htp.recipes import get_recipe

    check_family(fam, args)
    recipe = get_recipe(opts.quant)
    if recipe.activations is not None:
        raise BuildError(f"--genie: --quant {opts.quant} (fixed-point activations) is not built "
                         "for Genie; use fp16, w8a16 or w4a16")
    if opts.prefill_len >= opts.context or opts.prefill_len < 2:
        raise BuildError("--genie needs 2 <= --prefill-len < --context (Genie's AR-N graph)")


def build_genie_bundles(fam, hf, args, targets, opts, root: Path, manifest, residual_scale: float,
                        log) -> dict[str, Path]:
    """For each HTP target, ``root/genie-<target>/``: the decoder in Genie's contract
    (``GenieStep``), weight-only quantized like the target's graphs when the recipe says so,
    compiled per arch, with genie_config.json, htp_backend_ext_config.json and tokenizer.json
    (build/genie_bundle.py). -> {target name: folder}."""
    from .genie_bundle import folder_name, write_bundle_files
    from .graphs import plan_target
    from .htp.recipes import get_recipe

    recipe = get_recipe(opts.quant)
    work = root / "_work" / "genie"
    host = manifest.host
    paths = None
    out = {}
    for target in targets:
        shards = plan_target(fam, hf, target, opts, lambda m: None)
        if len(shards) > 1:  # splits pass the hidden state by name: not made (or seen) yet
            raise BuildError(f"--genie: the decoder needs {len(shards)} contexts on {target.name}; "
                             "Genie bundles are built for models that fit one")
        if paths is None:  # the graphs are arch-independent: exported once
            t = time.perf_counter()
            paths = export_genie_graphs(fam, hf, args, host, work, opts.prefill_len, opts.context,
                                        GenieForm(), residual_scale, opts.exporter, log)
            if recipe.weight_only:
                paths = _weight_only(paths, recipe, args.vocab_size)
            log(f"[genie] exported {len(paths)} graphs ({time.perf_counter() - t:.1f}s)")
        folder = root / folder_name(target.name)
        folder.mkdir()
        soc = target.default_soc.soc_model
        say = (lambda m, t=target.name: log(f"[{t}] genie {m.strip()}"))  # noqa: E731
        if opts.share_weights:  # devices: one context for both variants (Genie's usual bundle)
            from .htp.compile import compile_shared

            res = compile_shared([(p, work / f"{target.name}-{p.stem}.ctx.onnx") for p in paths],
                                 target.htp_arch, soc, fp16=True)
            bins = [folder / "decoder_1_of_1.bin"]
            res["bin"].replace(bins[0])
            if opts.verify:  # the simulator loads no shared context: the oracle's twins
                compile_genie_graphs(paths, work / target.name, None, target.htp_arch, soc, say)
        else:
            bins = compile_genie_graphs(paths, work / target.name, folder, target.htp_arch, soc,
                                        say)
        write_bundle_files(folder, manifest, bins, root / manifest.tokenizer.dir / "tokenizer.json",
                           soc, target.htp_arch, args.head_dim, weight_sharing=opts.share_weights)
        log(f"[{target.name}] Genie bundle {folder.name}/ ({len(bins)} context binaries)")
        out[target.name] = folder
    return out


def _weight_only(paths: list[Path], recipe, vocab_size: int) -> list[Path]:
    """MatMulNBits weights, as ``htp.weight_only`` makes the target's graphs (the embedding
    gather stays fp16: the HTP has no NBits gather)."""
    import onnx

    from .export import share_weights
    from .nbits import quantize_cpu_graph

    out = []
    for p in paths:
        dst = p.with_name(p.stem + ".wo.onnx")
        onnx.save(onnx.load(str(p), load_external_data=False), str(dst))
        quantize_cpu_graph(dst, recipe.weight_bits, recipe.block_size, vocab_size,
                           whole_blocks=True)
        out.append(dst)
    share_weights(out, "genie.wo.weights")
    return out
