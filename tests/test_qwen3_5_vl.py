"""Qwen3.5 as the hub ships it (Qwen3_5ForConditionalGeneration, model_type qwen3_5): the tiny
GatedDeltaNet hybrid text model (8 layers, interleaved M-RoPE 2/1/1 over 4 rotary frequencies) and
a 2-block Qwen3-VL vision tower without deepstack (patch 16, merge 2).

Before, ``hexforge build`` refused such a checkpoint (no family for ``qwen3_5_vision``), so the
real Qwen3.5-0.8B did not build at all. One build (cpu + v81, fp16 on the HTP) serves these tests.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import hexforge
from hexforge.bundle.manifest import load_manifest
from hexforge.families import encoder_families
from hexforge.forge.oracle.verify import cosine_rows
from hexforge.runtime.backends import Backend
from hexforge.runtime.engine import Engine
from hexforge.runtime.multimodal import MediaRows
from hexforge.runtime.sampling import greedy
from hexforge.runtime.vision import Qwen2VLImagePrep
from tests.conftest import prompt_ids
from tests.test_qwen3_vl import hf_image_run, image_prompt, media_rows, photo

FAMILY = "qwen3_5_vl"


@pytest.fixture(scope="module")
def built(htp_bundle):
    return htp_bundle(FAMILY, "fp16", "cpu,v81", verify_tokens=8)


@pytest.fixture(scope="module")
def encoder(ckpt):
    return encoder_families(json.loads((ckpt(FAMILY) / "config.json").read_text()))[0]


def image_run(eng: Engine, spec, seed: int):
    """(prompt ids, preprocessed inputs, media rows) of one photo through the bundle's tower."""
    inputs = Qwen2VLImagePrep(spec.params)(photo(70, 150, seed=seed))[0]
    ids = image_prompt(spec, spec.max_soft_tokens)
    return ids, inputs, media_rows(spec, ids, eng.encode(spec, inputs))


def test_the_hub_layout_builds_with_its_vision_tower(built):
    m = load_manifest(built)
    assert m.family == "qwen3_5" and m.host.positions == "mrope"
    assert [e.name for e in m.encoders] == ["vision"]
    assert json.loads((built / "report.json").read_text())["v81"]["passed"]


def test_vision_cpu_matches_hf_without_deepstack(built, hf_model, encoder):
    m = load_manifest(built)
    spec = m.encoders[0]
    inputs = encoder.example_inputs(spec)
    got = Engine(built, m, "cpu", Backend("cpu")).encode(spec, inputs)
    want = encoder.reference(hf_model(FAMILY), inputs)
    assert set(got) == set(want) == {"soft"}
    assert cosine_rows(got["soft"][0, :want["soft"].shape[0]], want["soft"]).min() >= 0.99999


def test_text_prompt_greedy_equals_hf(built, hf_greedy):
    ids = prompt_ids(21)
    got = hexforge.load(built).generate(ids, max_new_tokens=32, ignore_eos=True)
    assert got.token_ids == hf_greedy(FAMILY, ids, 32)


def test_image_prompt_greedy_equals_hf(built, hf_model):
    """Soft tokens + M-RoPE positions through the recurrent and full layers, a prompt that
    crosses AR-N chunks: 32 greedy tokens = HF generate with the same pixels."""
    m = load_manifest(built)
    eng = Engine(built, m, "cpu", Backend("cpu"))
    ids, inputs, rows = image_run(eng, m.encoders[0], seed=1)
    assert len(ids) > eng.prefill_len
    got = [t for t, _ in eng.generate_step(ids, greedy, 32, media=rows)]
    assert got == hf_image_run(hf_model(FAMILY), ids, inputs, 32)


def test_image_prompt_needs_its_mrope_positions(built, hf_model):
    """The image test can fail: 1-D positions move the logits off HF's (the full recipe: 1e-4)."""
    m = load_manifest(built)
    eng = Engine(built, m, "cpu", Backend("cpu"))
    ids, inputs, rows = image_run(eng, m.encoders[0], seed=2)
    want = hf_image_run(hf_model(FAMILY), ids, inputs)

    def logits(r: MediaRows) -> np.ndarray:
        eng.reset()
        return eng.prefill(ids, media=r)

    assert np.abs(logits(rows) - want).max() < 1e-4
    assert np.abs(logits(MediaRows(rows.index, rows.embeds, rows.extra)) - want).max() > 1e-2


