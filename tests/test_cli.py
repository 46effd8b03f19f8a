"""CLI: one-line errors with exit code 2, inspect/targets/verify, the demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import CONTEXT


def hexforge(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "hexforge", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def test_prompt_longer_than_context_names_both_numbers(bundle):
    long_prompt = "The capital of France is Paris. " * 60
    r = hexforge("run", bundle("llama"), long_prompt, "-n", "8")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and f"context of {CONTEXT}" in line and "max_new_tokens 8" in line


def test_bad_bundle_is_one_line_exit_2(tmp_path):
    r = hexforge("run", tmp_path, "hi")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no manifest.json" in r.stderr


def test_pickle_checkpoint_via_cli(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    r = hexforge("build", tmp_path, "-o", tmp_path / "out")
    assert r.returncode == 2 and "pickle" in r.stderr and "Traceback" not in r.stderr


def test_unknown_model_type_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nonesuch"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    r = hexforge("build", tmp_path, "-o", tmp_path / "out")
    assert r.returncode == 2 and "'nonesuch' is not supported" in r.stderr


def test_inspect_and_targets(bundle):
    r = hexforge("inspect", bundle("llama"), "--json")
    info = json.loads(r.stdout)
    assert info["targets"]["cpu"]["graphs"][0]["role"] == "prefill"
    assert info["report"]["cpu"]["passed"]
    per_token = info["targets"]["cpu"]["decode_weight_bytes_per_token"]
    r = hexforge("inspect", bundle("llama"))
    assert r.returncode == 0
    assert f"decode reads {per_token:,} weight B/token" in r.stdout  # a cpu target says it too
    t = hexforge("targets")
    assert "v81" in t.stdout and "87" in t.stdout


def test_verify_reruns_the_oracle(bundle, ckpt):
    r = hexforge("verify", bundle("qwen3"), "--reference", ckpt("qwen3"), "-n", "16", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)["cpu"]
    assert rep["passed"] and rep["greedy"]["matching_prefix"] == 16


def test_tiny_demo_builds_and_runs_on_cpu_and_the_simulator(tmp_path):
    r = hexforge("demo", "--tiny", "--dir", tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "oracle" in r.stdout and "tok/s" in r.stdout and "random-weight" in r.stdout
    assert "[v81 HTP, x86 simulator]" in r.stdout


def test_cli_passes_every_build_option(monkeypatch, tmp_path):
    """Every BuildOptions field a flag sets reaches build(): each flag given a non-default value
    comes out non-default (a flag cmd_build forgot was silently dropped, as --image-size was)."""
    import dataclasses

    from hexforge import cli
    from hexforge.build import pipeline

    seen = []
    monkeypatch.setattr(pipeline, "build", lambda ckpt, out, opts, log: seen.append(opts))
    (tmp_path / "t.txt").write_text("text")
    argv = ["build", "ckpt", "-o", "out", "--target", "v81", "--context", "512",
            "--prefill-len", "32", "--max-shard-bytes", "1G", "--no-verify", "--quant", "fp16",
            "--calib", str(tmp_path / "t.txt"), "--share-weights", "--cpu-weights", "int4",
            "--int4-per-layer-tables", "--exporter", "dynamo", "--verify-tokens", "8",
            "--eval-text", str(tmp_path / "t.txt"), "--eval-tokens", "99",
            "--audio-seconds", "4", "--image-size", "64x96", "--keep-work", "--verify-len", "4",
            "--genie"]
    assert cli.main(argv) == 0
    default = pipeline.BuildOptions()
    unset = [f.name for f in dataclasses.fields(default) if f.name not in ("force", "timings")
             and getattr(seen[0], f.name) == getattr(default, f.name)]
    assert not unset, f"build flags that never reach BuildOptions: {unset}"
    assert seen[0].image_size == (64, 96)


def test_regression_gemma4_bidirectional_image_attention_was_built_causal(ckpt, tmp_path):
    """A Gemma-4 config asking for bidirectional attention over image tokens is refused at build
    time in one line naming the field, before any work (it used to build, pass the text-only
    oracle and diverge from HF on image prompts at token 3); no bundle, no partial directory."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(ckpt("gemma4_mm"), src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    r = hexforge("build", src, "-o", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1
    assert 'text_config.use_bidirectional_attention="vision" is not supported' in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_families_accept_hfs_defaults_for_the_fields_they_check():
    """A config that leaves an ACCEPTED field out gets HF's default: it must be accepted, and a
    config that spells the default out must build the same."""
    from transformers import Gemma3TextConfig, Gemma4TextConfig

    from hexforge.errors import UnsupportedModelError
    from hexforge.families import load_family

    for model_type, defaults in (("gemma4_text", Gemma4TextConfig()),
                                 ("gemma3_text", Gemma3TextConfig())):
        fam = load_family(model_type).FAMILY
        assert fam.ACCEPTED
        for name in fam.ACCEPTED:
            fam.check_config({"model_type": model_type, name: getattr(defaults, name)})
        fam.check_config({"model_type": model_type})
    gemma3 = load_family("gemma3_text").FAMILY
    with pytest.raises(UnsupportedModelError, match=r"use_bidirectional_attention=true is not"):
        gemma3.check_config({"model_type": "gemma3_text", "use_bidirectional_attention": True})
    with pytest.raises(UnsupportedModelError, match=r"text_config\.enable_moe_block=true"):
        load_family("gemma4").FAMILY.check_config(
            {"model_type": "gemma4", "text_config": {"enable_moe_block": True}})


def test_encoder_flags_on_a_checkpoint_without_that_encoder_are_refused(ckpt, tmp_path):
    """--image-size / --audio-seconds on a text-only checkpoint: one line, exit 2, nothing written
    (not a bundle that silently ignored the flag)."""
    for flag, value, modality in (("--image-size", "64x96", "image"), ("--audio-seconds", "4", "audio")):
        r = hexforge("build", ckpt("llama"), "-o", tmp_path / "out", flag, value)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"{flag} was given but this checkpoint has no {modality} encoder" in r.stderr
    assert not any(tmp_path.iterdir())
