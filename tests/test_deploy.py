"""``hexforge deploy``: plumbing tests. No phone is involved: ``adb`` is a stand-in on PATH
(tests/adb_standin.py) that records its calls and plays a phone whose storage is a folder, and
the QAIRT SDK is a stand-in folder with QAIRT's layout (its Android libraries are placeholders).
The bundle is real (the tiny llama's v81 Genie bundle); one test runs the prompt "on the phone"
with a genie-t2t-run stand-in that is the wheel's libGenie on the x86 HTP simulator, started in
the pushed folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hexforge.commands.cli import main
from hexforge.commands.deploy import qairt_files


@pytest.fixture(scope="module")
def genie_bundle(htp_bundle):
    return htp_bundle("llama", "fp16", genie=True)


@pytest.fixture
def bundle_copy(genie_bundle, tmp_path):
    """The Genie bundle under the name ``b`` (the phone's folder is named after it)."""
    dst = tmp_path / "b"
    shutil.copytree(genie_bundle, dst)
    return dst


def deploy(bundle: Path, qairt: Path, *extra: str) -> int:
    return main(["deploy", str(bundle), "--qairt", str(qairt), *extra])


def test_deploy_pushes_the_genie_folder_and_qairt_then_a_second_deploy_pushes_nothing(
        bundle_copy, qairt, phone, capsys):
    assert deploy(bundle_copy, qairt) == 0
    folder = phone.folder()
    genie = sorted(p.name for p in (bundle_copy / "genie-v81").iterdir())
    want = sorted(genie + [Path(r).name for r in qairt_files(81)])
    assert sorted(p.name for p in folder.iterdir()) == want
    for name in genie:
        assert (folder / name).read_bytes() == (bundle_copy / "genie-v81" / name).read_bytes()
    assert sorted(phone.pushed()) == want
    calls = phone.calls()
    first_push = next(i for i, c in enumerate(calls) if "push" in c)
    asked = [c[-1] for c in calls[:first_push]]
    assert "getprop ro.soc.model" in asked  # the phone's SoC, before anything was pushed
    assert any("sha256sum" in c[-1] for c in calls[first_push:])  # digests read after the push
    assert "adb -s STANDIN1 shell" in capsys.readouterr().err  # how to run it, printed
    phone.clear()
    assert deploy(bundle_copy, qairt) == 0
    assert phone.pushed() == []  # every file already matches its digest on the phone


def test_an_interrupted_push_is_resumed_by_the_next_deploy(bundle_copy, qairt, phone, capsys):
    phone.set(cut={"libQnnHtp.so": 1})
    assert deploy(bundle_copy, qairt) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "adb push of libQnnHtp.so stopped" in err and "run deploy again" in err
    before = set(phone.pushed())
    phone.clear()
    assert deploy(bundle_copy, qairt) == 0
    again = phone.pushed()
    assert "libQnnHtp.so" in again  # the half-written one, found by its digest
    assert not (set(again) & (before - {"libQnnHtp.so"}))  # what had arrived is not pushed again
    assert (phone.folder() / "libQnnHtp.so").read_bytes() == \
        (qairt / "lib/aarch64-android/libQnnHtp.so").read_bytes()


def test_a_partial_push_is_found_by_its_digest_and_repaired_by_a_second_deploy(
        bundle_copy, qairt, phone, capsys):
    """The stand-in drops the binary's second half while saying it pushed it, on both pushes
    of the first deploy: its digests after the push find it, it is pushed once more, then named.
    The second deploy pushes it alone."""
    name = "token_ar1_cl128_1_of_1.bin"
    phone.set(drop={name: 2})
    assert deploy(bundle_copy, qairt) == 2
    err = capsys.readouterr().err
    assert "pushing them again" in err
    assert err.strip().splitlines()[-1].endswith(f"still differ on the phone (sha256sum there): "
                                                 f"{name}; check the phone's free space")
    assert phone.pushed().count(name) == 2
    phone.clear()
    assert deploy(bundle_copy, qairt) == 0
    assert phone.pushed() == [name]
    assert (phone.folder() / name).read_bytes() == (bundle_copy / "genie-v81" / name).read_bytes()


def test_a_silent_drop_is_pushed_again_within_one_deploy(bundle_copy, qairt, phone):
    name = "prompt_ar16_cl128_1_of_1.bin"
    phone.set(drop={name: 1})
    assert deploy(bundle_copy, qairt) == 0
    assert phone.pushed().count(name) == 2


@pytest.mark.parametrize("case,words", [
    ("missing_skel", "lacks what a v81 phone needs: lib/hexagon-v81/unsigned/libQnnHtpV81Skel.so"),
    ("old_qairt", "QAIRT 2.40.0.250101 at .* is older than QNN 2.51.0, which compiled "
                  "genie-v81/'s binaries"),
    ("no_version", "cannot tell which QAIRT"),
    ("phone_v79", r"the phone is Hexagon v79 but the bundle's Genie folders are genie-v81"),
    ("phone_unknown", "the phone's SoC SM1234 is not in hexforge's target table"),
    ("arch_flag", r"the phone is SM8750 \(Hexagon v79\), not the v81 --arch says"),
    ("no_phone", "no phone: adb devices lists none ready"),
    ("two_phones", r"several phones \(A, B\): pick one with --serial"),
    ("damaged_bundle", "bundle file genie-v81/tokenizer.json is truncated or corrupted"),
])
def test_deploy_refuses_in_one_line_before_anything_is_pushed(bundle_copy, qairt, phone, capsys,
                                                              case, words):
    import re

    extra: list[str] = []
    if case == "missing_skel":
        (qairt / "lib/hexagon-v81/unsigned/libQnnHtpV81Skel.so").unlink()
    elif case == "old_qairt":
        (qairt / "sdk.yaml").write_text("version: 2.40.0.250101\n")
    elif case == "no_version":
        (qairt / "sdk.yaml").unlink()
    elif case == "phone_v79":
        phone.set(soc="SM8750")
    elif case == "phone_unknown":
        phone.set(soc="SM1234")
    elif case == "arch_flag":
        phone.set(soc="SM8750")
        extra = ["--arch", "v81"]
    elif case == "no_phone":
        phone.set(devices={})
    elif case == "two_phones":
        phone.set(devices={"A": "device", "B": "device"})
    elif case == "damaged_bundle":
        t = bundle_copy / "genie-v81" / "tokenizer.json"
        t.write_bytes(t.read_bytes()[:100])
    assert deploy(bundle_copy, qairt, "--prompt", "Hi", *extra) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("hexforge: error: ") and "Traceback" not in "".join(lines)
    assert re.search(words, lines[-1]), lines[-1]
    assert phone.pushed() == [] and not (phone.root / "phone").exists()
    local = ("missing_skel", "old_qairt", "no_version", "damaged_bundle")
    if case in local:
        assert phone.calls() == []  # judged without asking the phone anything


def test_dry_run_prints_every_command_and_runs_none(bundle_copy, qairt, phone, capsys):
    assert deploy(bundle_copy, qairt, "--dry-run", "--prompt", "Hi", "--serial", "X") == 0
    out = capsys.readouterr().out.splitlines()
    assert phone.calls() == []
    pushes = [line for line in out if line.startswith("adb -s X push ")]
    assert len(pushes) == len(list((bundle_copy / "genie-v81").iterdir())) + len(
        qairt_files(81)) + 1  # + prompt.txt
    assert out[0] == "adb -s X devices" and "getprop ro.soc.model" in out[1]
    assert any("sha256sum" in line for line in out)
    assert "./genie-t2t-run -c genie_config.json -p \"$(cat prompt.txt)\"" in out[-1]


def test_deploy_runs_the_prompt_on_the_phone_and_streams_the_answer(bundle_copy, qairt, phone,
                                                                    capfd):
    """The prompt goes as a file (no shell quoting of the user's text); the stand-in
    genie-t2t-run is libGenie on the simulator, started in the pushed folder."""
    prompt = "It's \"quoted\" $(not run) `nor this`"
    assert deploy(bundle_copy, qairt, "--prompt", prompt) == 0
    out = capfd.readouterr().out
    assert f"[PROMPT]: {prompt}" in out  # the text arrived as typed
    answer = out.split("[BEGIN]: ", 1)[1].split("[END]", 1)[0]
    assert answer.strip()  # Genie generated from the pushed files
    assert (phone.folder() / "prompt.txt").read_text() == prompt


def test_the_phone_picks_the_genie_folder_of_its_arch(bundle_copy, qairt, phone, capsys):
    """A bundle with Genie folders for two arches: the phone's SoC says which one goes (the
    other, here a stand-in the build did not write, is not read); --dry-run cannot ask it."""
    other = bundle_copy / "genie-v79"
    shutil.copytree(bundle_copy / "genie-v81", other)
    (other / "token_ar1_cl128_1_of_1.bin").unlink()  # would fail every check, were it judged
    assert deploy(bundle_copy, qairt, "--dry-run") == 2
    assert "several arches (genie-v79, genie-v81)" in capsys.readouterr().err
    assert phone.calls() == []
    assert deploy(bundle_copy, qairt) == 0
    assert "token_ar1_cl128_1_of_1.bin" in phone.pushed()
    assert (phone.folder() / "token_ar1_cl128_1_of_1.bin").read_bytes() == \
        (bundle_copy / "genie-v81" / "token_ar1_cl128_1_of_1.bin").read_bytes()


def test_chat_wraps_the_prompt_in_the_template_less_the_bos_genie_prepends(bundle_copy, qairt,
                                                                            phone, capsys):
    assert deploy(bundle_copy, qairt, "--dry-run", "--prompt", "Hi", "--chat") == 0
    held = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("# prompt.txt"))
    # the tiny template renders "<s>user\nHi</s>\n<s>assistant\n"; Genie's bos-token 1 is <s>
    assert held.endswith(repr("user\nHi</s>\n<s>assistant\n"))


