"""Gemma-4 with vision + audio towers, end to end: build (encoders exported + oracle-gated),
image / audio prompts through the Python API and the CLI, greedy tokens vs HF generate."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

NEW = 32
CHAT_NEW = 16  # a chat's last turn: fewer tokens keep HF's generate with audio cheap


@pytest.fixture(scope="module")
def mm(ckpt, bundle):
    return ckpt("gemma4_mm"), bundle("gemma4_mm", audio_seconds=4.0)


@pytest.fixture(scope="module")
def hf(hf_model):
    return hf_model("gemma4_mm")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A non-square RGB image (png) and a 1.3 s 16 kHz chirp (float WAV) on disk."""
    import soundfile as sf
    from PIL import Image

    d = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    img = Image.fromarray((rng.random((45, 83, 3)) * 255).astype(np.uint8))
    img.save(d / "photo.png")
    t = np.arange(int(16000 * 1.3)) / 16000
    wav = (0.4 * np.sin(2 * np.pi * (300 + 400 * t) * t)).astype(np.float32)
    sf.write(d / "speech.wav", wav, 16000, subtype="FLOAT")
    return {"image": d / "photo.png", "audio": d / "speech.wav", "img": img, "wav": wav}


def _hf_generate(hf, ids: list[int], new: int = NEW, **inputs) -> list[int]:
    import torch

    gen = hf.generation_config
    saved, gen.eos_token_id = gen.eos_token_id, None
    try:
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                              pad_token_id=0, **inputs)
    finally:
        gen.eos_token_id = saved
    return out[0, len(ids):].tolist()


def _hf_image_inputs(ckpt_dir, img):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    cfg = json.loads((ckpt_dir / "processor_config.json").read_text())["image_processor"]
    proc = Gemma4ImageProcessorPil(**{k: cfg[k] for k in
                                      ("patch_size", "max_soft_tokens", "pooling_kernel_size")})
    out = proc(images=[img], return_tensors="pt")
    return out, int(out["num_soft_tokens_per_image"][0])


def _hf_audio_inputs(wav):
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    return Gemma4AudioFeatureExtractor()([wav], sampling_rate=16000, return_tensors="pt")


def _media_ids(model, prompt: str, begin: int, token: int, n: int, end: int) -> list[int]:
    """HF's prompt ids for one media item put first: BOS, begin, n placeholders, end, the text."""
    text = model.tokenizer.encode(prompt)
    return text[:1] + [begin] + [token] * n + [end] + text[1:]


def _hf_audio_tokens(hf, feats) -> int:
    with __import__("torch").no_grad():
        return int(hf.model.get_audio_features(feats["input_features"],
                                               feats["input_features_mask"]).attention_mask.sum())


