"""Bundles that travel: every file's size and SHA-256 in the manifest (hexforge/bundle/bundlefiles.py),
checked at load, by ``hexforge verify --files``; the model card the build writes; a Genie folder
judged before libGenie is given it (hexforge/runtime/genie/checks.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

import hexforge
from hexforge.bundle.errors import BundleError, ContextOverflowError
from hexforge.bundle.manifest import load_manifest
from hexforge.commands.cli import main
from tests.conftest import HTP_CONTEXT, prompt_ids


@pytest.fixture
def copy_of(tmp_path):
    def make(src: Path, name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst, symlinks=True)
        return dst

    return make


@pytest.fixture(scope="module")
def genie_bundle(htp_bundle):
    return htp_bundle("llama", "fp16", genie=True)


@pytest.fixture
def hashed(monkeypatch):
    """The bundle-relative files hashed since the fixture was made (load-time digests)."""
    from hexforge.bundle import bundlefiles

    seen: list[str] = []
    real = bundlefiles.sha256_of

    def spy(path: Path) -> str:
        seen.append(path.name)
        return real(path)

    monkeypatch.setattr(bundlefiles, "sha256_of", spy)
    return seen


def _flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_build_records_every_file_with_its_size_and_sha256(genie_bundle):
    m = load_manifest(genie_bundle)
    on_disk = sorted(p.relative_to(genie_bundle).as_posix() for p in genie_bundle.rglob("*")
                     if p.is_file() and p.name != "manifest.json")
    assert m.schema_version == 3
    assert [r.path for r in m.file_records] == on_disk
    assert {"README.md", "report.json", "genie-v81/genie_config.json",
            "v81/s0.decode.ctx_qnn.bin"} <= set(on_disk)
    for r in m.file_records:
        data = (genie_bundle / r.path).read_bytes()
        assert (r.bytes, r.sha256) == (len(data), hashlib.sha256(data).hexdigest())


def test_verify_files_names_a_weight_file_with_one_byte_changed(bundle, copy_of, capsys):
    b = copy_of(bundle("llama"))
    assert main(["verify", str(b), "--files"]) == 0
    assert "all" in capsys.readouterr().out
    _flip_byte(b / "cpu" / "s0.weights")
    assert main(["verify", str(b), "--files"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cpu/s0.weights: different (SHA-256 ")
    assert f"1 of {len(load_manifest(b).file_records)} files differ from the manifest" in lines[-1]


def test_verify_files_names_each_missing_short_different_and_unlisted_file(bundle, copy_of,
                                                                          capsys):
    b = copy_of(bundle("llama"))
    (b / "tokenizer" / "tokenizer.json").unlink()
    head = b / "cpu" / "head.onnx"
    head.write_bytes(head.read_bytes()[:100])
    _flip_byte(b / "host.safetensors", at=-1)
    (b / "tokenizer" / "chat_template.jinja.bak").write_text("{{ 'x' }}")
    assert main(["verify", str(b), "--files", "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert not r["intact"]
    assert [(p["path"], p["kind"]) for p in r["problems"]] == [
        ("cpu/head.onnx", "short"), ("host.safetensors", "different"),
        ("tokenizer/chat_template.jinja.bak", "unlisted"), ("tokenizer/tokenizer.json", "missing")]


def test_a_short_context_binary_is_refused_at_load_before_any_graph_runs(genie_bundle, copy_of,
                                                                        monkeypatch):
    import onnxruntime as ort

    b = copy_of(genie_bundle)
    binary = b / "v81" / "s0.decode.ctx_qnn.bin"
    binary.write_bytes(binary.read_bytes()[:4096])
    made = []
    real = ort.InferenceSession
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: made.append(a) or real(*a, **k))
    with pytest.raises(BundleError, match=r"bundle file v81/s0\.decode\.ctx_qnn\.bin is "
                                          r"truncated or corrupted \(4,096 of [\d,]+ bytes\)") as e:
        hexforge.load(b, backend="qnn-sim")
    assert "\n" not in str(e.value) and "verify" in str(e.value) and made == []
    # a damaged v81 binary does not stop the cpu target, which does not read it
    assert hexforge.load(b).generate("Hi", max_new_tokens=2).token_ids


def test_digests_are_checked_once_per_machine_then_for_changed_files_only(bundle, copy_of,
                                                                         hashed):
    b = copy_of(bundle("llama"))
    listed = [r.path for r in load_manifest(b).file_records]
    hexforge.load(b)  # new to this machine (this run's HEXFORGE_CACHE): every file it reads
    assert sorted(hashed) == sorted(Path(p).name for p in listed)
    hashed.clear()
    hexforge.load(b)
    assert hashed == []  # the marker vouches for every file as it is
    w = b / "cpu" / "s0.weights"
    w.write_bytes(w.read_bytes())  # same bytes, written again: hashed again, alone
    hexforge.load(b)
    assert hashed == ["s0.weights"]
    hashed.clear()
    hexforge.load(b, check_digests=True)
    assert len(hashed) == len(listed)
    hashed.clear()
    hexforge.load(b, check_digests=False)
    assert hashed == []


def test_a_changed_file_is_caught_on_a_machine_that_had_verified_the_bundle(bundle, copy_of):
    b = copy_of(bundle("llama"))
    hexforge.load(b)  # verified: the marker holds each file's stat
    _flip_byte(b / "cpu" / "s0.weights")  # same size, new ctime: the marker no longer vouches
    with pytest.raises(BundleError, match=r"cpu/s0\.weights is corrupted \(SHA-256 "):
        hexforge.load(b)


def test_a_copied_bundle_is_new_to_the_machine(bundle, copy_of, hashed):
    a = copy_of(bundle("llama"), "a")
    hexforge.load(a)
    hashed.clear()
    b = copy_of(a, "b")  # a copy elsewhere: another path and other inodes
    hexforge.load(b)
    assert hashed


def test_no_writable_marker_folder_means_digests_every_load(bundle, copy_of, hashed, tmp_path,
                                                            monkeypatch):
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("HEXFORGE_CACHE", str(tmp_path / "not-a-folder"))
    b = copy_of(bundle("llama"))
    hexforge.load(b)
    first = len(hashed)
    hexforge.load(b)
    assert first and len(hashed) == 2 * first


def test_a_schema_1_bundle_without_a_file_list_still_loads(bundle, copy_of, capsys):
    b = copy_of(bundle("llama"))
    m = json.loads((b / "manifest.json").read_text())
    del m["file_records"]
    m["schema_version"] = 1
    (b / "manifest.json").write_text(json.dumps(m))
    assert hexforge.load(b).generate("Hi", max_new_tokens=2).token_ids
    assert main(["verify", str(b), "--files"]) == 2
    assert "records no file list" in capsys.readouterr().err


def test_a_newer_schema_asks_for_a_newer_hexforge(bundle, copy_of):
    b = copy_of(bundle("llama"))
    m = json.loads((b / "manifest.json").read_text())
    m["schema_version"] = 4
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=r"schema_version 4 is not supported \(this hexforge "
                                          r"reads 1, 2, 3\); upgrade hexforge"):
        hexforge.load(b)


# ---- the model card ------------------------------------------------------------------------------
def test_every_bundle_carries_a_model_card_written_by_the_build(genie_bundle):
    card = (genie_bundle / "README.md").read_text()
    m = load_manifest(genie_bundle)
    report = json.loads((genie_bundle / "report.json").read_text())
    assert card.startswith("---\nlibrary_name: hexforge\n")
    assert "\n# b\n" in card  # named as the bundle folder is
    quality = card.split("## Quality", 1)[1].split("\n## ", 1)[0]
    for name, r in report.items():  # the oracle's table: one row per judged target
        row = next(line for line in quality.splitlines() if line.startswith(f"| {name} | "))
        assert ("PASS" if r["passed"] else "FAIL") in row
        assert f"{r['text']['kl_mean']:.3g} / {r['text']['kl_p99']:.3g}" in row
        assert f"{r['greedy']['matching_prefix']}/{r['greedy']['new_tokens']}" in row
    sdk = m.targets["v81"].qnn_sdk
    assert f"v81, soc_model 87 (SM8850) | {sdk} or newer" in card  # the arch pinning
    assert f"QAIRT {sdk} or newer" in card
    for command in ('hexforge run b "What is the capital of France?" --chat   # cpu',
                    "--backend qnn --arch v81", "--backend qnn-sim --arch v81",
                    "--backend genie --arch v81", "hexforge deploy b --qairt $QAIRT_HOME",
                    "hexforge verify b --files"):
        assert command in card
    for folder in ("`cpu/`", "`v81/`", "`genie-v81/`", "`tokenizer/`", "`host.safetensors`"):
        assert f"| {folder} |" in card


# ---- the Genie path: bad input named before libGenie -----------------------------------------------
@pytest.fixture
def no_libgenie(monkeypatch):
    """Fails the test if a Genie dialog is made: the check must come first."""
    from hexforge.runtime.genie import libgenie as genie

    def refuse(*a, **k):
        raise AssertionError("libGenie was given the bad input")

    monkeypatch.setattr(genie, "Dialog", refuse)


def _edit_config(folder: Path, edit) -> None:
    path = folder / "genie_config.json"
    cfg = json.loads(path.read_text())
    edit(cfg["dialog"])
    path.write_text(json.dumps(cfg))


def _genie(folder: Path):
    from hexforge.runtime.genie.model import GenieModel

    return GenieModel(folder)


def test_genie_a_missing_context_binary_is_named(genie_bundle, copy_of, no_libgenie):
    b = copy_of(genie_bundle)
    (b / "genie-v81" / "token_ar1_cl128_1_of_1.bin").unlink()
    with pytest.raises(BundleError, match=r"bundle file genie-v81/token_ar1_cl128_1_of_1\.bin is "
                                          "missing"):
        _genie(b)
    alone = copy_of(b / "genie-v81", "genie-v81")  # a Genie folder outside any bundle
    with pytest.raises(BundleError, match=r"ctx-bins\[1\] names 'token_ar1_cl128_1_of_1\.bin', "
                                          r"which is missing from genie-v81/"):
        _genie(alone)


@pytest.mark.parametrize("path", ["/etc/passwd", "../report.json", "../../../etc/hosts",
                                  "link.bin"])
def test_genie_a_config_naming_a_file_outside_the_folder_is_refused(genie_bundle, copy_of,
                                                                   tmp_path, no_libgenie, path):
    folder = copy_of(genie_bundle / "genie-v81", "genie-v81")
    if path == "link.bin":
        (tmp_path / "outside.bin").write_bytes(b"x")
        (folder / "link.bin").symlink_to(tmp_path / "outside.bin")
    _edit_config(folder, lambda d: d["engine"]["model"]["binary"]["ctx-bins"].__setitem__(0, path))
    with pytest.raises(BundleError, match=r"ctx-bins\[0\] names .*outside the Genie folder"):
        _genie(folder)


def test_genie_a_tokenizer_that_does_not_match_the_vocab_is_refused(genie_bundle, copy_of,
                                                                   no_libgenie):
    from tokenizers import Tokenizer, models

    bigger = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    b = copy_of(genie_bundle)
    bigger.save(str(b / "genie-v81" / "tokenizer.json"))
    with pytest.raises(BundleError, match=r"genie-v81/tokenizer\.json is"):  # not the build's
        _genie(b)
    alone = copy_of(b / "genie-v81", "genie-v81")
    with pytest.raises(BundleError, match=r"tokenizer\.json in genie-v81/ holds 1,000 tokens but "
                                          r"genie_config\.json's n-vocab is 384"):
        _genie(alone)
    _edit_config(b / "genie-v81", lambda d: d["context"].__setitem__("n-vocab", 1000))
    m = json.loads((b / "manifest.json").read_text())  # the folder's own files are intact again
    del m["file_records"]
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="n-vocab 1,000 is not the bundle's vocabulary of 384"):
        _genie(b)


def test_genie_a_prompt_longer_than_the_context_is_refused_before_libgenie(genie_bundle,
                                                                          no_libgenie):
    model = _genie(genie_bundle)
    for n in (None, 8):
        with pytest.raises(ContextOverflowError, match=rf"prompt has {HTP_CONTEXT + 4} tokens"):
            model.generate(prompt_ids(HTP_CONTEXT + 4), max_new_tokens=n)
    with pytest.raises(ContextOverflowError, match=r"\+ max_new_tokens 20 = 130 > the bundle's "
                                                   "context of 128"):
        model.generate(prompt_ids(110), max_new_tokens=20)


def test_genie_cli_names_bad_input_in_one_line(genie_bundle, copy_of, capsys):
    b = copy_of(genie_bundle)
    (b / "genie-v81" / "prompt_ar16_cl128_1_of_1.bin").write_bytes(b"")
    assert main(["run", str(b), "Hi", "--backend", "genie"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "genie-v81/prompt_ar16_cl128_1_of_1.bin is truncated" in err[0]
