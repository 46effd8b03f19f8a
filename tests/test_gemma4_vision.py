"""Gemma-4 vision encoder component: host preprocessing, the static torch module, its ONNX export
on the CPU EP and on the x86 HTP simulator (v81 fp16), each against HF on the tiny checkpoint."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from hexforge.bundle.errors import BundleError, MediaError
from hexforge.families.gemma4_vision import ENCODER, INPUT_KEYS
from hexforge.forge.oracle.verify import cosine_rows
from hexforge.runtime.vision import Gemma4ImagePrep

# (height, width): 1-pixel and 1×2 images (upscaled), very wide / tall ones (one pooled row or
# column: the processor's edge branch), odd non-square sizes, one needing no resize (12×840 is
# already 3×210 patches = the 630-patch budget)
SIZES = [(1, 1), (1, 2), (3, 1), (50, 80), (80, 50), (7, 500), (500, 7), (1, 3000), (3000, 1),
         (333, 127), (12, 840), (1000, 1001)]
MODEL_SIZES = [(1, 3000), (333, 127), (1, 1)]  # through the tower: no / some / more padding
CPU_COS, HTP_COS = 0.99999, 0.999


def _image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8))


def _hf_processor(params: dict):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(patch_size=params["patch_size"],
                                   max_soft_tokens=params["max_soft_tokens"],
                                   pooling_kernel_size=params["pooling_kernel_size"])


def _cos_min(got: np.ndarray, want: np.ndarray) -> float:
    """Cosine of the n valid rows (got [1, S, H] or [S, H] vs want [n, H]); min over rows."""
    got = got.reshape(-1, got.shape[-1])[: want.shape[0]]
    return float(cosine_rows(got, want).min())


@pytest.fixture(scope="module")
def hf(ckpt):
    """The tiny HF model (own copy: the session's is shared). Its vision tower is conditioned in
    tiny.py (random position table, 10x input_proj) so the gates can see a bug; checked here."""
    from hexforge.families import load_family

    model = load_family("gemma4").FAMILY.load_hf(ckpt("gemma4_mm"))
    table = model.model.vision_tower.patch_embedder.position_embedding_table
    assert float(table.std()) > 0.5  # not from_config's all-ones table
    return model


@pytest.fixture(scope="module")
def spec(hf, ckpt):
    config = json.loads((ckpt("gemma4_mm") / "config.json").read_text())
    return ENCODER.spec(hf, config)


@pytest.fixture(scope="module")
def prep(spec):
    return Gemma4ImagePrep(spec.params)


@pytest.fixture(scope="module")
def cases(hf, spec, prep):
    """[(name, inputs, HF soft tokens [n, H])]: the family's example image + MODEL_SIZES."""
    out = [("example", ENCODER.example_inputs(spec))]
    for h, w in MODEL_SIZES:
        inputs, _ = prep(_image(h, w, seed=h + w))
        out.append((f"{h}x{w}", inputs))
    return [(name, x, ENCODER.reference(hf, x)["soft"]) for name, x in out]


@pytest.fixture(scope="module")
def onnx_path(hf, spec, tmp_path_factory):
    """The graph exported the way the build does it (torchscript, initializer identities folded,
    norm prescales recorded on the example image)."""
    import torch

    from hexforge.forge.export.encoders import calibrate_encoder_norms
    from hexforge.forge.export.onnxexport import export_module

    calibrate_encoder_norms([ENCODER], [spec], hf)
    module = ENCODER.encoder_module(hf, spec)
    feeds = ENCODER.example_inputs(spec)
    module.example_inputs = lambda: tuple(torch.from_numpy(feeds[k]) for k in INPUT_KEYS)
    path = tmp_path_factory.mktemp("g4vision") / "vision.onnx"
    ins, outs = export_module(module, path, "torchscript")
    P = spec.max_soft_tokens * spec.params["pooling_kernel_size"] ** 2  # fixed patch rows
    assert [(t.name, t.bind, t.shape[:2]) for t in ins] == [(k, f"media:{k}", [1, P])
                                                            for k in INPUT_KEYS]
    H = hf.config.text_config.hidden_size
    assert [(t.name, t.shape) for t in outs] == [("soft", [1, spec.max_soft_tokens, H])]
    return path


# ---- host preprocessing -------------------------------------------------------------------------
def test_spec_reads_processor_config_and_tokenizer(spec, hf, ckpt):
    cfg = json.loads((ckpt("gemma4_mm") / "config.json").read_text())
    proc = json.loads((ckpt("gemma4_mm") / "processor_config.json").read_text())["image_processor"]
    assert spec.max_soft_tokens == spec.params["max_soft_tokens"] == proc["max_soft_tokens"] == 70
    assert (spec.placeholder_id, spec.begin_id, spec.end_id) == (
        cfg["image_token_id"], cfg["boi_token_id"], cfg["eoi_token_id"])
    assert spec.placeholder_text == "<|image|>"
    assert spec.preprocessor == "gemma4_image" and spec.modality == "image"


def test_spec_defaults_to_hf_budget_without_processor_config(hf, ckpt, tmp_path, monkeypatch):
    src = ckpt("gemma4_mm")
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(src / f, tmp_path / f)
    monkeypatch.setattr(hf.config, "_name_or_path", str(tmp_path))
    spec = ENCODER.spec(hf, json.loads((src / "config.json").read_text()))
    assert spec.max_soft_tokens == _hf_processor_default_budget() == 280
    # the position table is cut to the longest reachable side: min(table, 280·3)
    assert spec.params["position_rows"] == min(hf.config.vision_config.position_embedding_size, 840)


def _hf_processor_default_budget() -> int:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil().max_soft_tokens


@pytest.mark.parametrize("h,w", SIZES)
def test_preprocessing_matches_hf_processor(prep, spec, h, w):
    img = _image(h, w)
    want = _hf_processor(spec.params)(images=[img], return_tensors="np")
    got, n = prep(img)
    assert n == int(want["num_soft_tokens_per_image"][0])
    assert got["pixel_values"].shape == want["pixel_values"].shape  # fixed: [1, P, 3p²]
    assert np.abs(got["pixel_values"] - want["pixel_values"]).max() <= 1e-5
    np.testing.assert_array_equal(got["image_position_ids"], want["image_position_ids"])
    # the graph's index inputs agree with HF's position ids
    ids = want["image_position_ids"][0]
    valid = (ids != -1).all(-1)
    np.testing.assert_array_equal(got["patch_valid"][0], valid.astype(np.float32))
    np.testing.assert_array_equal(got["patch_pos"][0], np.maximum(ids, 0))
    pooled = got["pool_index"][0]
    assert (pooled[~valid] == -1).all()
    assert sorted(set(pooled[valid].astype(int))) == list(range(n))  # the first n rows, each k² patches
    assert (np.bincount(pooled[valid].astype(int)) == spec.params["pooling_kernel_size"] ** 2).all()


def test_preprocessor_refuses_what_hf_cannot_encode(spec):
    # an image whose long side needs more patches than the position table has: HF's processor
    # emits those positions and the tower's embedding lookup then fails (IndexError)
    params = {**spec.params, "max_soft_tokens": 1120, "position_rows": 256}
    img = _image(1, 5000)
    hf_ids = _hf_processor(params)(images=[img], return_tensors="np")["image_position_ids"]
    assert hf_ids.max() >= 256
    with pytest.raises(MediaError, match="position table"):
        Gemma4ImagePrep(params)(img)
    Gemma4ImagePrep(params)(_image(60, 70))  # a moderate image still fits
    with pytest.raises(MediaError, match="RGB"):
        Gemma4ImagePrep(spec.params)(_image(10, 10).convert("L"))
    with pytest.raises(BundleError, match="max_soft_tokens"):
        Gemma4ImagePrep({**spec.params, "max_soft_tokens": 100})  # HF's processor refuses it too
    with pytest.raises(BundleError, match="head_dim"):
        Gemma4ImagePrep({k: v for k, v in spec.params.items() if k != "head_dim"})


# ---- the encoder ----------------------------------------------------------------------------------
def test_torch_module_matches_hf(hf, spec, cases):
    import torch

    module = ENCODER.encoder_module(hf, spec)
    for name, inputs, ref in cases:
        with torch.no_grad():
            got = module(*[torch.from_numpy(inputs[k]) for k in INPUT_KEYS]).numpy()
        assert got.shape == (1, spec.max_soft_tokens, ref.shape[1])
        assert _cos_min(got, ref) >= CPU_COS, name


def test_onnx_on_cpu_matches_hf(onnx_path, cases):
    import onnx
    import onnxruntime as ort

    ops = {n.op_type for n in onnx.load(str(onnx_path)).graph.node}
    assert not ops & {"ScatterND", "ScatterElements", "Trilu", "NonZero", "Equal", "Where"}, ops
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    for name, inputs, ref in cases:
        got = sess.run(None, {k: inputs[k] for k in INPUT_KEYS})[0]
        assert _cos_min(got, ref) >= CPU_COS, name


def test_example_image_exercises_padding(hf, spec):
    """The build's example (export, calibration, oracle) is non-square and leaves padding rows."""
    inputs = ENCODER.example_inputs(spec)
    k, p = spec.params["pooling_kernel_size"], spec.params["patch_size"]
    n = int(inputs["patch_valid"].sum()) // k**2
    assert 0 < n < spec.max_soft_tokens
    assert inputs["pixel_values"].shape == (1, spec.max_soft_tokens * k**2, 3 * p * p)
    ys, xs = inputs["image_position_ids"][0].max(0) + 1
    assert xs != ys
    assert ENCODER.reference(hf, inputs)["soft"].shape == (n, hf.config.text_config.hidden_size)


def test_qnn_sim_v81_fp16_matches_hf(onnx_path, hf, spec):
    """The float graph compiled for v81 with fp16 precision, CPU fallback disabled (a node the
    HTP does not claim fails the compile), run on the x86 simulator."""
    import onnxruntime as ort

    from hexforge.forge.compile.contexts import compile_graph
    from hexforge.runtime import qnn

    inputs = ENCODER.example_inputs(spec)
    ref = ENCODER.reference(hf, inputs)["soft"]
    ctx = onnx_path.with_name("vision.ctx.onnx")
    res = compile_graph(onnx_path, ctx, htp_arch=81, soc_model=87, fp16=True)
    assert qnn.binary_info(res["bin"])["arch"] == 81
    so = qnn.session_options(qnn.provider_options(81, 87, fp16=True), {})
    with qnn.native_stdout_to_stderr():
        sess = ort.InferenceSession(str(ctx), so)
    got = sess.run(None, {k: inputs[k] for k in INPUT_KEYS})[0]
    assert _cos_min(got, ref) >= HTP_COS
