"""CLI: one-line errors with exit code 2, inspect/targets/verify, the demo."""

from __future__ import annotations

import json
import subprocess
import sys

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
