"""Qwen3-VL (tiny random checkpoint: 4 Qwen3 text layers with interleaved M-RoPE 6/5/5; a 3-block
vision tower, patch 16, merge 2, deepstack from blocks 0 and 2 into text layers 0 and 1).

One build (cpu + v79 + v81, fp16 on the HTP) serves every bundle test; the vision graph is also
exported standalone at a non-square size (96 x 128: a 6 x 8 patch grid) so h/w mix-ups show.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import hexforge
from hexforge.bundle.manifest import load_manifest
from hexforge.families import encoder_families
from hexforge.forge.oracle.verify import cosine_rows
from hexforge.runtime.backends import Backend
from hexforge.runtime.engine import Engine
from hexforge.runtime.multimodal import MediaRows, mrope_positions
from hexforge.runtime.sampling import greedy
from hexforge.runtime.vision import Qwen2VLImagePrep
from tests.conftest import prompt_ids

FAMILY = "qwen3_vl"
NON_SQUARE = (96, 128)  # H x W of the standalone vision export
HTP_ARCHS = {"v79": 79, "v81": 81}


def photo(h: int, w: int, seed: int = 0) -> Image.Image:
    """A non-square RGB test image: gradients + noise (every patch differs)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([255 * x / w, 255 * y / h, 128 + 0 * x], -1) + rng.normal(0, 30, (h, w, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def built(htp_bundle):
    return htp_bundle(FAMILY, "fp16", "cpu,v79,v81", verify_tokens=8)


@pytest.fixture(scope="module")
def encoder(ckpt):
    return encoder_families(json.loads((ckpt(FAMILY) / "config.json").read_text()))[0]


@pytest.fixture(scope="module")
def non_square(ckpt, hf_model, encoder, tmp_path_factory):
    """(spec, ORT CPU session) of the vision graph exported at 96 x 128."""
    import onnxruntime as ort

    from hexforge.forge.export.onnxexport import export_module

    hf = hf_model(FAMILY)
    spec = encoder.spec(hf, json.loads((ckpt(FAMILY) / "config.json").read_text()),
                        image_size=NON_SQUARE)
    path = tmp_path_factory.mktemp("qvl-vision") / "vision.onnx"
    export_module(encoder.encoder_module(hf, spec), path, "torchscript")
    return spec, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def image_prompt(spec, n_soft: int) -> list[int]:
    """text, <vision_start> <image_pad> x n <vision_end>, text (as HF's processor expands it)."""
    text = prompt_ids(9, seed=3)
    return text[:4] + [spec.begin_id] + [spec.placeholder_id] * n_soft + [spec.end_id] + text[4:]


def media_rows(spec, ids: list[int], outputs: dict[str, np.ndarray]) -> MediaRows:
    n = spec.max_soft_tokens
    pos, delta = mrope_positions(ids, spec)
    index = np.flatnonzero(np.asarray(ids) == spec.placeholder_id)
    return MediaRows(index=index, embeds=outputs["soft"][0, :n],
                     extra={b: v[0, :n] for b, v in outputs.items() if b != "soft"},
                     rope_positions=pos, rope_delta=delta)


def hf_image_run(hf, ids: list[int], inputs: dict, new_tokens: int = 0):
    """HF on an image prompt: greedy tokens (EOS off) if new_tokens, else last-token logits."""
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), mm_token_type_ids=(x == hf.config.image_token_id).int(),
              pixel_values=torch.from_numpy(inputs["pixel_values"][0]),
              image_grid_thw=torch.from_numpy(inputs["image_grid_thw"]))
    with torch.no_grad():
        if not new_tokens:
            return hf(x, **kw).logits[0, -1].numpy()
        saved, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None
        try:
            out = hf.generate(x, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)
        finally:
            hf.generation_config.eos_token_id = saved
    return out[0, len(ids):].tolist()


def assert_close_rows(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], gate: float):
    assert set(got) == set(ref) == {"soft", "deepstack:0", "deepstack:1"}
    for bind, want in ref.items():
        cos = cosine_rows(got[bind][0, :want.shape[0]], want).min()
        assert cos >= gate, f"{bind}: cos {cos:.7f} < {gate}"


