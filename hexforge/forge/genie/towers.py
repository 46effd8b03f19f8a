"""Genie pipelines: a bundle's media towers as nodes of Qualcomm's GeniePipeline, beside the
Genie decoder (forge/genie/decoder.py), so a phone's Genie runs image and audio prompts too.

    <bundle>/genie-<target>/                        (forge/genie/folder.py: the decoder's files)
      text-generator.json    {"text-generator": the dialog of genie_config.json}
      text-encoder.json      {"text-encoder": the dialog's embedding LUT and tokenizer.json}
      image-encoder.json     {"image-encoder": {engine: mode image, ctx-bins, vision-param}}
      image-encoder.bin      the tower in Genie's node contract (families/genienode.py)
      audio-encoder.json / audio-encoder.bin        (the same for an audio tower)
      genie_pipeline.json    hexforge's description: nodes, connections, which host array goes
                             to which node IO, the preprocessor (runtime/genie/pipelinemodel.py)

    prompt: text ─────────────────────────────────▶ textEncoder ─rows─▶┐ EMBEDDING_INPUT, in
            image ─host prep (runtime/vision.py)─▶ imageEncoder ─rows─▶├─▶ textGenerator ─▶ tokens
            audio ─host prep (runtime/audio.py)──▶ audioEncoder ─rows──┘  prompt order
                                              (its rows through the host: rows_via "host")

Each encoder family states its node form (``genie_node``); this module knows no family. The
node graph's float inputs become uint16 (``quantize_inputs``: Genie feeds no float input), its
QNN graph gets a name without digits (``ctxname.rename_graph``), and a media row is what the text LUT
holds for a media placeholder, the soft token in place of the token embedding
(``media_row_tail``). Measured facts behind each: docs/genie-pipelines.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ...bundle.errors import BuildError
from ..context import StageContext

PIPELINE = "genie_pipeline.json"
TEXT_GENERATOR = "text-generator.json"
TEXT_ENCODER = "text-encoder.json"
NODE = {"image": "imageEncoder", "audio": "audioEncoder"}  # genie_pipeline.json node keys
# GenieNode_IOName_t, by name (genie-app scripts spell them so); the numbers are runtime facts
# (runtime/genie/pipelinemodel.py IO)
OUTPUT_IO = {"image": "GENIE_NODE_IMAGE_ENCODER_EMBEDDING_OUTPUT",
             "audio": "GENIE_NODE_AUDIO_ENCODER_EMBEDDING_OUTPUT"}
EMBEDDING_INPUT = "GENIE_NODE_TEXT_GENERATOR_EMBEDDING_INPUT"
TEXT_INPUT, TEXT_OUTPUT = "GENIE_NODE_TEXT_ENCODER_TEXT_INPUT", "GENIE_NODE_TEXT_ENCODER_EMBEDDING_OUTPUT"
WILDCARD = "GENIE_NODE_WILDCARD"
UINT16_MAX = 65535


def lut_is_fixed_point(encoders: list) -> bool:
    """Whether a Genie folder whose nodes are these towers gets a 16-bit LUT: each proves a
    bound on its rows (``genie_row_bound``)."""
    from ...families.base import EncoderFamily

    return all(type(e).genie_row_bound is not EncoderFamily.genie_row_bound for e in encoders)


def media_row_bound(encoders: list, specs: list, nodes: dict, hf, log) -> float | None:
    """The largest |value| a media row of the Genie pipeline can hold, for the 16-bit LUT's
    range (forge/genie/folder.lut_encoding): the bound each tower that became a node
    (``nodes``, export_nodes) proves from its weights; 0.0 without nodes; None where one states
    none (the LUT then stays float32, twice the bytes: E4B's 14 GB against 7)."""
    made = [(e, s) for e, s in zip(encoders, specs, strict=True) if s.modality in nodes]
    if not lut_is_fixed_point([e for e, _ in made]):
        log("[genie] float32 embedding LUT: a Genie node's tower states no bound on its rows "
            "for a 16-bit one")
        return None
    return max((float(e.genie_row_bound(hf, s)) for e, s in made), default=0.0)


def media_row_tail(spec, host_file: Path, media_pad_id: int | None) -> np.ndarray | None:
    """What follows the soft token in a media row of Genie's embedding LUT: the other tables'
    columns (``spec.lut[1:]``, x scale) at the recipe's media_pad_id, as the host gathers them
    for a media placeholder (Gemma-4: the pad token's per-layer inputs), then the media flag's
    1.0 where the LUT has one (Qwen3-VL); None without either."""
    flag = np.ones(1, np.float32) if spec.media_flag else np.zeros(0, np.float32)
    if len(spec.lut) < 2:
        return flag if spec.media_flag else None
    if media_pad_id is None:
        raise BuildError("--genie: a media row needs the per-layer columns of a pad token, and "
                         "the host recipe names none (media_pad_id)")
    from ...bundle.hostfile import load_host_tensors

    host = load_host_tensors(host_file)
    return np.concatenate([np.asarray(host[name][media_pad_id], np.float32) * np.float32(scale)
                           for name, scale in spec.lut[1:]] + [flag])


def uint16_encoding(lo: float, hi: float) -> tuple[float, int]:
    """(scale, zero point) of uint16 over [lo, hi] (QNN's scale/offset: x = scale (q - zp)),
    the zero point rounded so that 0 (a padding value) is exact."""
    if not hi > lo:
        raise BuildError(f"a fixed-point range needs lo < hi, got [{lo}, {hi}]")
    scale = (hi - lo) / UINT16_MAX
    zp = round(-lo / scale)
    return scale, min(max(zp, 0), UINT16_MAX)


def quantize_inputs(path: Path, fixed_point: dict[str, tuple[float, float]]) -> None:
    """Each named float input of the ONNX graph made uint16 behind a DequantizeLinear (the
    com.microsoft one: the graph's opset stays), in place: the QNN EP makes it a UFIXED_POINT_16
    graph input with that scale / offset, which Genie quantizes the host's float32 to."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    for name, (lo, hi) in fixed_point.items():
        (inp,) = [i for i in g.input if i.name == name]
        if inp.type.tensor_type.elem_type != TensorProto.FLOAT:
            raise BuildError(f"{path.name}: input {name} is not float, cannot be made uint16")
        inp.type.tensor_type.elem_type = TensorProto.UINT16
        for node in g.node:
            node.input[:] = [f"{name}_dq" if x == name else x for x in node.input]
        scale, zp = uint16_encoding(lo, hi)
        g.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale"),
                              numpy_helper.from_array(np.array(zp, np.uint16), f"{name}_zp")])
        g.node.insert(0, helper.make_node("DequantizeLinear", [name, f"{name}_scale",
                                                                f"{name}_zp"], [f"{name}_dq"],
                                          domain="com.microsoft"))
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(path))


def node_config(form, binary: str) -> dict:
    """A node's Genie config (``GenieNodeConfig_createFromJson``): AI Hub's image-encoder shape
    (engine mode, QnnHtp, one binary) with the form's model keys."""
    model = {"version": 1, "type": "binary", "binary": {"version": 1, "ctx-bins": [binary]}}
    model.update(json.loads(json.dumps(form.model)))
    return {form.role: {"version": 1, "engine": {
        "version": 1, "mode": form.mode,
        "backend": {"version": 1, "type": "QnnHtp", "extensions": "htp_backend_ext_config.json",
                    "QnnHtp": {"version": 1, "spill-fill-bufsize": 0, "use-mmap": False,
                               "allow-async-init": False, "pooled-output": False}},
        "model": model}}}


def text_encoder_config(dialog_config: dict) -> dict:
    """The text-encoder node (AI Hub's ``lut`` one): Genie tokenizes each text piece with the
    bundle's tokenizer.json and appends its rows of the dialog's embedding LUT. Text goes
    through it rather than as the host's rows on the generator's embedding input: Genie counts
    a row set there as 4 tokens when it places an image after it (its M-RoPE positions and
    deepstack rows then start 3 rows late; measured, docs/genie-pipelines.md)."""
    emb = dialog_config["dialog"]["embedding"]
    lut = {"version": 1} | {k: emb[k] for k in ("lut-path", "size", "datatype", "quant-param")
                            if k in emb}  # the dialog's own LUT, as it stores it
    return {"text-encoder": {"version": 1, "type": "lut", "lut": lut,
                             "tokenizer": {"version": 1,
                                           "path": dialog_config["dialog"]["tokenizer"]["path"]}}}


def text_generator_config(dialog_config: dict) -> dict:
    """The text-generator node: the Genie dialog's config under Genie's node key (AI Hub ships
    the same body as genie_config.json's ``dialog`` and as text-generator.json's)."""
    return {"text-generator": json.loads(json.dumps(dialog_config["dialog"]))}


def pipeline_description(forms: dict, specs: dict, lut_width: int,
                         rows_encoding: list[float] | None = None) -> dict:
    """genie_pipeline.json: the nodes, their connections (each node-routed encoder's embeddings
    into the text-generator; a WILDCARD pair where the encoder has side outputs the generator
    reads by name), and per modality the node IO each host array goes to, the fixed-point
    range of each (the host refuses values past it) and how its rows reach the generator.
    ``rows_encoding``: an 8-bit LUT's graph-input encoding [scale, zero_point], which rows the
    host hands the generator must be in (libGenie 1.21 takes them as that input's 16-bit codes:
    float32 rows gave other tokens from the 4th, tiny Gemma-4 with a recording)."""
    nodes = {"textGenerator": TEXT_GENERATOR, "textEncoder": TEXT_ENCODER}
    connections = [["textEncoder", TEXT_OUTPUT, "textGenerator", EMBEDDING_INPUT]]
    media = {}
    for modality, form in forms.items():
        key = NODE[modality]
        nodes[key] = f"{form.role}.json"
        side = [n for n, _ in form.module.io.outputs][1:]
        if form.rows_via == "node":
            connections.append([key, OUTPUT_IO[modality], "textGenerator", EMBEDDING_INPUT])
            if side:  # after the embedding connection, as Genie wants it
                connections.append([key, WILDCARD, "textGenerator", WILDCARD])
        elif side:
            raise BuildError(f"a {form.role} node whose rows pass through the host cannot hand "
                             f"its side outputs ({', '.join(side)}) to the text-generator")
        spec = specs[modality]
        media[modality] = {"node": key, "encoder": spec.name, "rows": form.rows_via,
                           "output": OUTPUT_IO[modality], "inputs": dict(form.feeds),
                           "fixed_point": {k: list(v) for k, v in form.fixed_point.items()},
                           "side_outputs": side, "model": form.model}
    return {"version": 1, "nodes": nodes, "connections": connections, "media": media,
            "text": {"node": "textEncoder", "input": TEXT_INPUT, "lut_width": lut_width,
                     **({"rows_encoding": rows_encoding} if rows_encoding else {})},
            "rows_input": EMBEDDING_INPUT}


def export_nodes(ctx: StageContext, encoders: list, specs: list, manifest, work: Path
                 ) -> dict[str, tuple[object, Path]]:
    """Each tower that states a Genie node form, exported once (the graph is arch-independent)
    with its fixed-point inputs: {modality: (form, onnx path)}; the others are said and left
    out (their media are refused by ``--backend genie``)."""
    hf, fam, args, root, log = ctx.hf, ctx.fam, ctx.args, ctx.root, ctx.log
    exporter = ctx.opts.exporter
    from ...bundle.errors import UnsupportedModelError
    from ..export.onnxexport import export_module, share_weights

    gspec = fam.genie_spec(hf, args)
    if not gspec.lut:
        log(f"[genie] no pipeline: {args.model_type}'s Genie decoder takes token ids (its "
            "genie_spec has no embedding LUT), so no tower's rows can reach it")
        return {}
    tail = media_row_tail(gspec, root / "host.safetensors", manifest.host.media_pad_id)
    out = {}
    work.mkdir(parents=True, exist_ok=True)
    for enc, spec in zip(encoders, specs, strict=True):
        t = time.perf_counter()
        # built in fp32 too, not only exported: a tower's module computes tables from the HF
        # weights as it is made (the conformer's relative-position keys), which a bf16
        # checkpoint's weights would refuse against fp32 inputs (regression: real-size E4B)
        with fam.float32(hf):
            try:
                form = enc.genie_node(hf, spec, tail)
            except UnsupportedModelError as e:
                log(f"[genie] {spec.modality} left out of the Genie pipeline: {e}")
                continue
            path = work / f"{form.role}.onnx"
            export_module(form.module, path, exporter)
        share_weights([path], f"{form.role}.weights")
        quantize_inputs(path, form.fixed_point)
        log(f"  exported Genie {form.role} node ({time.perf_counter() - t:.1f}s)")
        out[spec.modality] = (form, path)
        geniex = getattr(enc, "geniex_node", None)
        if geniex is not None:  # GenieX's own vision graph (forge/genie/geniex.py VISION_ENCODER)
            with fam.float32(hf):
                gform = geniex(hf, spec, tail)
                gpath = work / "geniex-vision.onnx"
                export_module(gform.module, gpath, exporter)
            share_weights([gpath], "geniex-vision.weights")
            quantize_inputs(gpath, gform.fixed_point)
            out[f"geniex:{spec.modality}"] = (gform, gpath)
    return out


def build_genie_pipelines(nodes: dict, specs: list, targets, root: Path, log) -> None:
    """For each HTP target's Genie folder (forge/genie/decoder.py made it), the towers exported
    as Genie nodes (``export_nodes``): compiled per arch, their node configs,
    text-generator.json and genie_pipeline.json."""
    from ..compile.contexts import compile_graph
    from . import geniex
    from .ctxname import rename_graph
    from .folder import CONFIG, LUT_INPUT, folder_name

    if not nodes:
        return
    work = root / "_work" / "genie-nodes"
    by_modality = {s.modality: s for s in specs}
    for target in targets:
        folder = root / folder_name(target.name)
        soc = target.default_soc.soc_model
        forms = {}
        for modality, (form, path) in nodes.items():
            if modality.startswith("geniex:"):
                continue
            res = compile_graph(path, work / f"{target.name}-{form.role}.ctx.onnx",
                                target.htp_arch, soc, fp16=True)
            # no digits in the name: Genie's image and audio models read a graph's token count
            # from its name when the tensors do not tell it, and the digits of onnxruntime's hash
            # make that parse fail ("stoi: out of range", measured)
            rename_graph(res["ctx"], res["bin"], form.role.replace("-", "_"), keep_digits=False)
            binary = folder / f"{form.role}.bin"
            res["bin"].replace(binary)
            (folder / f"{form.role}.json").write_text(
                json.dumps(node_config(form, binary.name), indent=1) + "\n")
            forms[modality] = form
            log(f"[{target.name}] Genie {form.role} node: {binary.stat().st_size:,} B "
                f"({res['seconds']:.1f}s)")
        dialog = json.loads((folder / CONFIG).read_text())
        (folder / TEXT_GENERATOR).write_text(json.dumps(text_generator_config(dialog), indent=1)
                                             + "\n")
        (folder / TEXT_ENCODER).write_text(json.dumps(text_encoder_config(dialog), indent=1)
                                           + "\n")
        width = int(dialog["dialog"]["embedding"]["size"])
        note = root / "_work" / "genie" / LUT_INPUT  # an 8-bit LUT's (decoder.py wrote it)
        enc = json.loads(note.read_text()) if note.is_file() else None
        (folder / PIPELINE).write_text(json.dumps(
            pipeline_description(forms, by_modality, width, enc), indent=1) + "\n")
        if "geniex:image" in nodes and (folder / geniex.METADATA).is_file():
            form, path = nodes["geniex:image"]
            res = compile_graph(path, work / f"{target.name}-geniex-vision.ctx.onnx",
                                target.htp_arch, soc, fp16=True)
            rename_graph(res["ctx"], res["bin"], "vision_encoder", keep_digits=False)
            res["bin"].replace(folder / geniex.VISION_ENCODER)
            image = by_modality["image"]
            geniex.add_vision_encoder(folder, path, image.params,
                                      {"vision_start": image.begin_id,
                                       "image_pad": image.placeholder_id})
            log(f"[{target.name}] GenieX {geniex.VISION_ENCODER}: "
                f"{(folder / geniex.VISION_ENCODER).stat().st_size:,} B ({res['seconds']:.1f}s)")
