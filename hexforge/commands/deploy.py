"""``hexforge deploy BUNDLE --qairt QAIRT_HOME``: a bundle's Genie folder and the QAIRT files it
needs, pushed to an Android phone with adb, the prompt run there by QAIRT's ``genie-t2t-run``.

    local  the Genie folder as libGenie would judge it (runtime/genie/checks.py: paths, binaries,
           tokenizer; sizes / digests against the manifest's file list)
           QAIRT_HOME holds every file the arch needs, and is not older than the QNN that compiled
           the binaries (their header says which)
    phone  adb sees one phone (or --serial's); its SoC (getprop ro.soc.model) is an arch the
           bundle has a Genie folder for (targets.py's table)            ── all before any push
    push   sha256sum on the phone: only files missing or different there are pushed, one adb push
           each (an interrupted deploy, run again, resumes where it stopped); sha256sum again
           after the push: a file still different is pushed once more, then named
    run    cd DIR; LD_LIBRARY_PATH=DIR ADSP_LIBRARY_PATH=DIR ./genie-t2t-run -c genie_config.json
           -p "$(cat prompt.txt)"  — its output streamed here
           with --image: the bundle's Genie pipeline, by QAIRT's genie-app and a script of the
           request (hexforge/commands/genie_app.py): ./genie-app -s request.script

``--dry-run`` prints every adb command instead of running it (the phone is not asked anything:
every file is shown pushed). docs/deploy.md has the file list and its sources.
``--runtime geniex`` (deploy_geniex.py) pushes the same folder the same way, with GenieX's files
in place of QAIRT's, and runs ``geniex infer``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, TypeVar

from ..bundle.bundlefiles import sha256_of
from ..bundle.errors import BackendError, BundleError, RequestError
from ..bundle.manifest import MANIFEST_NAME
from ..bundle.targets import TARGETS

GENIE_PREFIX = "genie-"
DEVICE_ROOT = "/data/local/tmp/hexforge"
RUNNER = "genie-t2t-run"
PROMPT_FILE = "prompt.txt"
REQUEST_CONFIG = "request_config.json"  # genie_config.json with this request's -n
ANDROID_LIB = "lib/aarch64-android"
SHA_BATCH = 40  # file names per sha256sum call (a shell line stays short)
QUERY_TIMEOUT_S = 120
T = TypeVar("T")


def qairt_files(arch: int, runner: str = RUNNER) -> list[str]:
    """What a phone needs from QAIRT_HOME beside a Genie folder, relative to it: QAIRT's
    ``genie-t2t-run`` (``genie-app`` for a pipeline), the Android libraries Genie opens for the
    HTP (Genie itself, the HTP backend, QNN's system library for the binaries' metadata, the
    backend-extensions library that reads htp_backend_ext_config.json, the arch's stub) and the
    arch's Hexagon skel."""
    return [f"bin/aarch64-android/{runner}",
            *(f"{ANDROID_LIB}/{n}" for n in (
                "libGenie.so", "libQnnHtp.so", "libQnnSystem.so",
                "libQnnHtpNetRunExtensions.so", f"libQnnHtpV{arch}Stub.so")),
            f"lib/hexagon-v{arch}/unsigned/libQnnHtpV{arch}Skel.so"]


def qairt_version(qairt: Path) -> str:
    """QAIRT's version: its ``sdk.yaml`` (``version: 2.36.1.250708``), else the install folder's
    name (``/opt/qcom/aistack/qairt/2.36.1.250708``)."""
    yaml = qairt / "sdk.yaml"
    if yaml.is_file():
        for line in yaml.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "version" and re.match(r"\d+\.\d+", value.strip()):
                return value.strip()
    if re.fullmatch(r"v?\d+\.\d+\.\d+(\.\d+)?", qairt.resolve().name):
        return qairt.resolve().name.lstrip("v")
    raise BackendError(f"cannot tell which QAIRT {qairt} is: no sdk.yaml with a version line, "
                       "and its folder is not named by a version")


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def soc_arch(soc: str) -> int | None:
    """The Hexagon arch of a phone SoC (``SM8850`` -> 81) by the target table, or None."""
    for t in TARGETS.values():
        for s in t.socs:
            if t.htp_arch and soc.upper().startswith(s.name):
                return t.htp_arch
    return None


def genie_folders(bundle: Path) -> dict[int, Path]:
    """{arch: genie-v<arch>/} of a bundle, or the folder itself when BUNDLE is one."""
    if (bundle / "genie_config.json").is_file():
        m = re.fullmatch(rf"{GENIE_PREFIX}v(\d+)", bundle.name)
        if m is None:
            raise BundleError(f"{bundle} is a Genie folder but not named {GENIE_PREFIX}v<arch>: "
                              "give the bundle it came from")
        return {int(m.group(1)): bundle}
    found = {}
    for p in sorted(bundle.glob(f"{GENIE_PREFIX}v*/genie_config.json")):
        m = re.fullmatch(rf"{GENIE_PREFIX}v(\d+)", p.parent.name)
        if m:
            found[int(m.group(1))] = p.parent
    if not found:
        what = "no hexforge bundle" if not (bundle / MANIFEST_NAME).is_file() else "a bundle"
        raise BundleError(f"{bundle} is {what} without a Genie folder: build it with --genie "
                          "(hexforge build ... --target v81 --genie)")
    return found


@dataclass(frozen=True)
class Push:
    name: str  # the file's name in the phone's folder (flat, as genie-t2t-run reads them)
    local: Path
    sha256: str


def run_or_tell(adb, run: str, prompt_arg: str | None, name: str, out: TextIO,
                say: Callable[[str], None]) -> int:
    """``run -p <prompt_arg>`` on the phone, its output streamed to ``out``; without a prompt,
    the command to run it (``prompt_arg`` is already quoted for the phone's sh)."""
    if prompt_arg is None:
        say(f"pushed; to run: adb{' -s ' + adb.serial if adb.serial else ''} shell "
            f"{shlex.quote(run + ' -p ' + shlex.quote('your prompt'))}")
        return 0
    code = adb.stream(f"{run} -p {prompt_arg}", out)
    if code:
        raise BackendError(f"{name} exited with {code} on the phone (its output is above)")
    return 0


def compiled_by(folder: Path, arch: int, config: dict) -> str | None:
    """The QNN version the folder's binaries were compiled by (their headers), checked to be
    the folder's arch."""
    from ..runtime.qnn import binary_info

    versions = set()
    for rel in config["dialog"]["engine"]["model"]["binary"]["ctx-bins"]:
        info = binary_info(folder / rel)
        if info["arch"] != arch:
            raise BundleError(f"{folder.name}/{rel} is compiled for v{info['arch']} "
                              f"({info['soc']}), not the folder's v{arch}: the bundle is "
                              "inconsistent")
        if info["sdk"]:
            versions.add(info["sdk"])
    return max(versions, key=version_tuple) if versions else None


def _bundle_sdk(folder: Path, arch: int) -> str | None:
    """The manifest's record of the QNN SDK of the same arch's target (the fallback)."""
    from ..bundle.manifest import load_manifest

    if not (folder.parent / MANIFEST_NAME).is_file():
        return None
    t = load_manifest(folder.parent, check_files=False).targets.get(f"v{arch}")
    return t.qnn_sdk if t else None


def folder_pushes(folder: Path) -> tuple[dict, list[Push]]:
    """The Genie folder judged as libGenie would (runtime/genie/checks.py) and its files as
    pushes (their digests the manifest's where it lists them); -> (genie_config.json, pushes).
    Both runtimes push the folder as it is: GenieX's QAIRT plugin reads the same files."""
    from ..runtime.genie.checks import check_folder

    config = check_folder(folder)
    records = _recorded_digests(folder)
    pushes = []
    for p in sorted(folder.iterdir()):
        if p.is_dir():
            raise BundleError(f"{folder.name}/{p.name} is a folder: a Genie folder is flat")
        pushes.append(Push(p.name, p, records.get(p.name) or sha256_of(p)))
    return config, pushes


def local_plan(folder: Path, arch: int, qairt: Path, say: Callable[[str], None],
               runner: str = RUNNER) -> list[Push]:
    """Everything checked without the phone; -> the files to put in the phone's folder."""
    config, pushes = folder_pushes(folder)
    if not qairt.is_dir():
        raise BackendError(f"--qairt {qairt} is not a folder (a QAIRT SDK: QAIRT_HOME)")
    missing = [rel for rel in qairt_files(arch, runner) if not (qairt / rel).is_file()]
    if missing:
        raise BackendError(f"QAIRT {qairt} lacks what a v{arch} phone needs: "
                           f"{', '.join(missing)}")
    have = qairt_version(qairt)
    need = compiled_by(folder, arch, config) or _bundle_sdk(folder, arch)
    if need is None:
        say(f"warning: the bundle does not say which QNN compiled {folder.name}/: QAIRT {have} "
            "is not checked against it")
    elif version_tuple(have) < version_tuple(need):
        raise BackendError(f"QAIRT {have} at {qairt} is older than QNN {need}, which compiled "
                           f"{folder.name}/'s binaries: a phone's libQnnHtp refuses newer "
                           f"binaries; use QAIRT {need} or newer")
    for rel in qairt_files(arch, runner):
        pushes.append(Push(Path(rel).name, qairt / rel, sha256_of(qairt / rel)))
    names = [p.name for p in pushes]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise BundleError(f"{folder.name}/ holds files QAIRT's would overwrite on the phone: "
                          f"{', '.join(clash)}")
    return pushes


def _recorded_digests(folder: Path) -> dict[str, str]:
    """The manifest's SHA-256 of the folder's files ({name: digest}; check_folder has compared
    them with the files, so they need not be hashed again), or {} (no file list)."""
    from ..bundle.manifest import load_manifest

    if not (folder.parent / MANIFEST_NAME).is_file():
        return {}
    m = load_manifest(folder.parent, check_files=False)
    inside = f"{folder.name}/"
    return {r.path[len(inside):]: r.sha256 for r in m.file_records or []
            if r.path.startswith(inside)}


class Adb:
    """adb, or (dry run) the commands adb would be given, printed."""

    def __init__(self, serial: str | None, dry_run: bool, say: Callable[[str], None]):
        self.serial, self.dry_run, self.say = serial, dry_run, say

    def argv(self, *args: str) -> list[str]:
        return ["adb", *(["-s", self.serial] if self.serial else []), *args]

    def run(self, *args: str, check: bool = True, timeout: float | None = QUERY_TIMEOUT_S
            ) -> subprocess.CompletedProcess | None:
        argv = self.argv(*args)
        if self.dry_run:
            self.say(shlex.join(argv))
            return None
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise BackendError("adb is not on PATH: install Android's platform-tools") from None
        except subprocess.TimeoutExpired:
            raise BackendError(f"`{shlex.join(argv)}` gave no answer in {timeout:.0f} s: is the "
                               "phone awake and authorized?") from None
        if check and r.returncode:
            why = " ".join((r.stderr or r.stdout).split())[:300]
            raise BackendError(f"`{shlex.join(argv)}` failed (exit {r.returncode}): {why}")
        return r

    def shell(self, command: str, check: bool = True) -> str:
        r = self.run("shell", command, check=check)
        return "" if r is None else r.stdout

    def stream(self, command: str, out: TextIO) -> int:
        """``adb shell command``, its output copied to ``out`` as it comes; -> its exit code."""
        argv = self.argv("shell", command)
        if self.dry_run:
            self.say(shlex.join(argv))
            return 0
        with subprocess.Popen(argv, stdout=subprocess.PIPE) as proc:
            while chunk := os.read(proc.stdout.fileno(), 4096):
                out.write(chunk.decode("utf-8", "replace"))
                out.flush()
        return proc.returncode


def pick_serial(adb: Adb, serial: str | None) -> str | None:
    """The phone adb talks to: ``serial`` if adb lists it, else the only one attached."""
    if adb.dry_run:
        adb.run("devices")
        return serial
    listed = [line.split("\t") for line in adb.run("devices").stdout.splitlines()[1:]
              if "\t" in line]
    ready = [s for s, state in listed if state.strip() == "device"]
    if serial is not None:
        if serial not in ready:
            state = next((st for s, st in listed if s == serial), "not attached")
            raise BackendError(f"phone {serial} is {state.strip()} (adb devices lists "
                               f"{', '.join(s for s, _ in listed) or 'none'})")
        return serial
    if not ready:
        raise BackendError("no phone: adb devices lists none ready (connect one with USB "
                           "debugging on, and accept the computer on it)")
    if len(ready) > 1:
        raise BackendError(f"several phones ({', '.join(ready)}): pick one with --serial")
    return ready[0]


def phone_arch(adb: Adb, stated: int | None, say: Callable[[str], None]) -> int | None:
    """The phone's Hexagon arch from its SoC; ``stated`` (--arch) must agree, or stands in for
    a SoC the table does not know."""
    soc = adb.shell("getprop ro.soc.model").strip()
    if adb.dry_run:
        return stated
    arch = soc_arch(soc) if soc else None
    if arch is None:
        known = ", ".join(f"{s.name} (v{t.htp_arch})" for t in TARGETS.values() for s in t.socs)
        if stated is None:
            raise BackendError(f"the phone's SoC {soc or '(getprop ro.soc.model is empty)'} is "
                               f"not in hexforge's target table ({known}); say its arch with "
                               "--arch if you know it")
        say(f"warning: the phone's SoC {soc or '?'} is not in the target table; taking --arch "
            f"v{stated} as said")
        return stated
    if stated is not None and stated != arch:
        raise BackendError(f"the phone is {soc} (Hexagon v{arch}), not the v{stated} --arch "
                           "says")
    return arch


def _phone_digests(adb: Adb, folder: str, names: list[str]) -> dict[str, str]:
    """{name: sha256} of the files the phone's folder holds (a missing one is left out)."""
    got: dict[str, str] = {}
    for i in range(0, len(names), SHA_BATCH):
        batch = names[i:i + SHA_BATCH]
        text = adb.shell(f"cd {shlex.quote(folder)} && sha256sum "
                         + " ".join(shlex.quote(n) for n in batch), check=False)
        for line in text.splitlines():
            digest, _, name = line.strip().partition(" ")
            name = name.strip().lstrip("*")
            if re.fullmatch(r"[0-9a-f]{64}", digest) and name in batch:
                got[name] = digest
    return got


def push(adb: Adb, folder: str, files: list[Push], say: Callable[[str], None],
         rounds: int = 2) -> int:
    """Only files missing or different on the phone are pushed; the phone's digests are read
    again after each round. -> files pushed."""
    adb.shell(f"mkdir -p {shlex.quote(folder)}")
    if adb.dry_run:
        for f in files:
            adb.run("push", str(f.local), f"{folder}/{f.name}", timeout=None)
        adb.shell(f"cd {shlex.quote(folder)} && sha256sum "
                  + " ".join(shlex.quote(f.name) for f in files), check=False)
        return len(files)
    names = [f.name for f in files]
    have = _phone_digests(adb, folder, names)
    todo = [f for f in files if have.get(f.name) != f.sha256]
    say(f"phone {folder}: {len(files) - len(todo)} of {len(files)} files already there, "
        f"{len(todo)} to push")
    pushed = 0
    for attempt in range(rounds):
        for f in todo:
            say(f"push {f.name} ({f.local.stat().st_size:,} B)")
            r = adb.run("push", str(f.local), f"{folder}/{f.name}", check=False, timeout=None)
            if r.returncode:
                why = " ".join((r.stderr or r.stdout).split())[:200]
                raise BackendError(f"adb push of {f.name} stopped (exit {r.returncode}: {why}); "
                                   "run deploy again: it pushes only what is missing")
            pushed += 1
        have = _phone_digests(adb, folder, [f.name for f in todo])
        todo = [f for f in todo if have.get(f.name) != f.sha256]
        if not todo:
            return pushed
        if attempt + 1 < rounds:
            say(f"after the push, {len(todo)} file(s) differ on the phone: pushing them again")
    raise BackendError(f"after {rounds} pushes these files still differ on the phone (sha256sum "
                       f"there): {', '.join(f.name for f in todo)}; check the phone's free space")


def _chat_template(bundle: Path, prompt: str, chat: bool):
    """The bundle's chat template when --chat asks for it (None without --chat); a prompt or
    template that cannot be had is refused before the phone is asked anything."""
    from ..runtime.text import ChatTemplate

    if not prompt:
        raise RequestError("--prompt is empty")
    if not chat:
        return None
    tok_dir = bundle / "tokenizer"
    template = ChatTemplate.load(tok_dir) if tok_dir.is_dir() else None
    if template is None:
        raise RequestError("--chat: this bundle has no chat template (a base model?)")
    return template


def render_prompt(bundle: Path, folder: Path, config: dict, prompt: str, chat: bool) -> str:
    """The text genie-t2t-run is given: the prompt, or (chat) it as a user turn in the bundle's
    chat template, less a leading BOS Genie prepends itself (its ``bos-token``)."""
    template = _chat_template(bundle, prompt, chat)
    if template is None:
        return prompt
    from tokenizers import Tokenizer

    text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    bos = config["dialog"]["context"].get("bos-token", -1)
    if isinstance(bos, int) and bos >= 0:
        token = Tokenizer.from_file(str(folder / "tokenizer.json")).id_to_token(bos)
        if token and text.startswith(token):
            text = text[len(token):]
    return text


def device_folder(bundle: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", bundle.resolve().name).lstrip(".") or "bundle"
    return f"{DEVICE_ROOT}/{name}"


def scripted_request(bundle: Path, folder: Path, prompt: str, chat: bool,
                     images: list[str], max_new_tokens: int | None = None):
    """The prompt with its images as a genie-app script (hexforge/commands/genie_app.py) for the Genie
    pipeline of ``folder``; every refusal (no pipeline, an image that does not decode) here,
    before the phone gets a file."""
    from ..runtime.genie.pipelinemodel import PIPELINE, GeniePipelineModel
    from ..runtime.options import GenerationOptions
    from .genie_app import script_request

    if not (folder / PIPELINE).is_file():
        raise BundleError(f"{folder.name}/ has no Genie pipeline ({PIPELINE}): --image needs a "
                          "bundle whose image tower was built as a Genie node (--genie on a "
                          "model with vision)")
    model = GeniePipelineModel(bundle, folder.name.removeprefix(GENIE_PREFIX))
    ids = model.chat_ids([{"role": "user", "content": prompt}]) if chat else prompt
    return script_request(model, ids, GenerationOptions(images=list(images),
                                                        max_new_tokens=max_new_tokens))


def pick_folder(folders: dict[int, Path], stated: int | None, serial: str | None,
                dry_run: bool, say: Callable[[str], None], plan: Callable[[Path, int], T]
                ) -> tuple[Adb, int, T]:
    """The Genie folder the phone gets, and ``plan(folder, arch)`` of it: the folder is planned
    (every local check) before adb is run, so a bundle or SDK refusal asks the phone nothing;
    then the phone's SoC picks among several arches (planned again when it picks another).
    -> (the adb of the phone, its arch, the plan)."""
    names = ", ".join(f.name for f in folders.values())
    if stated is not None and stated not in folders:
        raise BackendError(f"the bundle has no Genie folder for v{stated} (it has {names})")
    chosen = stated if stated is not None else (next(iter(folders)) if len(folders) == 1
                                                else None)
    if dry_run and chosen is None:
        raise RequestError(f"the bundle has Genie folders for several arches ({names}): "
                           "--dry-run asks the phone nothing, so say which with --arch")
    planned = None if chosen is None else plan(folders[chosen], chosen)
    adb = Adb(serial, dry_run, say)
    adb.serial = pick_serial(adb, serial)
    on_phone = phone_arch(adb, stated, say)
    if on_phone is not None and on_phone not in folders:
        raise BackendError(f"the phone is Hexagon v{on_phone} but the bundle's Genie folders are "
                           f"{names}: rebuild with --target v{on_phone} --genie")
    if on_phone is not None and on_phone != chosen:
        chosen = on_phone
        planned = plan(folders[chosen], chosen)
    # a dry run with one folder, or a phone that said its arch: both set chosen and planned
    assert chosen is not None and planned is not None
    return adb, chosen, planned


def deploy(bundle: str | Path, qairt: str | Path | None, prompt: str | None = None,
           serial: str | None = None, dry_run: bool = False, arch: str | None = None,
           device_dir: str | None = None, chat: bool = False, images: list[str] | None = None,
           audios: list[str] | None = None, max_new_tokens: int | None = None,
           say: Callable[[str], None] | None = None, out: TextIO | None = None) -> int:
    """The whole deploy (module doc). ``say``: progress lines (default stderr) and, under
    --dry-run, the commands (default stdout); ``out``: the runner's output, as it comes.
    ``images``: run the prompt with them through the bundle's Genie pipeline (genie-app);
    ``max_new_tokens``: the answer's length (default: the bundle's Genie config's)."""
    from ..runtime.model import parse_arch
    from .genie_app import APP, AUDIO_REFUSED, SCRIPT

    bundle = Path(bundle)
    out = out or sys.stdout
    say = say or ((lambda m: print(m, file=out)) if dry_run
                  else (lambda m: print(m, file=sys.stderr)))
    if audios:
        raise RequestError(AUDIO_REFUSED)
    if images and prompt is None:
        raise RequestError("--image needs --prompt: the image is a part of the prompt run")
    if max_new_tokens is not None and (prompt is None or max_new_tokens < 1):
        raise RequestError("-n needs --prompt and at least 1 token")
    if qairt is None:  # optional on the command line: --runtime geniex takes GenieX's instead
        raise RequestError("--qairt QAIRT_HOME is needed: genie-t2t-run and the Android "
                           "libraries come from a QAIRT SDK")
    qairt = Path(qairt)
    runner = APP if images else RUNNER
    if prompt is not None:
        _chat_template(bundle, prompt, chat)  # an empty prompt, --chat without a template: now
    folders = genie_folders(bundle)
    adb, chosen, plan = pick_folder(folders, parse_arch(arch), serial, dry_run, say,
                                    lambda f, a: local_plan(f, a, qairt, say, runner))
    folder = folders[chosen]
    where = device_dir or device_folder(bundle)
    request = (scripted_request(bundle, folder, prompt, chat, images, max_new_tokens)
               if images else None)
    config_name = "genie_config.json"
    with tempfile.TemporaryDirectory() as tmp:
        files = list(plan)
        if request is not None:
            files += [Push(p.name, p, sha256_of(p)) for p in request.write(Path(tmp))]
            if dry_run:  # its temp files are gone when the commands are read
                say(f"# {SCRIPT} (pushed from a temp file with its {len(request.files)} "
                    "request files):\n" + "".join(f"#   {ln}\n" for ln in
                                                   request.script.splitlines()).rstrip())
        elif prompt is not None:
            p = Path(tmp) / PROMPT_FILE
            config = json.loads((folder / "genie_config.json").read_text())  # checked above
            p.write_text(render_prompt(bundle, folder, config, prompt, chat))
            files.append(Push(PROMPT_FILE, p, sha256_of(p)))
            if dry_run:  # its temp file is gone when the commands are read
                say(f"# {PROMPT_FILE} (pushed from a temp file) holds {p.read_text()!r}")
            if max_new_tokens is not None:  # the folder's config, this answer's length
                config["dialog"]["max-num-tokens"] = max_new_tokens
                config_name = REQUEST_CONFIG
                c = Path(tmp) / REQUEST_CONFIG
                c.write_text(json.dumps(config, indent=1) + "\n")
                files.append(Push(REQUEST_CONFIG, c, sha256_of(c)))
        n = push(adb, where, files, say)
        if not dry_run:
            say(f"phone {where}: {len(files)} files match the bundle's SHA-256 ({n} pushed)")
        adb.shell(f"chmod 755 {shlex.quote(where + '/' + runner)}")
        env = (f"cd {shlex.quote(where)} && LD_LIBRARY_PATH={shlex.quote(where)} "
               f"ADSP_LIBRARY_PATH={shlex.quote(where)}")
        if request is not None:
            code = adb.stream(f"{env} ./{APP} -s {SCRIPT}", out)
            if code:
                raise BackendError(f"{APP} exited with {code} on the phone (its output is above)")
            return 0
        return run_or_tell(adb, f"{env} ./{RUNNER} -c {config_name}",
                           None if prompt is None else f'"$(cat {PROMPT_FILE})"', RUNNER, out, say)