def _hf_chat_ids(ckpt_dir, conversation: list[dict], begin: int, token: int, n: int,
                 end: int) -> list[int]:
    """HF's prompt ids of a chat with one media item: the conversation rendered by the
    tokenizer's chat template (generation prompt added), the item's placeholder expanded to
    begin, n placeholders, end (Gemma4Processor.replace_image_token / replace_audio_token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt_dir))
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    at = ids.index(token)
    return ids[:at] + [begin] + [token] * n + [end] + ids[at + 1:]


def test_build_gates_the_encoders_against_hf(mm):
    _, b = mm
    manifest = json.loads((b / "manifest.json").read_text())
    assert {e["modality"] for e in manifest["encoders"]} == {"image", "audio"}
    report = json.loads((b / "report.json").read_text())["cpu"]
    for name in ("vision", "audio"):
        enc = report["encoders"][name]
        assert enc["passed"] and enc["outputs"]["soft"]["cos_min"] >= 0.99999, enc


def test_image_prompt_greedy_equals_hf(mm, hf, media):
    import hexforge

    ckpt_dir, b = mm
    model = hexforge.load(b)
    prompt = "Describe this image."
    res = model.generate(prompt, images=[media["image"]], max_new_tokens=NEW, ignore_eos=True)
    inputs, n = _hf_image_inputs(ckpt_dir, media["img"])
    cfg = hf.config
    ids = _media_ids(model, prompt, cfg.boi_token_id, cfg.image_token_id, n, cfg.eoi_token_id)
    assert res.prompt_tokens == len(ids)
    want = _hf_generate(hf, ids, pixel_values=inputs["pixel_values"],
                        image_position_ids=inputs["image_position_ids"])
    assert res.token_ids == want


def test_audio_prompt_greedy_equals_hf(mm, hf, media):
    import hexforge

    _, b = mm
    model = hexforge.load(b)
    prompt = "Transcribe this audio."
    res = model.generate(prompt, audios=[media["audio"]], max_new_tokens=NEW, ignore_eos=True)
    feats = _hf_audio_inputs(media["wav"])
    n = _hf_audio_tokens(hf, feats)
    cfg = hf.config
    ids = _media_ids(model, prompt, cfg.boa_token_id, cfg.audio_token_id, n, cfg.eoa_token_index)
    assert res.prompt_tokens == len(ids)
    want = _hf_generate(hf, ids, input_features=feats["input_features"],
                        input_features_mask=feats["input_features_mask"])
    assert res.token_ids == want


@pytest.mark.parametrize("rate,fmt", [(44_100, "WAV"), (22_050, "FLAC")])
def test_regression_resampled_audio_gave_other_tokens_than_hf(mm, hf, tmp_path, rate, fmt):
    """A 1.3 s stereo file at 44.1 / 22.05 kHz: the audio soft tokens and the greedy tokens of
    HF's generate on its feature extractor fed by its own loader (transformers.audio_utils.
    load_audio). The scipy resampler's waveform moved the top mel bins by up to 3.4, and the
    tokens of a trained model from the first one; on this tiny random model the soft tokens
    show it (max |Δ| 0.05 of 0.39 at 44.1 kHz), the greedy tokens do not."""
    import soundfile as sf
    from transformers.audio_utils import load_audio as hf_load_audio

    import hexforge
    from hexforge.runtime.audio import Gemma4AudioPrep
    from hexforge.runtime.media import load_audio

    _, b = mm
    rng = np.random.default_rng(rate)
    t = np.arange(int(rate * 1.3)) / rate
    voice = 0.4 * np.sin(2 * np.pi * (300 + 400 * t) * t)
    stereo = np.stack([voice, 0.5 * voice], 1) + 0.05 * rng.standard_normal((t.size, 2))
    path = tmp_path / f"clip.{fmt.lower()}"
    sf.write(path, stereo, rate, format=fmt, subtype="PCM_16")
    model = hexforge.load(b)
    prompt = "Transcribe this audio."
    res = model.generate(prompt, audios=[path], max_new_tokens=NEW, ignore_eos=True)
    feats = _hf_audio_inputs(hf_load_audio(str(path), sampling_rate=16000, backend="soundfile"))
    with __import__("torch").no_grad():
        out = hf.model.get_audio_features(feats["input_features"], feats["input_features_mask"])
    n = int(out.attention_mask.sum())
    spec = next(e for e in model.manifest.encoders if e.modality == "audio")
    inputs, n_ours = Gemma4AudioPrep(spec.params)(load_audio(path, 16000, 4.0))
    soft = model.engine.encode(spec, inputs)["soft"][0, :n_ours]
    assert n_ours == n
    assert np.abs(soft - out.pooler_output[0, :n].numpy()).max() <= 1e-5
    cfg = hf.config
    ids = _media_ids(model, prompt, cfg.boa_token_id, cfg.audio_token_id, n, cfg.eoa_token_index)
    assert res.prompt_tokens == len(ids)
    want = _hf_generate(hf, ids, input_features=feats["input_features"],
                        input_features_mask=feats["input_features_mask"])
    assert res.token_ids == want


@pytest.mark.parametrize("modality", ["image", "audio"])
def test_chat_with_media_in_the_second_turn_greedy_equals_hf(mm, hf, media, modality):
    """Turn 1 text, turn 2 an image (no place marked: it goes before the text) or an audio clip
    (marked): the session prefills only what follows turn 1's prompt, with the item's soft tokens
    in that span, and gives HF's greedy tokens on the whole conversation — HF's chat template on
    both user turns and turn 1's answer, the placeholder expanded as HF's processor does."""
    import hexforge

    ckpt_dir, b = mm
    model = hexforge.load(b)
    s = model.session()
    first = s.send("Hi there!", max_new_tokens=1)  # one token: turn 1's prompt is in the state
    reusable = len(s.cached)
    mark = model.manifest.encoder(modality).placeholder_text
    text = "What is this?" if modality == "image" else f"{mark}Transcribe this."
    res = s.send(text, max_new_tokens=CHAT_NEW, ignore_eos=True,
                 **{f"{modality}s": [media[modality]]})
    assert s.last_reused == reusable > 0
    assert s.messages[2][f"{modality}s"] == [media[modality]]  # kept for a re-prefill
    conversation = [{"role": "user", "content": "Hi there!"},
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": text if modality == "audio" else mark + text}]
    cfg = hf.config
    if modality == "image":
        inputs, n = _hf_image_inputs(ckpt_dir, media["img"])
        ids = _hf_chat_ids(ckpt_dir, conversation, cfg.boi_token_id, cfg.image_token_id, n,
                           cfg.eoi_token_id)
        kw = dict(pixel_values=inputs["pixel_values"],
                  image_position_ids=inputs["image_position_ids"])
    else:
        feats = _hf_audio_inputs(media["wav"])
        ids = _hf_chat_ids(ckpt_dir, conversation, cfg.boa_token_id, cfg.audio_token_id,
                           _hf_audio_tokens(hf, feats), cfg.eoa_token_index)
        kw = dict(input_features=feats["input_features"],
                  input_features_mask=feats["input_features_mask"])
    assert res.prompt_tokens == len(ids)
    assert res.token_ids == _hf_generate(hf, ids, CHAT_NEW, **kw)


def test_cli_chat_attaches_an_image_to_the_next_message(mm, media, monkeypatch, capsys):
    """``hexforge chat``: /image PATH goes with the next message (a missing file is refused
    there and then); the replies are the Python session's."""
    import hexforge
    from hexforge.commands.cli import main

    _, b = mm
    lines = iter(["Hi there!", "/image no-such.png", f"/image {media['image']}", "What is this?",
                  "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", str(b), "-n", "4", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    s = hexforge.load(b).session()
    want = [s.send("Hi there!", max_new_tokens=4, ignore_eos=True).text,
            s.send("What is this?", images=[media["image"]], max_new_tokens=4,
                   ignore_eos=True).text]
    assert out.out == "".join(f"{t}\n" for t in want)
    assert "no-such.png" in out.err and "photo.png" in out.err


def test_text_only_prompt_on_the_multimodal_bundle_equals_hf(mm, hf):
    import hexforge

    _, b = mm
    model = hexforge.load(b)
    res = model.generate("The capital of France is", max_new_tokens=NEW, ignore_eos=True)
    assert res.token_ids == _hf_generate(hf, model.tokenizer.encode("The capital of France is"))


def test_placeholder_count_must_match_the_media(mm, media):
    import hexforge
    from hexforge.bundle.errors import RequestError

    _, b = mm
    model = hexforge.load(b)
    with pytest.raises(RequestError, match="2 image"):
        model.generate("<|image|> and <|image|>", images=[media["image"]], max_new_tokens=2)
    with pytest.raises(RequestError, match="conversation marks 3 image"):  # every turn's
        s = model.session()
        s.send("<|image|> first", images=[media["image"]], max_new_tokens=1)
        s.send("<|image|> and <|image|>", images=[media["image"]], max_new_tokens=1)


def test_cli_transcribes_a_wav_and_describes_an_image_end_to_end(mm, media, tmp_path):
    import soundfile as sf

    _, b = mm
    # a 44.1 kHz stereo WAV: resampled to the model's 16 kHz on the host
    t = np.arange(44100) / 44100
    tone = 0.3 * np.sin(2 * np.pi * 440 * t)
    sf.write(tmp_path / "tone.wav", np.stack([tone, tone * 0.5], 1), 44100)
    for flag, path, prompt in (("--audio", tmp_path / "tone.wav", "Transcribe this audio."),
                               ("--image", media["image"], "Describe this image.")):
        r = subprocess.run([sys.executable, "-m", "hexforge", "run", str(b), prompt, flag,
                            str(path), "-n", "4", "--json"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert len(out["token_ids"]) >= 1 and out["prompt_tokens"] > 10


def test_cli_refuses_a_file_that_is_not_an_image(mm, tmp_path):
    _, b = mm
    bad = tmp_path / "notes.jpg"
    bad.write_text("not an image at all")
    r = subprocess.run([sys.executable, "-m", "hexforge", "run", str(b), "hi", "--image", str(bad)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "image" in r.stderr.lower()


def test_v81_fp16_build_gates_the_encoders_and_runs_media_on_the_simulator(htp_bundle, media):
    """One cpu + v81 fp16 build: the decoder and both encoders pass their gates on qnn-sim, and
    image / audio prompts run there (the encoders compiled in fp16, CPU fallback disabled)."""
    import hexforge
    from tests.test_htp import QUANT_THRESHOLDS

    b = htp_bundle("gemma4_mm", "fp16", audio_seconds=4.0)
    rep = json.loads((b / "report.json").read_text())["v81"]
    assert rep["passed"], rep["failures"]
    assert rep["teacher_forced"]["cos_min"] >= QUANT_THRESHOLDS["fp16"]
    for name in ("vision", "audio"):
        assert rep["encoders"][name]["outputs"]["soft"]["cos_min"] >= 0.999
    cpu, sim = hexforge.load(b), hexforge.load(b, backend="qnn-sim")
    for kw in ({"images": [media["image"]]}, {"audios": [media["audio"]]}):
        want = cpu.generate("Describe it.", max_new_tokens=4, ignore_eos=True, **kw)
        got = sim.generate("Describe it.", max_new_tokens=4, ignore_eos=True, **kw)
        assert got.prompt_tokens == want.prompt_tokens
        assert got.token_ids[0] == want.token_ids[0]


def test_server_takes_images_and_audio_as_data_urls(mm, media):
    """OpenAI content parts: image_url data URL + input_audio base64 -> the same tokens as the
    Python API with the files; a remote URL and a non-image payload are 400s."""
    import base64

    from fastapi.testclient import TestClient

    import hexforge
    from hexforge.commands.serve import create_app

    _, b = mm
    model = hexforge.load(b)
    client = TestClient(create_app(model, "mm"))
    png = base64.b64encode(media["image"].read_bytes()).decode()
    wav = base64.b64encode(media["audio"].read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
               {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
               {"type": "text", "text": "What is this?"}]
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200, r.text
    image_text = model.manifest.encoder("image").placeholder_text
    audio_text = model.manifest.encoder("audio").placeholder_text
    want = model.chat([{"role": "user", "content": f"{image_text}{audio_text}What is this?"}],
                      images=[media["image"]], audios=[media["audio"]], max_new_tokens=6,
                      ignore_eos=True)
    assert r.json()["choices"][0]["message"]["content"] == want.text
    assert r.json()["usage"]["prompt_tokens"] == want.prompt_tokens
    for bad in ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                    + base64.b64encode(b"no image").decode()}}):
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [bad]}], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_server_takes_an_image_in_a_later_message(mm, media):
    """An OpenAI chat whose image comes in its third message, after a user turn and the
    assistant's answer: the same reply and prompt as the Python session's second turn."""
    import base64

    from fastapi.testclient import TestClient

    import hexforge
    from hexforge.commands.serve import create_app

    _, b = mm
    model = hexforge.load(b)
    s = model.session()
    first = s.send("Hi there!", max_new_tokens=1)
    want = s.send("What is this?", images=[media["image"]], max_new_tokens=6, ignore_eos=True)
    png = base64.b64encode(media["image"].read_bytes()).decode()
    messages = [{"role": "user", "content": "Hi there!"},
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                    {"type": "text", "text": "What is this?"}]}]
    r = TestClient(create_app(model, "mm")).post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want.text
    assert r.json()["usage"]["prompt_tokens"] == want.prompt_tokens


def test_encoder_build_options_are_checked_before_export(mm, tmp_path):
    from hexforge.bundle.errors import BuildError, CheckpointError
    from hexforge.forge.pipeline import BuildOptions, build

    ckpt_dir, _ = mm
    with pytest.raises(BuildError, match="--image-size does not apply"):
        build(ckpt_dir, tmp_path / "b1", BuildOptions(image_size=(64, 64)), log=lambda m: None)
    with pytest.raises(CheckpointError, match="audio window"):
        build(ckpt_dir, tmp_path / "b2", BuildOptions(audio_seconds=99.0), log=lambda m: None)
    assert not any(tmp_path.iterdir())  # nothing half-written
