"""Genie pipelines (issue 61) on the x86 simulator: a bundle's media towers as GenieNode graphs
beside its Genie decoder, image and audio prompts run by libGenie's GeniePipeline.

Plumbing on tiny random models: libGenie's greedy tokens equal qnn-sim's for the same prompt and
media, from a real PNG and a 44.1 kHz WAV file. A tiny model can give equal tokens from inputs
Genie left zero-filled, so the witnesses are Genie's own: its verbose log (no input unconnected)
and, for Qwen3-VL, the tensors it fed the decoder (dump-tensors) against hexforge's media path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import HTP_N

NEW = 12


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A non-square RGB PNG and a 1.3 s 16-bit PCM WAV at 44.1 kHz (a chirp)."""
    import soundfile as sf
    from PIL import Image

    d = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((45, 83, 3)) * 255).astype(np.uint8)).save(d / "photo.png")
    t = np.arange(int(44100 * 1.3)) / 44100
    sf.write(d / "speech.wav", 0.4 * np.sin(2 * np.pi * (300 + 400 * t) * t), 44100,
             subtype="PCM_16")
    loud = 40.0 * np.sin(2 * np.pi * 440 * t[:20000])  # a float WAV far past full scale
    sf.write(d / "loud.wav", loud.astype(np.float32), 44100, subtype="FLOAT")
    return d


@pytest.fixture(scope="module")
def gemma4(htp_bundle):
    return htp_bundle("gemma4_mm", "fp16", genie=True, audio_seconds=4.0)


@pytest.fixture(scope="module")
def qwen3_vl(htp_bundle):
    # no oracle: its teacher-forced top-1 gate (0.98) flips on this random model's near-ties
    # (genie-v81: 2 of 64 rows at KL 3e-8, the v81 target 1 of 64); numerics are the real
    # models' business, this file's is plumbing
    return htp_bundle("qwen3_vl", "fp16", genie=True, verify=False)


def _both(bundle, prompt: str, log_level: str = "verbose", **media) -> tuple[list, list, list]:
    """(qnn-sim's tokens, Genie's, Genie's log lines) for one prompt with media."""
    import hexforge
    from hexforge.runtime.genie.pipelinemodel import open_genie

    want = hexforge.load(bundle, backend="qnn-sim").generate(
        prompt, max_new_tokens=NEW, ignore_eos=True, **media).token_ids
    model = open_genie(bundle, log_level=log_level)
    try:
        got = model.generate(prompt, max_new_tokens=NEW, ignore_eos=True, **media).token_ids
        return want, got, list(model._made[2].lines)
    finally:
        model.close()


def test_gemma4_image_and_audio_prompts_through_genie_equal_qnn_sim(gemma4, media):
    folder = gemma4 / "genie-v81"
    spec = json.loads((folder / "genie_pipeline.json").read_text())
    assert set(spec["media"]) == {"image", "audio"}
    for kind, item in (("images", "photo.png"), ("audios", "speech.wav")):
        want, got, log = _both(gemma4, "Describe it.", **{kind: [str(media / item)]})
        assert got == want, kind
        assert not [ln for ln in log if "Unconnected input" in ln], kind


def test_gemma4_pipeline_keeps_a_16_bit_lut_that_covers_its_towers_rows(gemma4, ckpt):
    """Gemma-4's towers prove a bound on their rows (families/gemma4_vision.embedder_bound), so
    its Genie folder takes the 16-bit LUT (E4B: 7 GB, not 14 as float32); the test above runs
    its image (a node connection) and its audio (rows quantized by the host) through it."""
    emb = json.loads((gemma4 / "genie-v81" / "genie_config.json").read_text())["dialog"]["embedding"]
    assert emb["datatype"] == "ufixed16" and (gemma4 / "genie-v81" / "embedding.u16").exists()
    q = emb["quant-param"]  # real = scale x (q + offset), q in 0..65535
    lo, hi = q["scale"] * q["offset"], q["scale"] * (65535 + q["offset"])
    from hexforge.bundle.manifest import load_manifest
    from hexforge.families import encoder_families, load_family
    from hexforge.forge.genie.towers import media_row_bound

    fam = load_family("gemma4").FAMILY
    m = load_manifest(gemma4)
    bound = media_row_bound(encoder_families(m.hf_config), m.encoders, {"image", "audio"},
                            fam.load_hf(ckpt("gemma4_mm")), print)
    assert bound > 0 and lo <= -bound and hi >= bound


def test_regression_host_routed_rows_are_quantized_into_a_16_bit_lut():
    """A float32 row set on the text-generator of a uint16-LUT dialog was read as LUT codes
    (tiny Gemma-4's audio answer differed from its first token): the host quantizes it."""
    from hexforge.bundle.lut import LutEncoding
    from hexforge.runtime.genie.pipelinemodel import lut_rows

    rows = np.random.default_rng(0).normal(size=(5, 12)).astype(np.float32)
    enc = LutEncoding(scale=1e-3, zero_point=31000)
    cfg = {"dialog": {"embedding": {"datatype": "ufixed16", "quant-param": {
        "scale": enc.scale, "offset": -enc.zero_point}}}}
    got = lut_rows(rows, cfg)
    assert got.dtype == np.uint16 and np.array_equal(got, enc.quantize(rows))
    assert lut_rows(rows, {"dialog": {"embedding": {"datatype": "float32"}}}) is rows