def test_an_image_needs_a_bundle_with_a_genie_pipeline(bundle_copy, qairt, phone, capsys,
                                                       tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    assert deploy(bundle_copy, qairt, "--prompt", "Hi", "--image", str(tmp_path / "x.png")) == 2
    err = capsys.readouterr().err
    assert "genie-v81/ has no Genie pipeline" in err and err.count("\n") == 1
    assert phone.pushed() == []
    assert deploy(bundle_copy, qairt, "--image", str(tmp_path / "x.png")) == 2
    assert "--image needs --prompt" in capsys.readouterr().err


# ---- --runtime geniex (hexforge/commands/deploy_geniex.py): GenieX's CLI in place of genie-t2t-run ----

GENIEX_STANDIN = """#!/bin/sh
# the geniex stand-in: says what it was asked and where the SDK would look for its plugin
echo "geniex-standin: $*"
echo "plugin: $(ls "$GENIEX_PLUGIN_PATH"/qairt/libgeniex_plugin.so)"
"""


@pytest.fixture
def geniex(tmp_path):
    """GenieX's Android files as --geniex takes them (the CLI package's layout: the SDK's lib/
    contents beside ``geniex``), the libraries placeholders, ``geniex`` a shell stand-in."""
    from hexforge.commands.deploy_geniex import geniex_files

    root = tmp_path / "geniex"
    extra = ["qairt/libgeniex_vlm.so", "qairt/htp-files/libQnnHtpPrepare.so"]
    for rel in geniex_files(81) + extra:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"placeholder for GenieX's {p.name}\n".encode() * 64)
    (root / "geniex").write_text(GENIEX_STANDIN)
    return root


