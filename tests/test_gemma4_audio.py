"""Gemma-4 audio component: host log-mel vs HF's feature extractor, the static conformer graph vs
HF's audio tower (torch, ONNX on the CPU EP, fp16 on the qnn-sim HTP), bad audio refused."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from hexforge.bundle.errors import MediaError
from hexforge.families.gemma4_audio import ENCODER, chirp
from hexforge.runtime.audio import Gemma4AudioPrep

WINDOW_S = 2.0  # the tiny test's audio window (real models: 30 s)
SR = 16_000


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        str(ckpt("gemma4_mm")), dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def spec(hf, ckpt):
    config = json.loads((ckpt("gemma4_mm") / "config.json").read_text())
    return ENCODER.spec(hf, config, max_seconds=WINDOW_S)


@pytest.fixture(scope="module")
def prep(spec):
    return Gemma4AudioPrep(spec.params)


@pytest.fixture(scope="module")
def fe(ckpt):
    """HF's feature extractor as the checkpoint's processor config makes it."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    cfg = json.loads((ckpt("gemma4_mm") / "processor_config.json").read_text())["feature_extractor"]
    return Gemma4AudioFeatureExtractor.from_dict(cfg)


@pytest.fixture(scope="module")
def example(spec, hf):
    """(graph inputs, HF soft tokens on the valid rows) for the example chirp."""
    inputs = ENCODER.example_inputs(spec)
    return inputs, ENCODER.reference(hf, inputs)["soft"]


@pytest.fixture(scope="module")
def onnx_graph(hf, spec, tmp_path_factory):
    """The graph exported the way the build does it: norm prescales recorded on the example."""
    from hexforge.forge.export.encoders import calibrate_encoder_norms
    from hexforge.forge.export.onnxexport import export_module

    calibrate_encoder_norms([ENCODER], [spec], hf)
    path = tmp_path_factory.mktemp("g4audio") / "audio.onnx"
    export_module(ENCODER.encoder_module(hf, spec), path, exporter="torchscript")
    return path


def test_spec_matches_config(spec, hf, prep):
    cfg = hf.config
    assert (spec.placeholder_id, spec.begin_id, spec.end_id) == (
        cfg.audio_token_id, cfg.boa_token_id, cfg.eoa_token_id)
    assert spec.placeholder_text == "<|audio|>" and spec.preprocessor == "gemma4_audio"
    # 2 s = 32000 samples -> 199 mel frames -> 100 -> 50 soft tokens
    assert (prep.num_frames, spec.max_soft_tokens) == (199, 50)