# ---- host ----------------------------------------------------------------------------------------


def test_host_pixels_match_hf_processor_on_a_non_square_image(ckpt, monkeypatch):
    """Qwen2VLImageProcessorPil with its smart_resize pinned to the build size (the only step a
    fixed-shape graph changes) vs our numpy/pillow port: resize, rescale, normalize, temporal
    duplicate, merge-order patchify."""
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    proc = pil.Qwen2VLImageProcessorPil.from_pretrained(str(ckpt(FAMILY)))
    H, W = NON_SQUARE
    monkeypatch.setattr(pil, "smart_resize", lambda *a, **k: (H, W))
    img = photo(70, 150)
    want = proc(images=[img], return_tensors="np")
    params = {"height": H, "width": W, "patch_size": proc.patch_size,
              "temporal_patch_size": proc.temporal_patch_size, "merge_size": proc.merge_size,
              "image_mean": list(proc.image_mean), "image_std": list(proc.image_std)}
    got, n = Qwen2VLImagePrep(params)(img)
    assert got["pixel_values"].shape == (1, *want["pixel_values"].shape)
    assert np.abs(got["pixel_values"][0] - want["pixel_values"]).max() <= 1e-5
    assert got["image_grid_thw"].tolist() == want["image_grid_thw"].tolist() == [[1, 6, 8]]
    assert n == 12


def test_mrope_positions_match_hf_get_rope_index(hf_model, non_square):
    """Two non-square images between text runs: positions [3, P] and rope_delta as HF's."""
    spec, _ = non_square
    hf = hf_model(FAMILY)
    n = spec.max_soft_tokens
    img = [spec.begin_id] + [spec.placeholder_id] * n + [spec.end_id]
    ids = [7, 8, 9, *img, 10, 11, *img, 12]
    pos, delta = mrope_positions(ids, spec)
    x = torch.tensor([ids])
    want, want_delta = hf.model.get_rope_index(
        x, mm_token_type_ids=(x == spec.placeholder_id).int(),
        image_grid_thw=torch.tensor([[1, 6, 8]] * 2))
    assert pos.tolist() == want[:, 0].tolist()
    assert delta == int(want_delta) < 0


def test_rope_tables_match_hf_mrope(built, hf_model):
    """Host cos/sin from [3, T] positions = HF Qwen3VLTextRotaryEmbedding (interleaved sections);
    1-D positions = the same positions on all three axes."""
    from hexforge.bundle.hostfile import load_host_tensors
    from hexforge.runtime.host import HostInputs

    m = load_manifest(built)
    host = HostInputs(m.host, load_host_tensors(built / m.host_tensors), 64)
    pos = np.random.default_rng(0).integers(0, 64, (3, 20))
    cos, sin = host.rope_tables("default", pos)
    rot = hf_model(FAMILY).model.language_model.rotary_emb
    with torch.no_grad():
        want_cos, want_sin = rot(torch.zeros(1), torch.from_numpy(pos)[:, None])
    assert np.abs(cos - want_cos.numpy()).max() < 1e-6
    assert np.abs(sin - want_sin.numpy()).max() < 1e-6
    flat = host.rope_tables("default", pos[0])
    same = host.rope_tables("default", np.stack([pos[0]] * 3))
    assert np.array_equal(flat[0], same[0]) and np.array_equal(flat[1], same[1])


# ---- vision graph --------------------------------------------------------------------------------


def test_vision_cpu_matches_hf(built, hf_model, encoder, non_square):
    """Merged embeddings + each deepstack feature, cos >= 0.99999: the bundle's (square, default
    size) graph and the standalone non-square export."""
    hf = hf_model(FAMILY)
    m = load_manifest(built)
    spec = m.encoders[0]
    assert (spec.params["height"], spec.params["width"], spec.max_soft_tokens) == (128, 128, 16)
    inputs = encoder.example_inputs(spec)
    eng = Engine(built, m, "cpu", Backend("cpu"))
    assert_close_rows(eng.encode(spec, inputs), encoder.reference(hf, inputs), 0.99999)

    spec, sess = non_square
    inputs = Qwen2VLImagePrep(spec.params)(photo(70, 150))[0]
    outs = sess.run(None, {"pixel_values": inputs["pixel_values"]})
    got = dict(zip(["soft", "deepstack:0", "deepstack:1"], outs, strict=True))
    assert_close_rows(got, encoder.reference(hf, inputs), 0.99999)