def deploy_gx(bundle: Path, geniex_dir: Path, *extra: str) -> int:
    return main(["deploy", str(bundle), "--runtime", "geniex", "--geniex", str(geniex_dir),
                 *extra])


def test_geniex_dry_run_pushes_metadata_and_geniex_and_runs_geniex_infer(bundle_copy, geniex,
                                                                         phone, capsys):
    import shlex

    from hexforge.commands.deploy_geniex import GENIEX_DEVICE_DIR

    assert deploy_gx(bundle_copy, geniex, "--dry-run", "--prompt", "It's \"Hi\" $(x)",
                     "--serial", "X", "-n", "7") == 0
    out = capsys.readouterr().out.splitlines()
    assert phone.calls() == []
    where = "/data/local/tmp/hexforge/b"
    pushes = [shlex.split(line)[4:] for line in out if line.startswith("adb -s X push ")]
    assert [str(bundle_copy / "genie-v81" / "metadata.json"), f"{where}/metadata.json"] in pushes
    assert [str(geniex / "geniex"), f"{GENIEX_DEVICE_DIR}/geniex"] in pushes
    assert [str(geniex / "qairt/libgeniex_plugin.so"),
            f"{GENIEX_DEVICE_DIR}/qairt/libgeniex_plugin.so"] in pushes
    assert [str(geniex / "qairt/htp-files/libQnnHtp.so"),
            f"{GENIEX_DEVICE_DIR}/libQnnHtp.so"] in pushes  # flat: the plugin opens it there
    assert len(pushes) == len(list((bundle_copy / "genie-v81").iterdir())) + 11
    assert not any(p[0].endswith("genie-t2t-run") for p in pushes)  # no QAIRT file
    pull, infer = (shlex.split(shlex.split(line)[-1]) for line in out[-2:])
    assert pull[pull.index("./geniex"):][:5] == ["./geniex", "pull", "hexforge/b",
                                                 "--local-path", where]
    run = infer[infer.index("./geniex"):]
    assert run[:3] == ["./geniex", "infer", "hexforge/b"]
    assert run[-4:] == ["--max-tokens", "7", "-p", "It's \"Hi\" $(x)"]  # the plain prompt
    assert f"GENIEX_PLUGIN_PATH={GENIEX_DEVICE_DIR}" in infer


