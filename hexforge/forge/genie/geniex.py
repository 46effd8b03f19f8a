"""GenieX's files beside a Genie folder: ``metadata.json`` and ``tokenizer_config.json``.

GenieX (Qualcomm's newer runtime) loads a compiled QNN bundle through its QAIRT plugin
(github qualcomm/geniex-qairt-plugin, read at ``PLUGIN_COMMIT``; docs/genie.md "GenieX"). The
plugin reads what a Genie folder holds plus two files it does not::

    <bundle>/genie-<target>/
      metadata.json          model_id (its prefix picks the family factory, models/dispatch.h);
                             model_files: per graph "[phase_]ar<N>_cl<C>_<i>_of_<n>" its inputs
                             and outputs {shape, dtype, quantization_parameters} (AI Hub's
                             export schema); the plugin infers hidden size, KV heads, head dim,
                             vocab and layer count from those shapes (core/src/llm/llm_spec_loader.cpp)
      tokenizer_config.json  the checkpoint's, its ``chat_template`` filled in: the plugin's
                             pipeline refuses a tokenizer_config.json without one

A family the plugin cannot take (``refusal``) gets neither file; the model card says why. What
the plugin would still refuse in a folder that gets them (``blockers``) is written into
metadata.json's ``hexforge`` block, which the loader does not read, and onto the model card.
Nothing here has run through GenieX: the rules are the plugin's source, read, not executed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

METADATA = "metadata.json"
VISION_ENCODER = "vision_encoder.bin"  # the plugin's Qwen3-VL vision graph (GenieX vlm.cpp)
EMBEDDING = "embedding_weights.raw"  # its CPU-side table: vocab x hidden float32, headerless
# models/qwen3_vl/qwen3_vl.h: the token ids the plugin's Qwen3-VL model takes as constants
QWEN3_VL_IDS = {"vision_start": 151652, "image_pad": 151655}
VISION_ROPE = 32  # qwen3_vl.h kVitRopeDim: position_ids_cos / _sin are [patches, 32]
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
PLUGIN = "qualcomm/geniex-qairt-plugin"
PLUGIN_COMMIT = "fb1c582bad66efbfa02dac83f5cc0f31afd26ee1"

# HF model_type -> the model_id prefix models/dispatch.h routes to a factory that builds the
# model from metadata.json + genie_config.json alone (llama3 / qwen2_5 / qwen3: the same
# embedding + rope providers; qwen3_vl: the VLM factory). Gemma is not dispatched at the commit.
MODEL_ID_PREFIX = {"llama": "llama_v3_", "mistral": "llama_v3_", "qwen2": "qwen2_5_",
                   "qwen3": "qwen3_", "qwen3_vl": "qwen3_vl_"}
VLM = frozenset({"qwen3_vl"})  # makeVLMPipeline's families (makeLLMPipeline refuses qwen3_vl_)
# parseRopeScaling's types; any other rope-scaling it reads as plain rope
ROPE_TYPES = frozenset({"default", "llama3", "longrope", "partial", "qwen2vl-mrope",
                        "qwen3vl-mrope"})
# the graph names parseGraphName / LLMModel::onInitialized take (std::regex_match: whole name)
GRAPH_NAME = re.compile(r"(?:([a-zA-Z]+)_)?ar(\d+)_cl(\d+)_(\d+)_of_(\d+)")
# ONNX element types -> AI Hub's dtype strings (the ones Graph::write / read convert)
DEEPSTACK = "deepstack_visual_embeds_"
VISUAL_POS_MASKS = "visual_pos_masks"
DTYPES = {1: "float32", 10: "float16", 6: "int32", 7: "int64", 4: "uint16", 2: "uint8",
          3: "int8", 5: "int16", 9: "bool"}


def refusal(model_type: str, config: dict) -> str | None:
    """Why the plugin cannot take a Genie folder of ``model_type`` with ``config`` (its
    genie_config.json), or None."""
    model = config["dialog"]["engine"]["model"]
    if model.get("linear-attention"):
        return ("its layers carry a linear-attention state; the plugin's LLMModel keeps a KV "
                "cache only")
    if model_type not in MODEL_ID_PREFIX:
        return (f"the plugin's dispatcher (models/dispatch.h at {PLUGIN_COMMIT[:7]}) has no "
                f"model_id prefix for {model_type}")
    groups = config["dialog"]["engine"].get("cache-groups", [])
    if any("cache-index-tensor-name" in g for g in groups):
        return ("the scatter form (--genie-kv scatter: a cache_index input, the past CL rows); "
                "the plugin's loader feeds no cache_index (--genie-kv concat is its layout)")
    pe = model.get("positional-encoding")
    if isinstance(pe, list) or "cache-groups" in config["dialog"]["engine"]:
        return "several ropes or cache groups; the plugin reads one rope and one KV group"
    kind = (pe.get("rope-scaling") or {}).get("rope-type", "default")
    if kind not in ROPE_TYPES:
        return f"rope-scaling {kind!r}, which the plugin's loader computes as plain rope"
    kv_dim = config["dialog"]["engine"]["backend"]["QnnHtp"]["kv-dim"]
    if 2 * int(pe["rope-dim"]) != int(kv_dim):
        return (f"a rope over {2 * int(pe['rope-dim'])} of {kv_dim} head dims; the plugin "
                "rotates the whole head (head_dim/2 frequencies)")
    return None


def _quantization(model, name: str, output: bool) -> dict | None:
    """{scale, zero_point} of a fixed-point graph input (its DequantizeLinear) or output (its
    QuantizeLinear): what the QNN EP makes the tensor's scale-offset encoding."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        hit = (node.op_type == "QuantizeLinear" and node.output[0] == name) if output else (
            node.op_type == "DequantizeLinear" and node.input[0] == name)
        if hit and node.input[1] in inits and len(node.input) > 2 and node.input[2] in inits:
            scale = numpy_helper.to_array(inits[node.input[1]])
            zero = numpy_helper.to_array(inits[node.input[2]])
            return {"scale": float(scale), "zero_point": int(zero)}
    return None


