"""GenieX's metadata.json (forge/genie/geniex.py) against the rules Qualcomm's geniex-qairt-plugin
applies when it loads a bundle, as read from its source at ``geniex.PLUGIN_COMMIT``:

  models/dispatch.h                 model_id prefix -> factory (LLM / VLM), "_ssd" suffix
  core/src/llm/llm_spec_loader.cpp  model_files keys, shapes -> hidden / KV heads / head dim /
                                    vocab / layers, ctx-bins, genie_config.json's fields
  core/src/llm/llm_model.cpp        two ARs, graph sort, KV layouts, attention mask size
  core/src/llm/input_provider.cpp   input_ids int32, rope rows, inputs_embeds
  core/src/graph.cpp                the dtypes Graph::write / read convert
  core/src/pipeline/llm_pipeline.cpp  tokenizer_config.json with a chat_template

Nothing here runs GenieX: a folder meeting these rules is not proven to load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hexforge.bundle.manifest import load_manifest
from hexforge.forge.genie import geniex

# dtypes Graph::write(float*) / read(float*) convert, plus int32 (input_ids, memcpy)
WRITABLE = {"float32", "float16", "uint16", "uint8", "int32"}
SPECIAL = {"attention_mask", "position_ids", "position_ids_cos", "position_ids_sin"}


@pytest.fixture(scope="module")
def llama_genie(htp_bundle):
    return htp_bundle("llama", "fp16", genie=True)


@pytest.fixture(scope="module")
def qwen3_genie(htp_bundle):
    # several splits: the residual between them, the loader's per-shard rules
    return htp_bundle("qwen3", "fp16", genie=True, verify=False,
                      max_shard_bytes={"v81": 120_000})


@pytest.fixture(scope="module")
def vl_genie(htp_bundle):
    return htp_bundle("qwen3_vl", "fp16", genie=True, verify=False)


@pytest.fixture(scope="module")
def vl_qwen_ids_genie(once):
    """The tiny Qwen3-VL with Qwen's special-token ids and vocab (make_tiny_checkpoint's
    qwen_special_ids: image 151655, vision start / end 151652 / 151653, 151,936 rows), built as
    htp_bundle builds vl_genie."""
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.source.tiny import make_tiny_checkpoint
    from tests.conftest import HTP_CONTEXT, HTP_N

    ckpt = once(("ckpt", "qwen3_vl", "qwen_special_ids"), lambda d: make_tiny_checkpoint(
        "qwen3_vl", d / "ckpt", qwen_special_ids=True)) / "ckpt"
    opts = BuildOptions(targets="v81", quant="fp16", context=HTP_CONTEXT, prefill_len=HTP_N,
                        genie=True, verify=False)
    return ckpt, once(("htp", "qwen3_vl", "qwen_special_ids", "fp16", "v81", "genie"),
                      lambda d: build(ckpt, d / "b", opts, log=lambda m: None)) / "b"


def dispatch(model_id: str) -> tuple[str, str] | None:
    """models/dispatch.h: (LLM | VLM, factory) for a model_id, in its order."""
    if model_id.endswith("_ssd"):
        return "LLM", "llama3_2_3b_ssd"
    for kind, prefix, factory in (("VLM", "qwen2_5_vl_", "qwen2_5_vl"),
                                  ("VLM", "qwen3_vl_", "qwen3_vl"),
                                  ("LLM", "qwen3_", "qwen3"), ("LLM", "qwen2_5_", "qwen2_5"),
                                  ("LLM", "falcon_v3_", "falcon3"), ("LLM", "llama_v3_", "llama3"),
                                  ("LLM", "phi_3_5_", "phi3_5")):
        if model_id.startswith(prefix):
            return kind, factory
    return None


def is_special(name: str) -> bool:
    """llm_utils.cpp isSpecialTensor: the named ones, or "key"/"value" ending _in / _out."""
    kv = name.endswith(("_in", "_out")) and ("key" in name or "value" in name)
    return name in SPECIAL or kv


def first_plain(tensors: dict) -> tuple[str, list[int]] | None:
    """The first non-special tensor in key order (the loader's json is a std::map: sorted)."""
    return next(((k, v["shape"]) for k, v in sorted(tensors.items()) if not is_special(k)), None)


def check_tensor(name: str, t: dict) -> None:
    assert set(t) >= {"shape", "dtype", "quantization_parameters"}, name
    assert all(isinstance(d, int) and d > 0 for d in t["shape"]), name
    # visual_pos_masks goes through Graph::write(void*, bytes): any 1-byte dtype (check_vlm)
    assert t["dtype"] in WRITABLE or (name == "visual_pos_masks" and t["dtype"] == "bool"), (
        name, t["dtype"])
    q = t["quantization_parameters"]
    if t["dtype"].startswith("uint"):  # UFIXED_POINT: scale-offset encoding
        assert q is not None and q["scale"] > 0 and isinstance(q["zero_point"], int), name
    else:
        assert q is None, name


def check_graph(name: str, io: dict, kv_heads: int, head_dim: int) -> set[int]:
    """One graph's names, layouts and dtypes as LLMModel reads and writes them; -> its layers."""
    m = geniex.GRAPH_NAME.fullmatch(name)
    ar, cl = int(m.group(2)), int(m.group(3))
    ins, outs = io["inputs"], io["outputs"]
    for k, t in (*ins.items(), *outs.items()):
        check_tensor(k, t)
    # get_attention_mask: seq_len x (kv_len + seq_len) floats, kv_len = CL - AR
    assert ins["attention_mask"]["shape"] == [1, 1, ar, cl]
    for r in ("position_ids_cos", "position_ids_sin"):  # rows = elements / (head_dim / 2)
        assert ins[r]["shape"] == [1, 1, ar, head_dim // 2]
    layers = set()
    for k in ins:
        if (p := re.fullmatch(r"past_(key|value)_(\d+)_in", k)) is None:
            continue
        layer = int(p.group(2))
        layers.add(layer)
        key = p.group(1) == "key"  # copyKV / reshapeKV: key [H,1,D,kv], value [H,1,kv,D]
        want_in = [kv_heads, 1, head_dim, cl - ar] if key else [kv_heads, 1, cl - ar, head_dim]
        want_out = [kv_heads, 1, head_dim, ar] if key else [kv_heads, 1, ar, head_dim]
        out = outs[f"past_{p.group(1)}_{layer}_out"]
        assert ins[k]["shape"] == want_in and out["shape"] == want_out, k
        assert out["dtype"] == ins[k]["dtype"], k  # one element size for the strided copy
    return layers


def check_shards(files: dict) -> tuple[int, int]:
    """parseQAIRTMetadata + LLMModel::onInitialized on the model_files keys; -> (shards, CLs)."""
    parts = {}
    for name in files:
        m = geniex.GRAPH_NAME.fullmatch(name)
        assert m is not None, f"{name}: not [phase_]ar<N>_cl<C>_<i>_of_<n>"
        parts[name] = tuple(int(g) for g in m.groups()[1:])
    totals = {t for _, _, _, t in parts.values()}
    assert len(totals) == 1
    (total,) = totals
    assert {s for _, _, s, _ in parts.values()} == set(range(1, total + 1))
    ars = sorted({a for a, _, _, _ in parts.values()})
    assert len(ars) == 2 and ars[0] == 1  # phase 0 = the largest AR, every other AR decodes
    cls = {c for _, c, _, _ in parts.values()}
    assert len(parts) == 2 * total * len(cls)  # graphIndex covers phase x shard x CL
    return total, len(cls)


def check_bundle(folder: Path) -> dict:
    """Every loader rule against the folder's metadata.json; -> what the loader infers."""
    meta = json.loads((folder / geniex.METADATA).read_text())
    assert isinstance(meta["model_id"], str) and isinstance(meta["model_files"], dict)
    # parseQAIRTMetadata sets "vision_encoder.bin" aside (a VLM's vision graph, check_vlm)
    files = {k: v for k, v in meta["model_files"].items() if k != geniex.VISION_ENCODER}
    total, _ = check_shards(files)
    reps: dict[int, dict] = {}  # per shard the first graph in key order (try_emplace)
    for n in sorted(files):
        reps.setdefault(int(geniex.GRAPH_NAME.fullmatch(n).group(4)), files[n])
    key = next(t for k, t in sorted(reps[1]["inputs"].items()) if k.startswith("past_key_"))
    kv_heads, head_dim = key["shape"][0], key["shape"][2]  # past_key_*.shape[0], [2]
    layers: list[set[int]] = [set() for _ in range(total)]
    for name, io in files.items():
        s = int(geniex.GRAPH_NAME.fullmatch(name).group(4))
        got = check_graph(name, io, kv_heads, head_dim)
        assert not layers[s - 1] or layers[s - 1] == got  # one layer range per shard
        layers[s - 1] |= got
    flat = sorted(x for ls in layers for x in ls)
    for ls in layers:  # "non-contiguous KV layer indices" is refused
        assert ls == set(range(min(ls), max(ls) + 1))
    by_shard: dict[int, set[frozenset]] = {}
    for name, io in files.items():  # QnnApi shares a buffer by tensor name across graphs
        s = int(geniex.GRAPH_NAME.fullmatch(name).group(4))
        by_shard.setdefault(s, set()).add(frozenset(io["inputs"]) | frozenset(io["outputs"]))
        assert s < total or "logits" in io["outputs"]  # readLastLogits: the last shard's
    assert all(len(v) == 1 for v in by_shard.values())  # AR-N and AR-1 take the same names
    plain_in = first_plain(reps[1]["inputs"])
    plain_out = first_plain(reps[1]["outputs"])
    hidden_from = plain_in if plain_in and len(plain_in[1]) >= 3 else plain_out
    assert (hidden_from[0], hidden_from[1][-1]) == geniex.loader_hidden(reps[1])
    return {"model_id": meta["model_id"], "kv_heads": kv_heads, "head_dim": head_dim,
            "layers": flat[-1] + 1 if flat else 0, "flat_layers": flat,
            "vocab": reps[total]["outputs"]["logits"]["shape"][-1],
            "hidden": hidden_from[1][-1], "first_input": plain_in[0] if plain_in else None,
            "shard1_inputs": set(reps[1]["inputs"]), "meta": meta}


def check_genie_config(folder: Path, manifest) -> dict:
    """parseGenieConfig / modelConfigFromDirectory: what they read from genie_config.json."""
    cfg = json.loads((folder / "genie_config.json").read_text())
    dialog = cfg["dialog"]
    assert dialog["type"] == "basic"
    assert dialog["context"]["size"] == manifest.context
    eos = dialog["context"]["eos-token"]
    assert isinstance(eos, int) or (isinstance(eos, list) and all(isinstance(e, int) for e in eos))
    pe = dialog["engine"]["model"]["positional-encoding"]
    assert isinstance(pe, dict) and isinstance(pe["rope-theta"], (int, float))
    kind = (pe.get("rope-scaling") or {}).get("rope-type", "default")
    assert kind in geniex.ROPE_TYPES
    bins = dialog["engine"]["model"]["binary"]["ctx-bins"]  # bundle_dir / entry, in order
    assert bins and all(Path(b).name == b and (folder / b).is_file() for b in bins)
    assert {"temp", "top-k", "top-p"} <= set(dialog["sampler"])
    assert (folder / "tokenizer.json").is_file()
    tok = json.loads((folder / geniex.TOKENIZER_CONFIG).read_text())
    assert isinstance(tok["chat_template"], str) and tok["chat_template"].strip()
    return cfg


def test_llama_genie_folder_meets_the_plugins_loader_rules(llama_genie):
    folder, manifest = llama_genie / "genie-v81", load_manifest(llama_genie)
    cfg = check_genie_config(folder, manifest)
    got = check_bundle(folder)
    assert dispatch(got["model_id"]) == ("LLM", "llama3")
    assert got["meta"]["genie"] == {"supports_vision": False}
    assert got["first_input"] == "input_ids"  # makeEmbeddingProvider: TokenIdInputProvider
    inputs = got["meta"]["model_files"]["prompt_ar16_cl128_1_of_1"]["inputs"]
    assert inputs["input_ids"] == {"shape": [1, 16], "dtype": "int32",
                                   "quantization_parameters": None}
    assert got["flat_layers"] == list(range(manifest.num_layers))
    kv = manifest.hf_config["num_key_value_heads"]
    assert (got["kv_heads"], got["head_dim"], got["vocab"]) == (
        kv, manifest.hidden_size // manifest.hf_config["num_attention_heads"],
        manifest.vocab_size)
    # the rope the plugin computes: head_dim / 2 frequencies, Genie's rope-dim
    assert got["head_dim"] == 2 * cfg["dialog"]["engine"]["model"]["positional-encoding"][
        "rope-dim"]
    # one split, input_ids: the loader takes hidden size from logits (unused on this path)
    assert got["hidden"] == manifest.vocab_size


def test_qwen3_genie_folder_in_two_splits_meets_the_plugins_loader_rules(qwen3_genie):
    folder, manifest = qwen3_genie / "genie-v81", load_manifest(qwen3_genie)
    check_genie_config(folder, manifest)
    got = check_bundle(folder)
    assert dispatch(got["model_id"]) == ("LLM", "qwen3")
    assert got["first_input"] == "input_ids" and got["meta"]["hexforge"]["blockers"] == []
    files = got["meta"]["model_files"]
    splits = {int(geniex.GRAPH_NAME.fullmatch(n).group(4)) for n in files}
    assert len(splits) >= 2 and splits == set(range(1, len(splits) + 1))
    assert got["flat_layers"] == list(range(manifest.num_layers))
    assert (got["kv_heads"], got["head_dim"], got["vocab"]) == (
        manifest.hf_config["num_key_value_heads"], manifest.hf_config["head_dim"],
        manifest.vocab_size)


def check_vlm(folder: Path, got: dict, manifest) -> None:
    """The plugin's Qwen3-VL path on top of the LLM rules (models/qwen3_vl/qwen3_vl.cpp,
    core/src/vlm/vlm_input_provider.cpp, vlm_model.cpp, GenieX sdk/plugins/qairt/src/vlm.cpp)."""
    meta, hidden = got["meta"], got["hidden"]
    files = meta["model_files"]
    # vlm.cpp: vision_encoder.bin beside the shards, kept out of ctx-bins' LLM list
    assert (folder / geniex.VISION_ENCODER).is_file()
    cfg = json.loads((folder / "genie_config.json").read_text())
    assert geniex.VISION_ENCODER not in cfg["dialog"]["engine"]["model"]["binary"]["ctx-bins"]
    # parseQAIRTMetadata: the one non-graph key it takes; makeModel / makePipeline refuse a
    # bundle without vision_preprocessing, read through j.value(key, 0)
    assert set(files) - {n for n in files if geniex.GRAPH_NAME.fullmatch(n)} == {
        geniex.VISION_ENCODER}
    vp = meta["vision_preprocessing"]
    for key in ("image_width", "image_height", "patch_size", "temporal_patch_size",
                "spatial_merge_size"):
        assert isinstance(vp[key], int) and vp[key] > 0, key
    assert len(vp["normalize_mean"]) == len(vp["normalize_std"]) == 3
    p, m = vp["patch_size"], vp["spatial_merge_size"]
    patches = (vp["image_height"] // p) * (vp["image_width"] // p)
    tokens = patches // (m * m)
    # Qwen3VLVisionEncoder::encode: Graph::write (throws on a missing name, on more values than
    # the buffer) pixel_values, position_ids_cos / _sin ([N, kVitRopeDim = 32]); Graph::read
    # (no bound) image_features and deepstack_visual_embeds_<k> as tokens x hidden floats
    vision = files[geniex.VISION_ENCODER]
    ins, outs = vision["inputs"], vision["outputs"]
    for name, t in (*ins.items(), *outs.items()):
        check_tensor(name, t)
    assert n_of(ins["pixel_values"]) >= patches * 3 * vp["temporal_patch_size"] * p * p
    for r in ("position_ids_cos", "position_ids_sin"):
        assert n_of(ins[r]) >= patches * geniex.VISION_ROPE
    levels = 0
    while f"deepstack_visual_embeds_{levels}" in outs:  # initialize(): counted from 0
        levels += 1
    assert levels == len(manifest.hf_config["vision_config"]["deepstack_visual_indexes"])
    for name in ["image_features"] + [f"deepstack_visual_embeds_{k}" for k in range(levels)]:
        assert n_of(outs[name]) == tokens * hidden, name  # exact: rows at the hidden stride
    # PrecomputedEmbeddingProvider: a headerless float32 file of exactly vocab x hidden
    table = folder / geniex.EMBEDDING
    assert table.stat().st_size == got["vocab"] * hidden * 4
    lut = folder / cfg["dialog"]["embedding"]["lut-path"]
    assert table.read_bytes() == lut.read_bytes()[:table.stat().st_size]  # the LUT's rows
    # VLMModel::generate: text rows from the table, image rows image_features, both written to
    # inputs_embeds at the loader's hidden size -- the graph's own row width
    for name, io in files.items():
        if name == geniex.VISION_ENCODER:
            continue
        ds = [k for k in io["inputs"] if k.startswith("deepstack_visual_embeds_")]
        if "inputs_embeds" in io["inputs"]:
            assert io["inputs"]["inputs_embeds"]["shape"][-1] == hidden
        if not ds:
            continue
        # DeepstackInputProvider::write: nothing unless the graph has visual_pos_masks, written
        # as elementCount bytes of a uint8 vector (a 1-byte dtype); each deepstack input gets
        # elementCount floats of rows at the hidden stride
        mask = io["inputs"]["visual_pos_masks"]
        assert mask["dtype"] in ("bool", "uint8") and mask["quantization_parameters"] is None
        ar = int(geniex.GRAPH_NAME.fullmatch(name).group(2))
        assert n_of(mask) == ar
        for k in ds:
            assert io["inputs"][k]["shape"][-1] == hidden and n_of(io["inputs"][k]) == ar * hidden
    assert set(files["prompt_ar16_cl128_1_of_1"]["inputs"]) >= {
        f"deepstack_visual_embeds_{k}" for k in range(levels)}  # shard 1 takes every level


def n_of(t: dict) -> int:
    n = 1
    for d in t["shape"]:
        n *= d
    return n


def test_qwen3_vl_genie_folder_meets_the_plugins_loader_rules(vl_genie):
    folder, manifest = vl_genie / "genie-v81", load_manifest(vl_genie)
    cfg = check_genie_config(folder, manifest)
    got = check_bundle(folder)
    assert dispatch(got["model_id"]) == ("VLM", "qwen3_vl")
    assert got["meta"]["genie"] == {"supports_vision": True}
    assert "inputs_embeds" in got["shard1_inputs"]  # PrecomputedEmbeddingProvider's name
    # the loader's hidden size: shard 1's first non-special input in key order,
    # deepstack_visual_embeds_0, rank 3 and as wide as inputs_embeds (H + the media flag)
    assert got["first_input"] == "deepstack_visual_embeds_0"
    assert got["hidden"] == manifest.hidden_size + 1
    assert got["meta"]["model_files"]["prompt_ar16_cl128_1_of_1"]["inputs"]["inputs_embeds"][
        "shape"] == [1, 16, manifest.hidden_size + 1]
    assert got["vocab"] == manifest.vocab_size
    assert got["flat_layers"] == list(range(manifest.num_layers))
    scaling = cfg["dialog"]["engine"]["model"]["positional-encoding"]["rope-scaling"]
    assert scaling["rope-type"] == "qwen3vl-mrope"
    assert sum(scaling["mrope-section"]) == got["head_dim"] // 2  # sums to head_dim / 2
    check_vlm(folder, got, manifest)
    # what is left is the tiny checkpoint's own: the plugin's image-token ids are constants
    # (qwen3_vl.h 151652 / 151655), a 384-token tokenizer's are not (with Qwen's ids:
    # test_qwen3_vl_with_qwens_token_ids_meets_every_loader_rule, no blocker)
    assert [b.split(" (")[0] for b in got["meta"]["hexforge"]["blockers"]] == [
        f"the plugin's Qwen3-VL token ids are constants {geniex.QWEN3_VL_IDS}"]
    ids = got["meta"]["hexforge"]["token_ids"]
    assert ids == {"vision_start": manifest.hf_config["vision_start_token_id"],
                   "image_pad": manifest.hf_config["image_token_id"]}


def test_qwen3_vl_with_qwens_token_ids_meets_every_loader_rule(vl_qwen_ids_genie, tmp_path):
    """The tiny Qwen3-VL whose tokenizer and config carry Qwen's special-token ids: nothing left
    for the plugin to refuse. Its constants are met where it reads them: qwen3_vl.h (vision
    start 151652, image pad 151655: M-RoPE anchors and the image rows), geniex-proc's
    qwen2vl.cpp (the submodule at the plugin's commit: it splices 151652, 151655 x S, 151653
    for each image and writes <|im_start|> / <|im_end|> as text) and its end-of-generation
    candidates (<|im_end|>, <|endoftext|>, found by text)."""
    import numpy as np
    from PIL import Image
    from tokenizers import Tokenizer
    from transformers import AutoImageProcessor, AutoTokenizer

    import hexforge
    from hexforge.forge.source.tiny import QWEN_SPECIAL_IDS, QWEN_VOCAB_SIZE
    from hexforge.runtime.multimodal import prepare_media

    ckpt, bundle = vl_qwen_ids_genie
    folder, manifest = bundle / "genie-v81", load_manifest(bundle)
    cfg = check_genie_config(folder, manifest)
    got = check_bundle(folder)
    assert dispatch(got["model_id"]) == ("VLM", "qwen3_vl")
    assert got["meta"]["genie"] == {"supports_vision": True}
    assert got["first_input"] == "deepstack_visual_embeds_0"
    assert got["hidden"] == manifest.hidden_size + 1 and manifest.hidden_size == 64
    assert got["vocab"] == manifest.vocab_size == QWEN_VOCAB_SIZE
    assert got["flat_layers"] == list(range(manifest.num_layers))
    assert cfg["dialog"]["engine"]["model"]["positional-encoding"]["rope-scaling"][
        "rope-type"] == "qwen3vl-mrope"
    check_vlm(folder, got, manifest)
    assert got["meta"]["hexforge"]["blockers"] == []
    assert got["meta"]["hexforge"]["token_ids"] == geniex.QWEN3_VL_IDS
    assert "loadable by its rules" in (bundle / "README.md").read_text()
    # the ids where the plugin's tokenizer (the Genie folder's tokenizer.json) and the config
    # put them: added tokens and the model vocab agree
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert {t: tok.token_to_id(t) for t in QWEN_SPECIAL_IDS} == QWEN_SPECIAL_IDS
    hf = manifest.hf_config
    assert (hf["vision_start_token_id"], hf["image_token_id"], hf["vision_end_token_id"]) == (
        151652, 151655, 151653)
    turn = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert (turn[0], turn[-1]) == (151644, 151645) and max(turn[1:-1]) < 384
    # an image expands to geniex-proc's splice: 151652, 151655 x S, 151653, S the soft tokens
    # of vision_preprocessing's fixed size (patches / merge^2) -- hexforge's prompt and
    # HF's processor (Qwen3VLProcessor.replace_image_token: grid / merge^2 <|image_pad|>)
    vp = got["meta"]["vision_preprocessing"]
    soft = (vp["image_height"] // vp["patch_size"]) * (vp["image_width"] // vp["patch_size"]) \
        // vp["spatial_merge_size"] ** 2
    png = tmp_path / "photo.png"
    Image.fromarray((np.random.default_rng(0).random((45, 83, 3)) * 255).astype(np.uint8)).save(png)
    cpu = hexforge.load(bundle)
    ids, _ = prepare_media(cpu.engine, cpu.manifest, cpu.tokenizer.encode("Describe it."),
                           [str(png)], None, {})
    start = ids.index(151652)
    assert ids[start:start + soft + 2] == [151652] + [151655] * soft + [151653]
    assert ids.count(151655) == soft
    grid = AutoImageProcessor.from_pretrained(ckpt)(
        images=[Image.open(png).convert("RGB").resize((vp["image_width"], vp["image_height"]))],
        return_tensors="np")["image_grid_thw"]
    assert int(grid.prod()) // vp["spatial_merge_size"] ** 2 == soft
    text = "<|vision_start|>" + "<|image_pad|>" * soft + "<|vision_end|>"
    assert AutoTokenizer.from_pretrained(ckpt)(text)["input_ids"] == ids[start:start + soft + 2]
    # the simulator runs it end to end (random weights: any of the 151,936 rows may win)
    out = hexforge.load(bundle, backend="qnn-sim").generate(
        "Describe it.", images=[str(png)], max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4 and all(0 <= t < QWEN_VOCAB_SIZE for t in out.token_ids)


def test_qwen3_vl_with_qwens_token_ids_through_libgenie_equals_qnn_sim(vl_qwen_ids_genie,
                                                                       tmp_path):
    """The same folder through libGenie's pipeline (the Genie side of it): an image prompt's
    greedy tokens equal qnn-sim's. Plumbing on random weights: Genie's tokenizer takes the
    specials at Qwen's ids and the 151,936-row table."""
    import numpy as np
    from PIL import Image

    import hexforge
    from hexforge.runtime.genie.pipelinemodel import open_genie

    _, bundle = vl_qwen_ids_genie
    png = tmp_path / "photo.png"
    Image.fromarray((np.random.default_rng(1).random((45, 83, 3)) * 255).astype(np.uint8)).save(png)
    kw = dict(images=[str(png)], max_new_tokens=8, ignore_eos=True)
    want = hexforge.load(bundle, backend="qnn-sim").generate("Describe it.", **kw).token_ids
    model = open_genie(bundle)
    try:
        got = model.generate("Describe it.", **kw).token_ids
    finally:
        model.close()
    assert got == want and len(got) == 8


def test_qwen3_vl_one_graph_serves_both_deepstack_contracts():
    """Qwen3VLGenieStep's deepstack rows: libGenie's (row r the feature of chunk row r, the
    mask never written, text rows unwritten garbage) and GenieX's (the mask at the image rows,
    row j the j-th image row's feature, zero elsewhere) add the same features at the same rows,
    and none on text rows."""
    import torch

    from hexforge.families.qwen3_vl import scatter_compact

    T, H = 8, 4
    image = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    feats = torch.randn(int(image.sum()), H)
    positional = torch.full((1, T, H), 1e30)  # libGenie: text rows unwritten
    positional[0, image] = feats
    compact = torch.zeros(1, T, H)  # GenieX: consecutive from row 0, zero-filled
    compact[0, :len(feats)] = feats
    (lib,) = scatter_compact([positional], torch.zeros(1, T, dtype=torch.bool))
    (gx,) = scatter_compact([compact], image.view(1, T))
    assert torch.equal(lib[0, image], feats) and torch.equal(gx[0, image], feats)
    assert torch.all(gx[0, ~image] == 0)


def test_geniex_vision_rope_is_the_towers():
    """The plugin's 2-D vision rope ([N, 32], computePatchRoPE's merge order) read at the
    tower's columns equals the tower's own baked rope: the GenieX vision graph's inputs carry
    the same positions as the libGenie node's constants."""
    import numpy as np

    from hexforge.families.qwen3_vl_vision import geniex_vision_rope

    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)  # a tower with 16-wide heads: d = 8
    cos, _ = geniex_vision_rope((4, 6), 2)
    assert cos.shape == (24, 32)
    # patch 5 in merge order: block (0, 1), in-block (0, 1) -> h = 0, w = 3
    np.testing.assert_allclose(cos[5, [0, 4, 8, 12]], np.ones(4), atol=1e-6)
    np.testing.assert_allclose(cos[5, [16, 20, 24, 28]], np.cos(3 * inv), atol=1e-6)


def test_the_graph_names_inside_the_binaries_are_what_the_plugin_takes(llama_genie):
    """LLMModel::onInitialized matches the loaded QNN graph names, not metadata.json's keys:
    hexforge's length-keeping rename (forge/genie/ctxname.py) fills with letters after the phase
    (``prompt<letters>_ar16_cl128_1_of_1``), which the rule takes whole; the first form, digits
    between CL and the split (``prompt_ar16_cl128_<digits>_1_of_1``), it refused."""
    folder = llama_genie / "genie-v81"
    for binary in ("prompt_ar16_cl128_1_of_1.bin", "token_ar1_cl128_1_of_1.bin"):
        data = (folder / binary).read_bytes()
        names = set(re.findall(rb"(?:prompt|token)[a-z]*_ar\d+_cl128_\w*?_of_1", data))
        assert names
        assert all(geniex.GRAPH_NAME.fullmatch(n.decode()) for n in names), names
    assert not geniex.GRAPH_NAME.fullmatch("prompt_ar16_cl128_12345xxx_1_of_1")
    meta = json.loads((folder / geniex.METADATA).read_text())
    assert meta["hexforge"]["blockers"] == []
    card = (llama_genie / "README.md").read_text()
    assert "GenieX" in card and "loadable by its rules" in card


def _config(**model) -> dict:
    return {"dialog": {"engine": {"backend": {"QnnHtp": {"kv-dim": 16}},
                                  "model": {"positional-encoding": {"rope-dim": 8,
                                                                    "rope-theta": 1e4},
                                            **model}}}}


def test_families_the_plugin_cannot_take_get_no_metadata(tmp_path):
    """qwen3_5 (linear-attention state), gemma (not dispatched; several ropes) and ropes the
    loader would compute otherwise are refused: no metadata.json, the reason on the card."""
    assert "linear-attention" in geniex.refusal("qwen3_5", _config(**{"linear-attention": True}))
    assert "dispatcher" in geniex.refusal("gemma3_text", _config())
    assert "dispatcher" in geniex.refusal("gemma4", _config())
    assert "rope-scaling" in geniex.refusal("llama", _config(**{"positional-encoding": {
        "rope-dim": 8, "rope-theta": 1e4, "rope-scaling": {"rope-type": "linear"}}}))
    assert "several ropes" in geniex.refusal("qwen3", _config(**{"positional-encoding": [{}]}))
    assert geniex.refusal("llama", _config()) is None
    (tmp_path / "genie_config.json").write_text(json.dumps(_config(**{"linear-attention": True})))
    assert geniex.write_geniex_files(tmp_path, "qwen3_5", [], tmp_path) is None
    assert not (tmp_path / geniex.METADATA).exists()
    assert geniex.card_line(tmp_path, "qwen3_5").startswith("GenieX: not loadable (its layers")