def test_regression_a_second_image_overwrote_the_first_images_soft_tokens(built):
    """The IO-bound vision session returns its own output buffers: a prompt's second image ran
    into them while the first image's rows (views) were still to be read."""
    from hexforge.runtime.multimodal import encode_items

    m = load_manifest(built)
    spec = m.encoders[0]
    eng = Engine(built, m, "cpu", Backend("cpu"))
    items = [Qwen2VLImagePrep(spec.params)(photo(70, 150, seed=s))[0] for s in (1, 2)]
    alone = [eng.encode(spec, x)["soft"][0].copy() for x in items]
    assert not np.allclose(alone[0], alone[1])
    got = encode_items(eng, spec, items, [spec.max_soft_tokens] * 2)
    for (soft, _), want in zip(got, alone, strict=True):
        np.testing.assert_array_equal(soft, want)


@pytest.mark.parametrize("arch", HTP_ARCHS)
def test_vision_htp_fp16_matches_hf(built, hf_model, encoder, arch):
    """The same bundle's vision context binaries for v79 and v81 on the simulator (CPU fallback
    disabled): cos >= 0.999."""
    m = load_manifest(built)
    spec = m.encoders[0]
    eng = Engine(built, m, arch, Backend.resolve("qnn-sim", HTP_ARCHS[arch]))
    inputs = encoder.example_inputs(spec)
    assert_close_rows(eng.encode(spec, inputs), encoder.reference(hf_model(FAMILY), inputs), 0.999)


# ---- text decoder --------------------------------------------------------------------------------


def test_text_prompt_greedy_equals_hf(built, hf_greedy):
    ids = prompt_ids(21)
    got = hexforge.load(built).generate(ids, max_new_tokens=32, ignore_eos=True)
    assert got.token_ids == hf_greedy(FAMILY, ids, 32)


@pytest.mark.parametrize("size", ["bundle", "non_square"])
def test_image_prompt_greedy_equals_hf(built, hf_model, encoder, non_square, size):
    """Image prompt through the CPU bundle: soft tokens + deepstack rows + M-RoPE positions ->
    32 greedy tokens = HF generate with the same pixels. The prompt crosses AR-N chunks."""
    m = load_manifest(built)
    eng = Engine(built, m, "cpu", Backend("cpu"))
    if size == "bundle":
        spec = m.encoders[0]
        inputs = Qwen2VLImagePrep(spec.params)(photo(70, 150, seed=1))[0]
        outputs = eng.encode(spec, inputs)
    else:
        spec, sess = non_square
        inputs = Qwen2VLImagePrep(spec.params)(photo(70, 150, seed=1))[0]
        outputs = dict(zip(["soft", "deepstack:0", "deepstack:1"],
                           sess.run(None, {"pixel_values": inputs["pixel_values"]}), strict=True))
    ids = image_prompt(spec, spec.max_soft_tokens)
    assert len(ids) > eng.prefill_len
    rows = media_rows(spec, ids, outputs)
    got = [t for t, _ in eng.generate_step(ids, greedy, 32, media=rows)]
    assert got == hf_image_run(hf_model(FAMILY), ids, inputs, 32)


def test_image_prompt_needs_mrope_and_deepstack(built, hf_model, encoder):
    """The image test can fail: dropping the 3-D positions or the deepstack rows moves the logits
    off HF's (while the full recipe matches to 1e-4)."""
    m = load_manifest(built)
    spec = m.encoders[0]
    eng = Engine(built, m, "cpu", Backend("cpu"))
    inputs = Qwen2VLImagePrep(spec.params)(photo(70, 150, seed=2))[0]
    ids = image_prompt(spec, spec.max_soft_tokens)
    rows = media_rows(spec, ids, eng.encode(spec, inputs))
    want = hf_image_run(hf_model(FAMILY), ids, inputs)

    def logits(r: MediaRows) -> np.ndarray:
        eng.reset()
        return eng.prefill(ids, media=r)

    assert np.abs(logits(rows) - want).max() < 1e-4
    flat = MediaRows(rows.index, rows.embeds, rows.extra)  # 1-D positions
    no_ds = MediaRows(rows.index, rows.embeds, {}, rows.rope_positions, rows.rope_delta)
    for broken in (flat, no_ds):
        assert np.abs(logits(broken) - want).max() > 1e-2