def test_gemma4_embedder_bound_holds_for_any_input():
    """Whatever the tower hands it (huge, tiny, one-hot, aligned with the worst row), the
    embedder's output stays within the bound the 16-bit LUT is sized by."""
    from types import SimpleNamespace

    import torch
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

    from hexforge.families.gemma4_vision import embedder_bound

    torch.manual_seed(0)
    e = Gemma4MultimodalEmbedder(SimpleNamespace(hidden_size=24, rms_norm_eps=1e-6),
                                 SimpleNamespace(hidden_size=16))
    bound = embedder_bound(e)
    worst = e.embedding_projection.weight[e.embedding_projection.weight.norm(dim=1).argmax()]
    xs = [torch.randn(64, 24) * 1e4, torch.randn(64, 24) * 1e-3, torch.eye(24) * 7,
          worst.view(1, 24) * 3, -worst.view(1, 24)]
    with torch.no_grad():
        top = max(float(e(x).abs().max()) for x in xs)
    assert top <= bound and top > 0.9 * bound  # tight: the worst row's own direction reaches it


def test_qwen3_vl_image_through_genie_equal_qnn_sim_with_hfs_positions_and_deepstack(
        qwen3_vl, media, tmp_path):
    """Genie places the image tokens' M-RoPE positions (qwen3vl-mrope, from the image node's
    vision-param) and each chunk's deepstack rows itself: the tensors it fed each prefill chunk
    are hexforge's own for the same prompt (runtime/multimodal.py, which equals HF)."""
    import hexforge
    from hexforge.runtime.genie.pipelinemodel import GeniePipelineModel
    from hexforge.runtime.multimodal import prepare_media

    image = str(media / "photo.png")
    want, got, log = _both(qwen3_vl, "Describe it.", images=[image])
    assert got == want
    # Genie logs the deepstack inputs "Unconnected" at init and fills them from the image
    # node's side outputs when a chunk holds image rows: what it fed is checked below
    # visual_pos_masks (GenieX's, forge/genie/geniex.py) it never writes: zero-filled, positional rows
    assert not [ln for ln in log if "Unconnected input" in ln
                and "deepstack_visual_embeds" not in ln and "visual_pos_masks" not in ln]

    dump = tmp_path / "dump"
    model = GeniePipelineModel(qwen3_vl, dump_tensors=dump)
    try:
        model.generate("Describe it.", images=[image], max_new_tokens=1, ignore_eos=True)
    finally:
        model.close()
    cpu = hexforge.load(qwen3_vl)
    ids, rows = prepare_media(cpu.engine, cpu.manifest, cpu.tokenizer.encode("Describe it."),
                              [image], None, {})
    (graph,) = [p for p in (dump / "text_primary").iterdir() if p.name.startswith("prompt")]
    cfg = json.loads((qwen3_vl / "genie-v81" / "genie_config.json").read_text())["dialog"]
    rope = cfg["engine"]["model"]["positional-encoding"]
    inv = 1.0 / rope["rope-theta"] ** (np.arange(rope["rope-dim"]) / rope["rope-dim"])
    sec = rope["rope-scaling"]["mrope-section"]
    # HF's interleaved M-RoPE: frequency j reads h where j % 3 == 1 (j < 3 sec_h), w where
    # j % 3 == 2 (j < 3 sec_w), t elsewhere
    axis = np.array([1 if j % 3 == 1 and j < 3 * sec[1] else 2 if j % 3 == 2 and j < 3 * sec[2]
                     else 0 for j in range(rope["rope-dim"])])
    feature = rows.extra["deepstack:0"]
    N = HTP_N
    for c in range(-(-len(ids) // N)):
        chunk = list(range(c * N, min((c + 1) * N, len(ids))))
        cos = np.fromfile(graph / f"{c:03d}_in_position_ids_cos", np.float32).reshape(N, -1)
        pos = rows.rope_positions[axis][:, chunk].T  # [T, R]: each frequency's axis position
        np.testing.assert_allclose(cos[:len(chunk)], np.cos(pos * inv), atol=1e-4)
        ds = np.fromfile(graph / f"{c:03d}_in_deepstack_visual_embeds_0",
                         np.float32).reshape(-1, feature.shape[1] + 1)  # + the unread column
        for r, i in enumerate(chunk):  # row r: the feature of the chunk's row r, zero on text
            k = np.flatnonzero(rows.index == i)
            expect = feature[k[0]] if len(k) else np.zeros(feature.shape[1])
            np.testing.assert_allclose(ds[r, :-1], expect, atol=2e-3)


def test_genie_refuses_audio_louder_than_its_node_holds(gemma4, media):
    """The audio node's log-mel input is uint16 over what a waveform in [-1, 1] can give: a
    float WAV far past full scale is refused in one line, never clipped by Genie unseen."""
    from hexforge.bundle.errors import RequestError
    from hexforge.runtime.genie.pipelinemodel import open_genie

    model = open_genie(gemma4)
    try:
        with pytest.raises(RequestError, match=r"past the .* this Genie node's input holds"):
            model.generate("Hi", audios=[str(media / "loud.wav")], max_new_tokens=2)
    finally:
        model.close()


def test_regression_an_audio_file_reads_after_a_qnn_session(gemma4, media):
    """libQnnHtp.so exports a libffi of its own into the global scope: a cffi callback made after
    the first QNN session bound it and soundfile refused every file ("ffi_prep_closure(): bad
    user_data"), so --backend qnn-sim --audio failed. A fresh process: session, then audio."""
    code = (
        "import onnxruntime as ort\n"
        "from hexforge.runtime import qnn\n"
        "from hexforge.runtime.media import load_audio\n"
        "so = qnn.session_options(qnn.provider_options(81, 87, True), {})\n"
        f"ort.InferenceSession({str(gemma4 / 'v81' / 'audio.ctx.onnx')!r}, so)\n"
        f"print(load_audio({str(media / 'speech.wav')!r}, 16000, 4.0).shape[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "20800"


@pytest.mark.parametrize("family", ["gemma4", "qwen3_vl"])
def test_deploy_runs_an_image_prompt_on_the_phone_through_genie_app(family, request, media, qairt,
                                                                    phone, tmp_path, capfd):
    """``hexforge deploy --image``: the request as a genie-app script (hexforge/commands/genie_app.py),
    pushed beside the Genie folder and QAIRT's genie-app by the adb stand-in; the genie-app
    stand-in runs the script through libGenie on the simulator, in the pushed folder: the tokens
    --backend genie gives for that prompt and image (plumbing: a tiny random model)."""
    from hexforge.commands.cli import main
    from hexforge.runtime.genie.pipelinemodel import open_genie

    bundle = request.getfixturevalue(family)
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    photo = str(media / "photo.png")
    assert main(["deploy", str(b), "--qairt", str(qairt), "--prompt", "Describe it.",
                 "--image", photo, "-n", "8"]) == 0
    assert "[BEGIN]: " in capfd.readouterr().out
    got = json.loads((phone.folder() / "standin-tokens.json").read_text())
    model = open_genie(bundle)
    try:
        want = model.generate("Describe it.", images=[photo], max_new_tokens=8).token_ids
    finally:
        model.close()
    assert got == want and len(want) == 8
    script = (phone.folder() / "request.script").read_text().splitlines()
    assert script[-1] == "pipeline execute pipeline"
    assert any(ln.startswith("node set image imageEncoder GENIE_NODE_IMAGE_ENCODER_IMAGE_INPUT ")
               for ln in script)
    assert "genie-app" in phone.pushed() and "genie-t2t-run" not in phone.pushed()


def test_deploy_refuses_audio_before_asking_the_phone(gemma4, media, qairt, phone, capsys):
    from hexforge.commands.cli import main

    assert main(["deploy", str(gemma4), "--qairt", str(qairt), "--prompt", "Hi",
                 "--audio", str(media / "speech.wav")]) == 2
    err = capsys.readouterr().err
    assert "genie-app names no audio-encoder input" in err and err.count("\n") == 1
    assert phone.calls() == []


def test_genie_nodes_export_from_a_bf16_checkpoint(gemma4, ckpt, tmp_path):
    """Regression (real-size Gemma-4-E4B, a bf16 checkpoint): the conformer's node computed its
    relative-position keys from the bf16 weights against fp32 inputs as it was built, outside
    the fp32 context its export had ("expected m1 and m2 to have the same dtype"); the tiny
    fixtures are fp32, so only the real size showed it."""
    import torch
    from safetensors.torch import load_file, save_file

    from hexforge.bundle.manifest import load_manifest
    from hexforge.families import encoder_families, load_family
    from hexforge.forge.context import StageContext
    from hexforge.forge.genie.towers import export_nodes
    from hexforge.forge.options import BuildOptions
    from hexforge.forge.source.checkpoint import read_checkpoint

    bf16 = tmp_path / "bf16"
    shutil.copytree(ckpt("gemma4_mm"), bf16)
    for f in bf16.glob("*.safetensors"):  # the checkpoint as real ones are stored
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                   for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    c = read_checkpoint(bf16)
    fam = load_family(c.model_type).FAMILY
    hf = fam.load_hf(c.dir)
    assert next(hf.parameters()).dtype == torch.bfloat16
    m = load_manifest(gemma4)
    ctx = StageContext(fam, hf, fam.Args.from_config(c.config), BuildOptions(exporter="torchscript"),
                       gemma4, lambda line: None)
    nodes = export_nodes(ctx, encoder_families(m.hf_config), m.encoders, m, tmp_path / "nodes")
    assert set(nodes) == {"image", "audio"}
    assert all(path.is_file() for _, path in nodes.values())