def graph_io(path: Path) -> dict:
    """One graph's {"inputs": {name: spec}, "outputs": ...} from the ONNX model it was compiled
    from (the EPContext model keeps the same I/O), spec = {shape, dtype,
    quantization_parameters}."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def spec(value, output: bool) -> dict:
        t = value.type.tensor_type
        dtype = DTYPES.get(t.elem_type, onnx.TensorProto.DataType.Name(t.elem_type).lower())
        q = _quantization(model, value.name, output) if dtype.startswith("uint") else None
        return {"shape": [int(d.dim_value) for d in t.shape.dim], "dtype": dtype,
                "quantization_parameters": q}

    return {"inputs": {v.name: spec(v, False) for v in model.graph.input},
            "outputs": {v.name: spec(v, True) for v in model.graph.output}}


def _special(name: str) -> bool:
    """llm_utils.cpp isSpecialTensor: not the hidden-state stream (mask, ropes, KV)."""
    kv = name.endswith(("_in", "_out")) and ("key" in name or "value" in name)
    return kv or name in ("attention_mask", "position_ids", "position_ids_cos",
                          "position_ids_sin")


def loader_hidden(io: dict) -> tuple[str, int] | None:
    """The tensor and hidden size parseQAIRTMetadata infers from shard 1: the last dim of its
    first non-special input in key order (its json object is a std::map) when that is of rank
    >= 3, else of its first non-special output when that is."""
    for side in ("inputs", "outputs"):
        plain = [(k, t["shape"]) for k, t in sorted(io[side].items()) if not _special(k)]
        if plain and len(plain[0][1]) >= 3:
            return plain[0][0], plain[0][1][-1]
    return None


def blockers(model_type: str, files: dict, folder: Path) -> list[str]:
    """What the plugin would still refuse in a folder that gets metadata.json."""
    out = []  # (the QNN graph names inside the binaries take its rule: forge/genie/ctxname.py)
    first = next(io for name, io in sorted(files.items())
                 if (m := GRAPH_NAME.fullmatch(name)) and m.group(4) == "1")
    embeds = first["inputs"].get("inputs_embeds")
    inferred = loader_hidden(first)
    if embeds is not None and (inferred is None or inferred[1] != embeds["shape"][-1]):
        out.append(f"the loader infers the hidden size from {inferred and inferred[0]} (shard "
                   "1's first non-special input in key order is not of rank 3), not from "
                   f"inputs_embeds' {embeds['shape'][-1]}")
    if embeds is not None and model_type not in VLM and not any(
            (folder / f).is_file() for f in ("embedding_weights.raw", "embed_tokens.npy")):
        out.append("the graphs take inputs_embeds and the plugin reads its embedding table "
                   "from embedding_weights.raw or embed_tokens.npy (Genie's LUT is "
                   "genie_config.json's lut-path)")
    if model_type in VLM:
        out += vlm_blockers(files, folder, inferred[1] if inferred else 0)
    return out


def _elements(t: dict) -> int:
    n = 1
    for d in t["shape"]:
        n *= d
    return n


def vlm_blockers(files: dict, folder: Path, hidden: int) -> list[str]:
    """What the plugin's Qwen3-VL path (models/qwen3_vl/qwen3_vl.cpp, vlm_input_provider.cpp)
    would refuse or misread in the folder: its vision graph, preprocessing block, embedding
    table, deepstack mask and the token ids it takes as constants."""
    out = []
    meta = json.loads((folder / METADATA).read_text()) if (folder / METADATA).is_file() else {}
    vp = meta.get("vision_preprocessing")
    vision = files.get(VISION_ENCODER)
    if not (folder / VISION_ENCODER).is_file() or vision is None or vp is None:
        return ["no vision_encoder.bin with its model_files entry and vision_preprocessing "
                "block (qwen3_vl.cpp makeModel refuses a bundle without them)"]
    p, m = vp["patch_size"], vp["spatial_merge_size"]
    patches = (vp["image_height"] // p) * (vp["image_width"] // p)
    tokens = patches // (m * m)
    ins, outs = vision["inputs"], vision["outputs"]
    want_in = {"pixel_values": patches * 3 * vp["temporal_patch_size"] * p * p,
               "position_ids_cos": patches * VISION_ROPE, "position_ids_sin": patches * VISION_ROPE}
    for name, n in want_in.items():  # Graph::write throws on a missing name or a short buffer
        if name not in ins or _elements(ins[name]) < n:
            out.append(f"vision_encoder.bin's {name} must hold {n} values")
    for name in ["image_features"] + [k for k in outs if k.startswith(DEEPSTACK)]:
        if name not in outs or _elements(outs[name]) != tokens * hidden:  # read S x hidden
            out.append(f"vision_encoder.bin's {name} must hold {tokens} x {hidden} values")
    table = folder / EMBEDDING
    vocab = next((io["outputs"]["logits"]["shape"][-1] for io in files.values()
                  if "logits" in io["outputs"]), 0)
    if not table.is_file() or table.stat().st_size != vocab * hidden * 4:
        out.append(f"{EMBEDDING} must be {vocab} x {hidden} float32 (the loader's vocab and "
                   "hidden size)")
    for name, io in files.items():
        if name == VISION_ENCODER:
            continue
        ds = [k for k in io["inputs"] if k.startswith(DEEPSTACK)]
        mask = io["inputs"].get(VISUAL_POS_MASKS)
        if ds and (mask is None or mask["dtype"] not in ("bool", "uint8", "int8")):
            out.append(f"{name}: deepstack inputs without a 1-byte {VISUAL_POS_MASKS} (the "
                       "plugin writes the deepstack rows only to a graph with that mask)")
        if any(_elements(io["inputs"][k]) % hidden for k in ds):
            out.append(f"{name}: deepstack rows not {hidden} wide")
    ids = (meta.get("hexforge") or {}).get("token_ids") or {}
    if ids and ids != QWEN3_VL_IDS:
        out.append(f"the plugin's Qwen3-VL token ids are constants {QWEN3_VL_IDS} (qwen3_vl.h), "
                   f"this checkpoint's are {ids}: its image tokens would read as text")
    return out


def add_vision_encoder(folder: Path, graph: Path, params: dict, token_ids: dict) -> None:
    """A Qwen3-VL folder's GenieX vision side, once ``vision_encoder.bin`` sits in it (compiled
    from ``graph``): its model_files entry, the vision_preprocessing block (image size, patch,
    merge, mean / std: the plugin's processor config), ``embedding_weights.raw`` (the LUT's
    first vocab rows: embedding.f32 holds one more, so it cannot be a second name of it) and
    the blockers again."""
    import shutil

    meta = json.loads((folder / METADATA).read_text())
    files = meta["model_files"]
    files[VISION_ENCODER] = graph_io(graph)
    meta["vision_preprocessing"] = {
        "image_height": params["height"], "image_width": params["width"],
        "patch_size": params["patch_size"], "temporal_patch_size": params["temporal_patch_size"],
        "spatial_merge_size": params["merge_size"],
        "normalize_mean": params["image_mean"], "normalize_std": params["image_std"]}
    meta["genie"]["supports_vision"] = True
    meta["hexforge"]["token_ids"] = token_ids
    config = json.loads((folder / "genie_config.json").read_text())
    lut = folder / config["dialog"]["embedding"]["lut-path"]
    width = int(config["dialog"]["embedding"]["size"])
    vocab = next(io["outputs"]["logits"]["shape"][-1] for io in files.values()
                 if "logits" in io["outputs"])
    if config["dialog"]["embedding"].get("datatype", "float32") == "float32":
        tmp = folder / (EMBEDDING + ".partial")
        with open(lut, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(_Limited(src, vocab * width * 4), dst)
        tmp.replace(folder / EMBEDDING)
    (folder / METADATA).write_text(json.dumps(meta, indent=1) + "\n")
    model_type = next(t for t, pre in MODEL_ID_PREFIX.items() if meta["model_id"].startswith(pre)
                      and t in VLM)
    meta["hexforge"]["blockers"] = blockers(model_type, files, folder)
    (folder / METADATA).write_text(json.dumps(meta, indent=1) + "\n")


class _Limited:
    """The first ``n`` bytes of a file object, for shutil.copyfileobj."""

    def __init__(self, f, n: int):
        self.f, self.left = f, n

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = self.f.read(size)
        self.left -= len(data)
        return data


def tokenizer_config(tokenizer_dir: Path) -> dict | None:
    """The checkpoint's tokenizer_config.json with ``chat_template`` set (from
    chat_template.jinja when the config holds none), or None without a template."""
    path = tokenizer_dir / TOKENIZER_CONFIG
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    if not cfg.get("chat_template") and (tokenizer_dir / CHAT_TEMPLATE).is_file():
        cfg["chat_template"] = (tokenizer_dir / CHAT_TEMPLATE).read_text()
    return cfg if cfg.get("chat_template") else None


def write_geniex_files(folder: Path, model_type: str, graphs: list[Path], tokenizer_dir: Path
                       ) -> Path | None:
    """metadata.json and tokenizer_config.json in the finished Genie ``folder`` from the ONNX
    ``graphs`` its context binaries were compiled from (named as Genie's graphs, plus
    ``.wo`` for weight-only ones). -> metadata.json, or None for a family the plugin cannot
    take (``refusal``) or a checkpoint without a chat template."""
    config = json.loads((folder / "genie_config.json").read_text())
    if refusal(model_type, config) is not None:
        return None
    tok = tokenizer_config(tokenizer_dir)
    if tok is None:
        return None
    files = {p.name.split(".")[0]: graph_io(p) for p in graphs}
    meta = {"model_id": f"{MODEL_ID_PREFIX[model_type]}hexforge",
            "model_files": files,
            "genie": {"supports_vision": model_type in VLM},  # GenieX's LLM / VLM choice
            "hexforge": {"written_from": f"{PLUGIN}@{PLUGIN_COMMIT}",
                         "blockers": blockers(model_type, files, folder)}}
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(tok, indent=1) + "\n")
    (folder / METADATA).write_text(json.dumps(meta, indent=1) + "\n")
    return folder / METADATA


def card_line(folder: Path, model_type: str) -> str:
    """The model card's GenieX line for a Genie folder."""
    meta_path = folder / METADATA
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        found = (meta.get("hexforge") or {}).get("blockers") or []
        state = ("not loadable as built: " + "; ".join(found)) if found else "loadable by its rules"
        return (f"GenieX ({PLUGIN}): metadata.json (model_id `{meta.get('model_id')}`) and "
                f"tokenizer_config.json written by the loader's rules at {PLUGIN_COMMIT[:7]}; "
                f"{state}. Nothing has run through GenieX.")
    config = json.loads((folder / "genie_config.json").read_text())
    why = refusal(model_type, config) or "the checkpoint has no chat template"
    return f"GenieX: not loadable ({why})."
