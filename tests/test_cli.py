"""CLI: one-line errors with exit code 2, inspect/targets/verify, the demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("model_type", ["base", "blocks", "ortops", "gemma4_vision"])
def test_a_module_that_is_not_a_decoder_family_is_refused_like_an_unknown_model_type(
        ckpt, tmp_path, model_type):
    """families/ holds shared modules (base, blocks, ortops) and encoder families beside the
    decoder families: a config naming one used to import it and end in an AttributeError
    traceback. Only the registered decoder families load; the rest get the one-line error."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(ckpt("llama"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    out = tmp_path / "out"
    r = hexforge("build", src, "-o", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and f"model_type {model_type!r} is not supported" in line
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_family_registry_names_every_family_module_and_only_those():
    import pkgutil

    import hexforge.families as families
    from hexforge.bundle.errors import UnsupportedModelError
    from hexforge.families import family_modules, load_encoder, load_family

    decoders, encoders = family_modules("FAMILY"), family_modules("ENCODER")
    assert {"gemma3", "gemma4", "llama", "qwen3", "qwen3_5", "qwen3_vl"} <= set(decoders)
    assert {"gemma4_audio", "gemma4_vision", "qwen3_vl_vision"} <= set(encoders)
    for name in decoders:
        assert load_family(name).FAMILY is not None
    for name in encoders:
        assert load_encoder(name) is not None
    for mod in pkgutil.iter_modules(families.__path__):
        src = (Path(families.__path__[0]) / f"{mod.name}.py").read_text()
        defines = "\nFAMILY = " in src or "\nENCODER = " in src
        assert defines == (mod.name in decoders + encoders), mod.name
    with pytest.raises(UnsupportedModelError, match="not supported yet"):
        load_family("blocks")  # shared code, not a family


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


def test_regression_inspect_wrote_layers_closed_where_the_build_log_writes_them_half_open(
        bundle):
    """``hexforge inspect`` printed a shard's layers as [0, 6] where the build log prints
    [0,6): one formatter (inspect.layer_span) for both now."""
    from hexforge.bundle.describe import layer_span

    r = hexforge("inspect", bundle("llama"))
    assert r.returncode == 0 and "[0,6)" in r.stdout and "[0, 6]" not in r.stdout, r.stdout
    assert layer_span((0, 30)) == "[0,30)"


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
    # what it leaves and where, with the command that removes it; the simulator's libnative
    # line is not among what it prints
    assert f"5. left on disk: {tmp_path} (" in r.stdout and f"rm -rf {tmp_path}" in r.stdout
    assert "LIBNATIVE" not in r.stdout + r.stderr


def test_cli_passes_every_build_option(monkeypatch, tmp_path):
    """Every BuildOptions field is a build flag (forge/options.py makes them from the fields) and
    reaches build_bundle(): each flag given a non-default value comes out non-default. A field
    added without a value here fails this test: the CLI already has its flag (a flag the CLI's
    hand copy forgot was silently dropped, as --image-size was)."""
    import dataclasses

    from hexforge.commands import cli
    from hexforge.forge import pipeline
    from hexforge.forge.options import BuildOptions

    seen = []

    def fake(ckpt, out, opts, log):
        seen.append(opts)
        return pipeline.BuildResult(Path(out), {})

    monkeypatch.setattr(pipeline, "build_bundle", fake)
    (tmp_path / "t.txt").write_text("text")
    argv = ["build", "ckpt", "-o", "out", "--target", "v81", "--context", "512",
            "--prefill-len", "32", "--max-shard-bytes", "1G", "--no-verify", "--quant", "fp16",
            "--calib", str(tmp_path / "t.txt"), "--share-weights", "--cpu-weights", "int4",
            "--int4-per-layer-tables", "--exporter", "dynamo", "--verify-tokens", "8",
            "--eval-text", str(tmp_path / "t.txt"), "--eval-tokens", "99",
            "--audio-seconds", "4", "--image-size", "64x96", "--keep-work", "--verify-len", "4",
            "--genie", "--device-only", "--estimate", "--htp-verify", "--kv-values", "u8",
            "--genie-kv", "lade", "--genie-lade", "2,4,3", "--genie-host-rows"]
    assert cli.main(argv) == 0
    default = BuildOptions()
    unset = [f.name for f in dataclasses.fields(default)
             if getattr(seen[0], f.name) == getattr(default, f.name)]
    assert not unset, f"build flags that never reach BuildOptions: {unset}"
    assert seen[0].image_size == (64, 96) and seen[0].max_shard_bytes == 10**9


def test_build_help_shows_every_default():
    """``hexforge build --help`` states each option's default, read from BuildOptions itself."""
    import dataclasses

    from hexforge.forge.options import BuildOptions

    r = hexforge("build", "--help")
    text = " ".join(r.stdout.split())
    for f in dataclasses.fields(BuildOptions):
        if f.default is not None and not isinstance(f.default, bool):
            assert f"(default: {f.default})" in text, f.name


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

    from hexforge.bundle.errors import UnsupportedModelError
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


def test_configuration_doc_names_every_option_and_environment_variable():
    """docs/configuration.md is the one list of settings: every option of every subcommand and
    every HEXFORGE_* / HF_* variable the package reads."""
    import argparse
    import re

    from hexforge.commands.cli import parser

    root = Path(__file__).parents[1]
    doc = (root / "docs" / "configuration.md").read_text()
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        section = doc.split(f"### `hexforge {name}`", 1)[1].split("\n### ", 1)[0]
        for action in sp._actions:
            for opt in action.option_strings:
                if opt not in ("-h", "--help"):
                    assert f"`{opt}`" in section, (name, opt)
    code = "\n".join(p.read_text() for p in (root / "hexforge").rglob("*.py"))
    for var in set(re.findall(r"environ(?:\.get)?\(?\[?\"((?:HEXFORGE|HF)_[A-Z_]+)", code)):
        assert f"`{var}`" in doc, var


def _hf_cache_with(ckpt_dir: Path, cache: Path, repo_id: str) -> Path:
    """Lay ``ckpt_dir`` out as huggingface_hub's cache holds a downloaded model: blobs named by
    content hash, a snapshot dir of symlinks to them, refs/main naming the snapshot's commit."""
    import hashlib
    import os
    import shutil

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(ckpt_dir.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_build_takes_a_hub_id_from_the_hf_cache_offline(ckpt, tmp_path):
    """``hexforge build ORG/NAME`` resolves the id through huggingface_hub (snapshot_download, the
    HF cache, HF_HUB_OFFLINE honoured): a tiny checkpoint laid out in a cache dir builds with no
    network; an id the cache lacks is the one-line error naming the cache and the way out."""
    import os

    cache = tmp_path / "hub"
    _hf_cache_with(ckpt("llama"), cache, "hexforge-test/tiny-llama")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "b"
    r = subprocess.run([sys.executable, "-m", "hexforge", "build", "hexforge-test/tiny-llama",
                        "-o", out, "--no-verify", "--context", "64", "--prefill-len", "8"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hf_config"] == json.loads((ckpt("llama") / "config.json").read_text())

    r = subprocess.run([sys.executable, "-m", "hexforge", "build", "hexforge-test/not-cached",
                        "-o", tmp_path / "c"], capture_output=True, text=True, env=env,
                       timeout=300)
    line = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in line and "Traceback" not in line
    assert "hexforge-test/not-cached" in line and str(cache) in line and "HF_HUB_OFFLINE" in line
    assert not (tmp_path / "c").exists()


def test_a_hub_snapshot_gives_back_the_pages_of_its_blobs(ckpt, tmp_path):
    """A HF cache snapshot holds symlinks into blobs/: the build's page release (after each stage
    that read the checkpoint) must find the mapped blobs through them."""
    import numpy as np

    from hexforge.forge.heap import release_mapped_pages

    snap = _hf_cache_with(ckpt("llama"), tmp_path / "hub", "hexforge-test/tiny-llama")
    weights = np.memmap(next(snap.glob("*.safetensors")), mode="r")
    assert int(weights[::4096].astype(np.int64).sum()) >= 0  # every page read once: resident
    assert release_mapped_pages(snap) > 0
    del weights


def test_device_only_on_a_cpu_build_is_one_line_exit_2(ckpt, tmp_path):
    r = hexforge("build", ckpt("llama"), "-o", tmp_path / "out", "--device-only")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--device-only needs an HTP --target" in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("blocked, argv, extra", [
    ("fastapi", ["serve", "BUNDLE"], "serve"), ("torch", ["build", "CKPT", "-o", "OUT"], "build")])
def test_a_command_whose_extra_is_not_installed_names_it_in_one_line(bundle, ckpt, tmp_path,
                                                                    blocked, argv, extra):
    """`hexforge serve` after `pip install -e .` was a ModuleNotFoundError traceback (fastapi):
    each command names the pip extra it needs, read from the package's own metadata."""
    import textwrap

    argv = [str(bundle("llama")) if a == "BUNDLE" else str(ckpt("llama")) if a == "CKPT"
            else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] == {blocked!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, Block())
        from hexforge.commands.cli import main
        sys.exit(main({argv!r}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert (f"hexforge {argv[0]} needs the {extra} extra ({blocked} is not installed): "
            f'pip install "hexforge[{extra}]"') in r.stderr
    assert not (tmp_path / "out").exists()


def test_the_demo_prints_a_slow_rate_with_its_digits():
    """The demo's simulator line read "decode 0 tok/s" (0.42 tok/s through ``:.0f``): a rate
    under 10 keeps two significant digits, a larger one stays whole."""
    from hexforge.commands.demo import rate

    assert [rate(v) for v in (0.42, 0.0421, 3.456, 57.4, 1234.5, 0.0)] == [
        "0.42", "0.042", "3.5", "57", "1234", "0"]


def test_help_states_the_whole_description():
    """``hexforge --help`` printed the docstring's first line alone: "hexforge build | run | chat
    | ... | verify |", cut mid-list. The description is the whole first paragraph, naming every
    subcommand."""
    import argparse

    from hexforge.commands.cli import parser

    p = parser()
    text = p.format_help()
    description = " ".join(text.split("\n\n")[1].split())  # after the usage block
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert description.startswith("The one entry point: hexforge ") and description.endswith(".")
    named = description.removeprefix("The one entry point: hexforge ").removesuffix(".")
    assert named.split(" | ") == list(sub.choices), description


def test_chat_banner_names_both_ways_out_and_both_leave(monkeypatch, capsys):
    """The chat banner named /quit, though /exit leaves too: it names both, from the tuple the
    loop checks, and each ends the chat (a stand-in model: no bundle is built)."""
    from types import SimpleNamespace

    import hexforge
    from hexforge.commands import cli

    model = SimpleNamespace(engine=SimpleNamespace(verify_len=8),
                            manifest=SimpleNamespace(encoders=[]),
                            session=lambda system=None: SimpleNamespace())
    monkeypatch.setattr(hexforge, "load", lambda *a, **kw: model)
    assert set(cli.CHAT_QUIT) == {"/quit", "/exit"}
    for word in cli.CHAT_QUIT:
        lines = iter([word, "never read"])
        monkeypatch.setattr("builtins.input", lambda prompt="", lines=lines: next(lines))
        assert cli.main(["chat", "BUNDLE"]) == 0
        assert "/quit or /exit (or Ctrl-D) leaves" in capsys.readouterr().err.splitlines()[0]
        assert next(lines) == "never read"  # it left at the word, reading no more