def test_geniex_pushes_to_the_phone_and_a_second_deploy_pushes_nothing(bundle_copy, geniex,
                                                                       phone, capfd):
    from hexforge.commands.deploy_geniex import GENIEX_DEVICE_DIR

    assert deploy_gx(bundle_copy, geniex, "--prompt", "Hi") == 0
    out = capfd.readouterr().out
    assert "geniex-standin: pull hexforge/b --local-path /data/local/tmp/hexforge/b" in \
        out.replace(str(phone.root / "phone"), "")
    assert "geniex-standin: infer hexforge/b" in out and "-p Hi" in out
    assert "/qairt/libgeniex_plugin.so" in out.split("plugin: ", 1)[1]
    gx = phone.root / "phone" / GENIEX_DEVICE_DIR.lstrip("/")
    assert (gx / "qairt" / "libgeniex_plugin.so").read_bytes() == \
        (geniex / "qairt" / "libgeniex_plugin.so").read_bytes()
    assert (gx / "libQnnHtpV81Skel.so").is_file() and (gx / "libgeniex.so").is_file()
    assert (phone.folder() / "metadata.json").read_bytes() == \
        (bundle_copy / "genie-v81" / "metadata.json").read_bytes()
    phone.clear()
    assert deploy_gx(bundle_copy, geniex) == 0
    assert phone.pushed() == []


@pytest.mark.parametrize("card", [False, True])
def test_geniex_refuses_a_folder_without_metadata_json_in_one_line(bundle_copy, geniex, phone,
                                                                   capsys, card):
    (bundle_copy / "genie-v81" / "metadata.json").unlink()
    why = "the plugin's dispatcher has no model_id prefix for gemma3"
    if card:  # the card's reason, as modelcard.py writes it for a family GenieX cannot take
        readme = bundle_copy / "README.md"
        readme.write_text(readme.read_text() + f"\n`genie-v81/`: GenieX: not loadable ({why}).\n")
    assert deploy_gx(bundle_copy, geniex, "--prompt", "Hi") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "hexforge: error: genie-v81/ has no metadata.json: the model is not loadable by GenieX (")
    assert (why in lines[0]) == card and ("qwen3" in lines[0]) != card
    assert phone.calls() == []


@pytest.mark.parametrize("gone", ["qairt/libgeniex_plugin.so", "geniex",
                                  "qairt/htp-files/libQnnHtpV81Skel.so"])
def test_geniex_refuses_a_geniex_folder_missing_a_file_in_one_line(bundle_copy, geniex, phone,
                                                                   capsys, gone):
    (geniex / gone).unlink()
    assert deploy_gx(bundle_copy, geniex, "--prompt", "Hi") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"hexforge: error: GenieX {geniex} lacks what a v81 phone needs: "
                                f"{gone}"), lines[-1]
    assert "Traceback" not in "".join(lines) and phone.calls() == []


@pytest.mark.parametrize("args,words", [
    (["--runtime", "geniex"], "--runtime geniex needs --geniex DIR"),
    (["--runtime", "geniex", "--geniex", "G", "--chat", "--prompt", "Hi"],
     "GenieX applies tokenizer_config.json's chat template itself"),
    (["--runtime", "geniex", "--geniex", "G", "--qairt", "Q"], "--qairt with --runtime geniex"),
    (["--geniex", "G"], "--geniex needs --runtime geniex"),
    ([], "--qairt QAIRT_HOME is needed"),
])
def test_deploy_options_that_do_not_go_together_are_refused_in_one_line(tmp_path, capsys, args,
                                                                        words):
    assert main(["deploy", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
