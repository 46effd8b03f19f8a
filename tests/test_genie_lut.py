"""Genie's embedding LUT past what libGenie reads: at 4 GiB or more libGenie 1.21 reads rows at
offsets wrapped past 2^32 bytes (Gemma-4-E2B's 5.5 GB LUT: other tokens from the first decode
step, a prompt holding id 150000 refused; bench/genie_lut_reach.py rebuilds it on a tiny Gemma-4
in minutes). Such a LUT is written 8-bit with a scale a row (Genie's PCQ); with
--genie-host-rows the host holds the same rows, so libGenie = qnn-sim holds on one bundle (random
weights: plumbing, not accuracy); without it the targets keep their precision and the Genie
oracle judges the 8-bit rows.

The suite cannot write a 4 GiB LUT: the ceiling is lowered for the tiny Gemma-4 instead, and the
same code paths run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "genie_conformance.py"


def _bench():
    spec = importlib.util.spec_from_file_location("genie_conformance_lut", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_ceiling_is_libgenies_4_gib():
    from hexforge.forge.genie.folder import LUT_CEILING, lut_bytes, needs_row_lut

    assert LUT_CEILING == 2**32
    # Gemma-4-E2B (262,144 x [1,536 + 35 x 256]) and E4B (x [2,560 + 42 x 256]) go 8-bit a row
    assert needs_row_lut(262_144, 1536 + 35 * 256) and needs_row_lut(262_144, 2560 + 42 * 256)
    assert lut_bytes(262_144, 2560 + 42 * 256, 1) < LUT_CEILING  # and then fit
    # Gemma-3-270M's (262,144 x 640) and the tiny Gemma-4 at 2.2 GB (measured right) stay 16-bit
    assert not needs_row_lut(262_144, 640) and not needs_row_lut(262_144, 64 + 10 * 416)


def test_row_quantize_reads_back_jointly_scaled_host_rows_exactly():
    """The host's tables at ``joint_row_scales`` -> the LUT rows re-quantized a row at a time
    give back the host's own 8-bit values (what makes Genie's rows the host's)."""
    import torch

    from hexforge.forge.genie.folder import joint_row_scales, row_quantize

    rng = np.random.default_rng(0)
    a = torch.tensor(rng.normal(0, 0.02, (300, 16)), dtype=torch.bfloat16)
    b = torch.tensor(rng.normal(0, 0.5, (300, 40)), dtype=torch.bfloat16)
    b[7] = 0.0
    a[9], b[9] = 0.0, 0.0  # an all-zero row
    fa, fb = 8.0, 20.4
    sa, sb = joint_row_scales([(a, fa), (b, fb)], block=128)
    qa = np.clip(np.rint(a.float().numpy() / sa[:, None]), -127, 127)
    qb = np.clip(np.rint(b.float().numpy() / sb[:, None]), -127, 127)
    rows = np.concatenate([(qa * sa[:, None]) * np.float32(fa), (qb * sb[:, None]) * np.float32(fb)], 1)
    q, s = row_quantize(rows.astype(np.float32))
    assert np.array_equal(q.astype(np.int16) - 128, np.concatenate([qa, qb], 1).astype(np.int16))
    assert np.allclose(s, sa * fa, rtol=1e-6)


def test_regression_lut_past_4_gib_is_8_bit_a_row_and_genie_equals_qnn_sim(tmp_path, monkeypatch):
    """Without the 8-bit LUT the folder's LUT passes the ceiling (E2B: libGenie's tokens leave
    qnn-sim's); without the host holding the same rows, Genie's 8-bit rows give other tokens
    (measured on the tiny Gemma-4: every token differed)."""
    from dataclasses import replace

    from hexforge.bundle.hostfile import check_safetensors_header
    from hexforge.forge.genie import folder

    bench = _bench()
    variant = next(v for v in bench.MATRIX if v.name == "gemma4-seed1")
    variant = replace(variant, build={**variant.build, "genie_host_rows": True})
    monkeypatch.setattr(folder, "LUT_CEILING", 1)  # every LUT is past it
    bundle = bench.build_variant(variant, tmp_path)
    genie = bundle / "genie-v81"
    emb = json.loads((genie / "genie_config.json").read_text())["dialog"]["embedding"]
    assert emb["datatype"] == "ufixed8" and emb["quant-param"]["type"] == "pcq"
    rows = (genie / emb["lut-path"]).stat().st_size // emb["size"]
    assert (genie / emb["quant-param"]["scale"]).stat().st_size == 4 * rows
    header = check_safetensors_header(bundle / "host.safetensors")
    for table in ("embed_tokens", "embed_tokens_per_layer"):
        assert header[table]["dtype"] == "I8"
        assert header[table + ".int8_scales"]["shape"][1] == 1  # one scale a row
    assert bench.compare(bundle, variant, tmp_path) == []