def _hf_features(fe, wav: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = fe([wav], sampling_rate=SR, return_tensors="np")
    return out["input_features"][0], out["input_features_mask"][0]


@pytest.mark.parametrize("samples", [162, 5920, 16_001, 20_800, round(WINDOW_S * SR)])
def test_log_mel_matches_hf(prep, fe, hf, samples):
    """Features and frame mask = HF's (cut at HF's own padded length, zeros past it); the soft token
    count = the audio tower's attention_mask sum on HF's own (unpadded) features."""
    noise = np.random.RandomState(samples).randn(samples).astype(np.float32)
    wav = chirp(samples / SR, SR) + np.float32(0.01) * noise
    inputs, n_soft = prep(wav)
    feats, mask = _hf_features(fe, wav)
    F = feats.shape[0]
    ours = inputs["input_features"][0]
    assert inputs["input_features"].shape == (1, prep.num_frames, 128)
    assert np.abs(ours[:F] - feats).max() <= 1e-5
    assert not ours[F:].any() and not inputs["input_features_mask"][0, F:].any()
    np.testing.assert_array_equal(inputs["input_features_mask"][0, :F], mask.astype(np.float32))
    if samples == prep.max_samples:  # a full window: the very same tensors as HF
        assert F == prep.num_frames
    with torch.no_grad():
        out = hf.model.get_audio_features(torch.from_numpy(feats[None]), torch.from_numpy(mask[None]))
    assert n_soft == int(out.attention_mask.sum())


def _speech_like(seconds: float, rate: int, channels: int, peak: float) -> np.ndarray:
    """A chirp plus noise up to the file's Nyquist (the top mel bins see the resampler's filter),
    each channel different, scaled to ``peak`` [N, C]; at full scale a square wave instead, whose
    band-limited version rings past 1."""
    rng = np.random.default_rng(rate + channels)
    t = np.arange(int(seconds * rate)) / rate
    if peak >= 1.0:
        return np.repeat(np.sign(np.sin(2 * np.pi * 700 * t))[:, None], channels, 1).astype(np.float32)
    x = np.stack([np.sin(2 * np.pi * (300 + 500 * c + 400 * t) * t) for c in range(channels)], 1)
    x = x + 0.1 * rng.standard_normal(x.shape)
    return (peak * x / np.abs(x).max()).astype(np.float32)


@pytest.mark.parametrize("rate,channels,fmt,subtype,peak", [
    (44_100, 2, "WAV", "PCM_16", 0.5),
    (22_050, 1, "FLAC", "PCM_16", 0.5),
    (8_000, 1, "WAV", "PCM_16", 0.5),
    (8_000, 2, "WAV", "PCM_24", 0.5),
    (48_000, 3, "WAV", "FLOAT", 0.9),  # three channels: the mean's summation order
    (32_000, 1, "WAV", "FLOAT", 1.0),  # full scale: HF's resampled samples overshoot 1, unclipped
    (16_000, 2, "WAV", "PCM_16", 0.5),  # no resampling: the channel mean alone
])
def test_regression_resampled_audio_differed_from_hfs_loader(prep, fe, hf, tmp_path, rate, channels,
                                                              fmt, subtype, peak):
    """A file at any rate gives the very waveform of ``transformers.audio_utils.load_audio`` (what
    HF processors and chat templates do with an audio path: soxr ``soxr_hq``); scipy's polyphase
    resampler differed by up to 0.009 at 44.1 kHz, 3.4 in the top log-mel bins, and the greedy
    tokens from the first one. Features, mask and soft-token count then equal HF's."""
    import soundfile as sf
    from transformers.audio_utils import load_audio as hf_load_audio

    from hexforge.runtime.media import load_audio

    path = tmp_path / f"clip.{fmt.lower()}"
    sf.write(path, _speech_like(1.3, rate, channels, peak), rate, format=fmt, subtype=subtype)
    want = hf_load_audio(str(path), sampling_rate=SR, backend="soundfile")
    got = load_audio(path, prep.sampling_rate, prep.max_seconds)
    assert got.dtype == np.float32 and got.shape == want.shape == (20_800,)  # 1.3 s at 16 kHz
    np.testing.assert_array_equal(got, want)
    if peak == 1.0:
        assert np.abs(got).max() > 1.0
    inputs, n_soft = prep(got)
    feats, mask = _hf_features(fe, want)
    assert np.abs(inputs["input_features"][0, : feats.shape[0]] - feats).max() <= 1e-5
    np.testing.assert_array_equal(inputs["input_features_mask"][0, : mask.shape[0]],
                                  mask.astype(np.float32))
    with torch.no_grad():
        out = hf.model.get_audio_features(torch.from_numpy(feats[None]), torch.from_numpy(mask[None]))
    assert n_soft == int(out.attention_mask.sum())


def test_torch_module_matches_hf(hf, spec, example):
    _, ref = example
    module = ENCODER.encoder_module(hf, spec)
    with torch.no_grad():
        soft = module(*module.example_inputs())[0].numpy()  # [S, H_text]
    n = ref.shape[0]
    assert soft.shape == (spec.max_soft_tokens, hf.config.text_config.hidden_size)
    assert 0 < n < spec.max_soft_tokens  # the example leaves padding rows
    assert cosine(soft[:n], ref) >= 0.99999
    assert not soft[n:].any()  # rows past the audio are zero


def test_torch_module_keeps_finite_clip_bounds(hf, spec, example):
    """The tiny checkpoint's clippable linears are unbounded (±inf); give them bounds that bite and
    check the static module clamps where HF does."""
    inputs, unclipped = example
    model = copy.deepcopy(hf)
    for name, mod in model.model.audio_tower.named_modules():
        if name.endswith(("q_proj", "ffw_layer_1", "linear_start")):
            mod.input_min.fill_(-0.5)
            mod.input_max.fill_(0.5)
            mod.output_min.fill_(-0.3)
            mod.output_max.fill_(0.3)
    ref = ENCODER.reference(model, inputs)["soft"]
    assert cosine(ref, unclipped) < 0.999  # the bounds do change HF's output
    module = ENCODER.encoder_module(model, spec)
    with torch.no_grad():
        soft = module(*module.example_inputs())[0].numpy()
    assert cosine(soft[: ref.shape[0]], ref) >= 0.99999


@pytest.mark.parametrize("chunk,left,right", [(3, 6, 2), (4, 2, 1), (12, 13, 0)])
def test_chunking_geometries_match_hf(chunk, left, right, tmp_path):
    """Other chunk / left / right contexts than the fixture's (4, 5, 0): P != C, future keys, and
    the real model's (12, 13, 0), on a random tower + embedder (no checkpoint)."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig, Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import (
        Gemma4AudioModel,
        Gemma4MultimodalEmbedder,
    )

    from hexforge.families.gemma4_audio import Args, AudioEncoder, feature_extractor_params

    torch.manual_seed(0)
    cfg = Gemma4AudioConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 4],
        attention_chunk_size=chunk, attention_context_left=left, attention_context_right=right,
        output_proj_dims=48)
    cfg._attn_implementation = "eager"
    tower = Gemma4AudioModel(cfg).eval()
    embed = Gemma4MultimodalEmbedder(cfg, Gemma4TextConfig(hidden_size=64, vocab_size=100)).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # per_dim_scale, norms: off their init values
    params = {**feature_extractor_params(tmp_path), "max_seconds": 1.0}  # no config: HF defaults
    prep = Gemma4AudioPrep(params)
    inputs, n = prep(chirp(0.63, SR))
    module = AudioEncoder(tower, embed, Args.from_config(cfg.to_dict()), prep.num_frames, inputs)
    with torch.no_grad():
        soft = module.eval()(*module.example_inputs())[0].numpy()
        out = tower(torch.from_numpy(inputs["input_features"]),
                    torch.from_numpy(inputs["input_features_mask"]) > 0.5)
        ref = embed(out.last_hidden_state)[0][out.attention_mask[0]].numpy()
    assert ref.shape[0] == n
    assert cosine(soft[:n], ref) >= 0.99999


def test_real_window_sizes(fe):
    """HF's defaults: a 30 s window, HF's frame count for 30 s of audio, and 750 soft tokens (the
    processor's audio_seq_length)."""
    from pathlib import Path

    from hexforge.families.gemma4_audio import feature_extractor_params

    prep = Gemma4AudioPrep(feature_extractor_params(Path("/nonexistent")))
    frames = _hf_features(fe, np.zeros(30 * SR, np.float32))[0].shape[0]
    assert (prep.max_seconds, prep.num_frames, prep.max_soft_tokens) == (30.0, frames, 750)


def test_onnx_cpu_matches_hf(onnx_graph, example):
    import onnxruntime as ort

    inputs, ref = example
    sess = ort.InferenceSession(str(onnx_graph), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input_features", "input_features_mask"]
    # the example also holds the Genie node's extra mask (mask_after_cnn): this graph's inputs
    soft = sess.run(None, {i.name: inputs[i.name] for i in sess.get_inputs()})[0][0]
    assert cosine(soft[: ref.shape[0]], ref) >= 0.99999


def test_qnn_sim_fp16_matches_hf(onnx_graph, example):
    """Compiled for v81 fp16 with CPU fallback disabled (every node on the HTP), run simulated."""
    import onnxruntime as ort

    from hexforge.forge.compile.contexts import compile_graph
    from hexforge.runtime import qnn

    inputs, ref = example
    ctx = onnx_graph.with_name("audio.ctx.onnx")
    compile_graph(onnx_graph, ctx, htp_arch=81, soc_model=87, fp16=True)
    so = qnn.session_options(qnn.provider_options(81, 87, fp16=True), {})
    with qnn.native_stdout_to_stderr():
        sess = ort.InferenceSession(str(ctx), so)
    soft = sess.run(None, {i.name: inputs[i.name] for i in sess.get_inputs()})[0][0]
    n = ref.shape[0]
    assert np.isfinite(soft).all()
    assert cosine(soft[:n], ref) >= 0.999


def test_bad_audio_refused(prep):
    too_long = np.zeros(round((WINDOW_S + 0.5) * SR), np.float32)
    with pytest.raises(MediaError, match=r"2\.50 s long.*2 s audio window"):
        prep(too_long)
    with pytest.raises(MediaError, match="empty"):
        prep(np.zeros(0, np.float32))
    with pytest.raises(MediaError, match="too short"):
        prep(np.zeros(100, np.float32))  # < one 20 ms frame: HF makes no frame either
    with pytest.raises(MediaError, match="NaN"):
        prep(np.full(SR, np.nan, np.float32))
    with pytest.raises(MediaError, match="mono"):
        prep(np.zeros((SR, 2), np.float32))
    prep(np.zeros(round(WINDOW_S * SR), np.float32))  # exactly the window is fine