def test_python_api_image_file_greedy_equals_hf(built, hf_model, tmp_path):
    model = hexforge.load(built)
    spec = model.manifest.encoders[0]
    photo(70, 150, seed=4).save(tmp_path / "p.png")
    prompt = f"Look: {spec.placeholder_text} and say."
    res = model.generate(prompt, images=[tmp_path / "p.png"], max_new_tokens=16, ignore_eos=True)
    text = model.tokenizer.encode(prompt)
    at = text.index(spec.placeholder_id)
    ids = (text[:at] + [spec.begin_id] + [spec.placeholder_id] * spec.max_soft_tokens
           + [spec.end_id] + text[at + 1:])
    assert res.prompt_tokens == len(ids)
    inputs = Qwen2VLImagePrep(spec.params)(__import__("PIL.Image").Image.open(tmp_path / "p.png")
                                           .convert("RGB"))[0]
    assert res.token_ids == hf_image_run(hf_model(FAMILY), ids, inputs, 16)


def test_v81_runs_an_image_prompt_on_the_simulator(built, hf_model):
    """The v81 context binaries (vision tower + GatedDeltaNet hybrid, fp16, CPU fallback off) on
    an image prompt: last-token logits cos >= 0.999 vs HF."""
    m = load_manifest(built)
    eng = Engine(built, m, "v81", Backend.resolve("qnn-sim", 81))
    ids, inputs, rows = image_run(eng, m.encoders[0], seed=1)
    got = eng.prefill(ids, media=rows)
    want = hf_image_run(hf_model(FAMILY), ids, inputs)
    assert cosine_rows(got[None], want[None])[0] >= 0.999


def test_w8a16_runs_an_image_prompt_on_the_simulator(htp_bundle, hf_model):
    """The quantized HTP path on the hub layout: w8a16 (int8 weights through MatMulNBits, fp16
    activations) passes the build's oracle, and an image prompt on the v81 simulator keeps
    last-token logits cos >= 0.999 vs HF. (QDQ calibrated on image prompts: test_qwen3_vl.py.)"""
    b = htp_bundle(FAMILY, "w8-fp16")
    report = json.loads((b / "report.json").read_text())["v81"]
    assert report["passed"], report
    m = load_manifest(b)
    eng = Engine(b, m, "v81", Backend.resolve("qnn-sim", 81))
    ids, inputs, rows = image_run(eng, m.encoders[0], seed=1)
    got = eng.prefill(ids, media=rows)
    want = hf_image_run(hf_model(FAMILY), ids, inputs)
    cos = cosine_rows(got[None], want[None])[0]
    print(f"qwen3_5_vl v81 w8a16 image prompt: last-token logits cos {cos:.6f}")
    assert cos >= 0.999


def test_int4_bundle_runs_its_tower_with_int8_weights(bundle, hf_model, encoder):
    """--cpu-weights int4 left the tower fp32: 399 of the 1.38 GB of Qwen3.5-0.8B's int4 bundle.
    Towers take int8 MatMulNBits under int8 and int4 (an int4 tower measured soft-token cos 0.972
    at real shape), gated by the oracle at soft-token cos >= 0.999. On a photo: the tower's rows
    vs HF's, and the same int4 decoder's last-token logits from them vs from HF's rows."""
    import onnx

    b = bundle(FAMILY, cpu_weights="int4")
    report = json.loads((b / "report.json").read_text())["cpu"]
    assert report["passed"], report["failures"]
    assert report["encoders"]["vision"]["gate"] == 0.999 and report["encoders"]["vision"]["passed"]
    m = load_manifest(b)
    graph = next(g for g in m.targets["cpu"].graphs if g.role == "vision")
    nodes = onnx.load(str(b / graph.file), load_external_data=False).graph
    inits = {t.name for t in nodes.initializer}
    bits = [next(a.i for a in n.attribute if a.name == "bits") for n in nodes.node
            if n.op_type == "MatMulNBits"]
    assert bits and set(bits) == {8}
    assert not [n for n in nodes.node if n.op_type == "MatMul" and n.input[1] in inits]
    eng = Engine(b, m, "cpu", Backend.resolve("cpu"))
    spec = m.encoders[0]
    ids, inputs, rows = image_run(eng, spec, seed=1)
    want = encoder.reference(hf_model(FAMILY), inputs)["soft"]
    tower_cos = cosine_rows(rows.embeds[:want.shape[0]], want).min()
    eng.reset()
    got = eng.prefill(ids, media=rows)
    eng.reset()
    ref = eng.prefill(ids, media=media_rows(spec, ids, {"soft": want[None]}))
    cos = cosine_rows(got[None], ref[None])[0]
    print(f"qwen3_5_vl int8 tower on a photo: soft tokens cos {tower_cos:.6f}; the int4 decoder's "
          f"last-token logits from them vs from HF's: cos {cos:.6f}")
    assert tower_cos >= 0.999 and cos >= 0.999