@pytest.mark.parametrize("arch", HTP_ARCHS)
def test_htp_targets_run_text_and_image_prompts(built, hf_model, hf_greedy, encoder, arch):
    """v79 and v81 from one build, on the simulator: the build's oracle passed; a text and an image
    prompt (the target's own vision graph) give HF's last-token logits at cos >= 0.999."""
    report = json.loads((built / "report.json").read_text())
    assert report[arch]["passed"]
    m = load_manifest(built)
    spec = m.encoders[0]
    hf = hf_model(FAMILY)
    eng = Engine(built, m, arch, Backend.resolve("qnn-sim", HTP_ARCHS[arch]))
    ids = prompt_ids(21)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1].numpy()
    eng.reset()
    assert cosine_rows(eng.prefill(ids)[None], want[None])[0] >= 0.999
    inputs = Qwen2VLImagePrep(spec.params)(photo(70, 150, seed=1))[0]
    ids = image_prompt(spec, spec.max_soft_tokens)
    eng.reset()
    got = eng.prefill(ids, media=media_rows(spec, ids, eng.encode(spec, inputs)))
    assert cosine_rows(got[None], hf_image_run(hf, ids, inputs)[None])[0] >= 0.999


def assert_api_image_prompt_equals_hf(b, hf, tmp_path):
    """hexforge.load(b).generate(text with the image placeholder, images=[file]): the host
    decodes + preprocesses the file, expands <vision_start> <image_pad> x n <vision_end> (the
    template's own start/end are not doubled), makes M-RoPE positions: 32 tokens = HF."""
    model = hexforge.load(b)
    spec = model.manifest.encoders[0]
    photo(70, 150, seed=4).save(tmp_path / "p.png")
    from tokenizers import Tokenizer

    tok = model.tokenizer
    raw = Tokenizer.from_file(str(b / "tokenizer" / "tokenizer.json"))
    vs, ve = raw.id_to_token(spec.begin_id), raw.id_to_token(spec.end_id)
    prompt = f"Look: {vs}{spec.placeholder_text}{ve} and say."
    res = model.generate(prompt, images=[tmp_path / "p.png"], max_new_tokens=32, ignore_eos=True)
    text = tok.encode(prompt)
    at = text.index(spec.placeholder_id)
    ids = text[:at] + [spec.placeholder_id] * spec.max_soft_tokens + text[at + 1:]
    assert res.prompt_tokens == len(ids)
    inputs = Qwen2VLImagePrep(spec.params)(Image.open(tmp_path / "p.png").convert("RGB"))[0]
    assert res.token_ids == hf_image_run(hf, ids, inputs, 32)


def test_python_api_image_prompt_greedy_equals_hf(built, hf_model, tmp_path):
    assert_api_image_prompt_equals_hf(built, hf_model(FAMILY), tmp_path)


IMAGE_TURN = "<|vision_start|><|image_pad|><|vision_end|>What is this?"