def test_host_rows_into_an_8_bit_lut_go_in_the_graph_inputs_16_bit_codes():
    """Rows the host hands Genie (audio) with an 8-bit LUT: the graph input's encoding, which
    genie_pipeline.json carries (``rows_encoding``); a folder without it is refused in one line."""
    from hexforge.bundle.errors import RequestError
    from hexforge.bundle.lut import LutEncoding
    from hexforge.runtime.genie.pipelinemodel import lut_rows

    cfg = {"dialog": {"embedding": {"datatype": "ufixed8", "quant-param": {"type": "pcq"}}}}
    rows = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    got = lut_rows(rows, cfg, {"rows_encoding": [1e-3, 31000]})
    assert got.dtype == np.uint16 and np.array_equal(got, LutEncoding(1e-3, 31000).quantize(rows))
    with pytest.raises(RequestError, match="rebuild it") as e:
        lut_rows(rows, cfg, {"lut_width": 8})
    assert "\n" not in str(e.value)


def test_regression_an_8_bit_lut_pipeline_took_no_media_then_wrong_audio_rows(tmp_path,
                                                                             monkeypatch):
    """With the LUT 8-bit a row, libGenie's pipeline did not start ("PCQ scale file not found":
    the text-encoder node's scale / offset files were left relative), and audio rows handed over
    as float32 gave other tokens from the 4th; refused before. Now the image (a node connection:
    Genie converts the rows) and the recording (the host's rows in the graph input's codes) give
    qnn-sim's tokens (random weights: plumbing)."""
    import soundfile as sf
    from PIL import Image

    import hexforge
    from hexforge.forge.genie import folder
    from hexforge.forge.options import BuildOptions
    from hexforge.forge.pipeline import build
    from hexforge.forge.source.tiny import make_tiny_checkpoint
    from hexforge.runtime.genie.pipelinemodel import open_genie

    monkeypatch.setattr(folder, "LUT_CEILING", 1)
    bundle = tmp_path / "b"
    build(make_tiny_checkpoint("gemma4_mm", tmp_path / "ck"), bundle,
          BuildOptions(targets="v81", quant="fp16", context=128, prefill_len=16, genie=True,
                       genie_host_rows=True, audio_seconds=4.0, verify=False, device_only=True),
          log=lambda m: None)
    assert json.loads((bundle / "genie-v81" / "genie_config.json").read_text())[
        "dialog"]["embedding"]["datatype"] == "ufixed8"
    t = np.arange(int(44100 * 1.3)) / 44100
    sf.write(tmp_path / "speech.wav", 0.4 * np.sin(2 * np.pi * (300 + 400 * t) * t), 44100,
             subtype="PCM_16")
    pixels = np.random.default_rng(0).random((45, 83, 3)) * 255
    Image.fromarray(pixels.astype(np.uint8)).save(tmp_path / "photo.png")
    for kind, item in (("audios", "speech.wav"), ("images", "photo.png")):
        media = {kind: [str(tmp_path / item)]}
        want = hexforge.load(bundle, backend="qnn-sim").generate(
            "Describe it.", max_new_tokens=8, ignore_eos=True, **media).token_ids
        model = open_genie(bundle)
        try:
            got = model.generate("Describe it.", max_new_tokens=8, ignore_eos=True,
                                 **media).token_ids
        finally:
            model.close()
        assert got == want, kind


def test_by_default_the_host_keeps_its_precision_and_the_oracle_reads_the_8_bit_lut(
        tmp_path, monkeypatch):
    """Without --genie-host-rows only the Genie folder holds 8-bit rows; the build's Genie oracle
    (forge/genie/verify.py's emulator: the Genie binaries fed the LUT's rows as Genie converts
    them) runs on them and reports."""
    from hexforge.bundle.hostfile import check_safetensors_header
    from hexforge.forge.genie import folder
    from hexforge.forge.options import BuildOptions
    from hexforge.forge.pipeline import build
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    monkeypatch.setattr(folder, "LUT_CEILING", 1)
    ckpt = make_tiny_checkpoint("gemma4", tmp_path / "ckpt", seed=1)
    bundle = tmp_path / "b"
    build(ckpt, bundle, BuildOptions(targets="v81", quant="fp16", context=64, prefill_len=16,
                                     genie=True, device_only=True), log=lambda m: None)
    header = check_safetensors_header(bundle / "host.safetensors")
    assert header["embed_tokens"]["dtype"] in ("F32", "BF16", "F16")
    report = json.loads((bundle / "report.json").read_text())
    assert report["genie-v81"]["passed"], report["genie-v81"]
    assert (bundle / "genie-v81" / "embedding.u8").is_file()