def chat_equals_hf(b, ckpt_dir, hf, image, turns, lose_state: bool = False) -> int:
    """A session over turns [(text, images)]: the earlier turns one token each (their prompts
    are then prefixes of the next), the last 16 greedy tokens = HF generate on the whole
    conversation (HF's tokenizer chat template, turn answers included; the image expanded to
    its soft tokens, its pixels and grid). lose_state: another request runs on the model before
    the last turn. -> the last turn's reused prompt tokens."""
    from transformers import AutoTokenizer

    model = hexforge.load(b)
    spec = model.manifest.encoders[0]
    s = model.session()
    conversation = []
    for k, (text, images) in enumerate(turns):
        last = k + 1 == len(turns)
        if last and lose_state:
            model.generate("Something else.", max_new_tokens=2)
        res = s.send(text, images=images, max_new_tokens=16 if last else 1, ignore_eos=last)
        conversation.append({"role": "user", "content": text})
        if not last:
            conversation.append({"role": "assistant", "content": res.text})
    tok = AutoTokenizer.from_pretrained(str(ckpt_dir))
    ids = tok(tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    at = ids.index(spec.placeholder_id)
    ids = ids[:at] + [spec.placeholder_id] * spec.max_soft_tokens + ids[at + 1:]
    assert res.prompt_tokens == len(ids)
    inputs = Qwen2VLImagePrep(spec.params)(Image.open(image).convert("RGB"))[0]
    assert res.token_ids == hf_image_run(hf, ids, inputs, 16)
    return s.last_reused


def test_chat_with_an_image_in_the_second_turn_greedy_equals_hf(built, ckpt, hf_model, tmp_path):
    """Turn 1 text, turn 2 an image: only what follows turn 1's prompt is prefilled, the image's
    soft tokens, deepstack rows and M-RoPE positions (after turn 1's text) in that span."""
    photo(70, 150, seed=4).save(tmp_path / "p.png")
    turns = [("Hi there!", None), (IMAGE_TURN, [tmp_path / "p.png"])]
    assert chat_equals_hf(built, ckpt(FAMILY), hf_model(FAMILY), tmp_path / "p.png", turns) > 0


@pytest.mark.parametrize("state", ["kept", "lost"])
def test_chat_text_turn_after_an_image_turn_greedy_equals_hf(built, ckpt, hf_model, tmp_path,
                                                            state):
    """Turn 1 an image, turn 2 text. kept: turn 2 continues the state, its positions past the
    image's M-RoPE grid (rope_delta); lost: another request used the engine in between, so turn 2
    prefills the whole conversation again, turn 1's image included (the session kept its rows)."""
    photo(70, 150, seed=4).save(tmp_path / "p.png")
    turns = [(IMAGE_TURN, [tmp_path / "p.png"]), ("And then?", None)]
    reused = chat_equals_hf(built, ckpt(FAMILY), hf_model(FAMILY), tmp_path / "p.png", turns,
                            lose_state=state == "lost")
    assert (reused > 0) == (state == "kept")


def test_regression_cli_image_size_was_ignored(ckpt, hf_model, tmp_path):
    """``hexforge build --image-size HxW`` builds the vision graph at that size (the CLI dropped
    the flag: the bundle came out at the default resolution without a word); the build log and
    ``hexforge inspect`` (text and JSON) name the size; an image prompt then equals HF's tokens."""
    from tests.test_cli import hexforge as cli

    out = tmp_path / "b"
    r = cli("build", ckpt(FAMILY), "-o", out, "--image-size", "64x96", "--context", "256",
            "--prefill-len", "8", "--verify-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "encoder vision: images resized to 64x96 (H x W), up to 6 soft tokens" in r.stderr
    spec = load_manifest(out).encoders[0]
    assert (spec.params["height"], spec.params["width"], spec.max_soft_tokens) == (64, 96, 6)
    info = json.loads(cli("inspect", out, "--json").stdout)
    assert info["encoders"][0]["input"]["image_size"] == [64, 96]
    assert "images resized to 64x96 (H x W)" in " ".join(cli("inspect", out).stdout.split())
    assert_api_image_prompt_equals_hf(out, hf_model(FAMILY), tmp_path)


def test_w8a16_image_prompt_is_calibrated_on_images(htp_bundle, hf_model):
    """w8a16 calibration runs an image prompt too: the deepstack inputs and soft-token rows get
    their own ranges (text alone calibrated deepstack on zeros: image logits cos 0.926)."""
    b = htp_bundle(FAMILY, "w8-u16")
    m = load_manifest(b)
    spec = m.encoders[0]
    eng = Engine(b, m, "v81", Backend.resolve("qnn-sim", 81))
    inputs = Qwen2VLImagePrep(spec.params)(photo(70, 150, seed=1))[0]
    ids = image_prompt(spec, spec.max_soft_tokens)
    got = eng.prefill(ids, media=media_rows(spec, ids, eng.encode(spec, inputs)))
    want = hf_image_run(hf_model(FAMILY), ids, inputs)
    assert cosine_rows(got[None], want[None])[0] >= 0.999
