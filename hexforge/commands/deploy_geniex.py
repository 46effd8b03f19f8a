"""``hexforge deploy BUNDLE --runtime geniex --geniex DIR``: the bundle's Genie folder and GenieX's
Android files pushed with adb (the same checks, digests and push as ``hexforge deploy``:
deploy.py), the folder registered in GenieX's model store with ``geniex pull --local-path`` and
the prompt run by ``geniex infer``, GenieX's QAIRT plugin loading the compiled binaries.

What GenieX needs was read from its source (qualcomm/GenieX at ``GENIEX_COMMIT``), not run:

    geniex pull NAME --local-path DIR   a folder holding metadata.json and *.bin shards is an
                                        "AI Hub extracted" model for the qairt plugin
                                        (sdk/model-manager/.../source/localfs.rs); the files are
                                        copied into the store (--data-dir)
    geniex infer NAME -p P --max-tokens N
                                        the plugin comes from the stored model (qairt), not from a
                                        flag; the chat template is the plugin's (tokenizer_config.json)
    on Android                          the libraries are a flat folder: the plugin opens
                                        GENIEX_PLUGIN_PATH/libQnnHtp.so, libQnnSystem.so,
                                        libQnnHtpNetRunExtensions.so and sets ADSP_LIBRARY_PATH to
                                        it (sdk/plugins/qairt/include/qnn_runtime_utils.h); the SDK
                                        finds the plugin as <GENIEX_PLUGIN_PATH>/<dir>/libgeniex_plugin.so
                                        (sdk/src/registry.cpp); GenieX's own phone scripts copy
                                        lib/qairt/htp-files/*.so up into lib/ (tests/qdc/android,
                                        sdk/benchmark/qdc/tests)

Nothing here has run on a phone. GenieX publishes no Android build of the ``geniex`` command
line at that commit (its release builds the CLI for Windows and Linux arm64 only; Android gets
the AAR and geniex-bench-android-arm64, whose lib/ holds the libraries): DIR is that lib/ tree
with a ``geniex`` built for Android beside it (docs/deploy.md "GenieX").
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..bundle.bundlefiles import sha256_of
from ..bundle.errors import BackendError, BundleError, RequestError
from .deploy import (
    DEVICE_ROOT,
    Push,
    compiled_by,
    device_folder,
    folder_pushes,
    genie_folders,
    pick_folder,
    push,
    run_or_tell,
)

GENIEX_COMMIT = "cb60a5dd7ebc1a2369c7d1a4eb0de8be893a8cf9"
GENIEX = "geniex"
METADATA = "metadata.json"  # forge/genie/geniex.py's METADATA: what makes a folder GenieX's
# On the phone: GenieX's files in one folder shared by every bundle (a leading dot: no bundle's
# folder can be named so, device_folder strips it), its model store beside it (not inside: the
# SDK scans each folder under GENIEX_PLUGIN_PATH for a plugin)
GENIEX_DEVICE_DIR = f"{DEVICE_ROOT}/.geniex"
GENIEX_DATA_DIR = f"{DEVICE_ROOT}/.geniex-data"
PLUGIN_DIR = "qairt"  # the plugin's folder under GENIEX_PLUGIN_PATH (its plugin_id)
HTP_FILES = "qairt/htp-files"


def geniex_files(arch: int) -> list[str]:
    """What ``--geniex DIR``'s library tree must hold for a v``arch`` phone, relative to it:
    the SDK the CLI links (libgeniex.so), the QAIRT plugin and its core (installed into
    lib/qairt by sdk/plugins/qairt/CMakeLists.txt), and from the plugin's htp-files/ the three
    QNN libraries the plugin opens by name plus the arch's stub and Hexagon skel."""
    return ["libgeniex.so", f"{PLUGIN_DIR}/libgeniex_plugin.so", f"{PLUGIN_DIR}/libgeniex_core.so",
            *(f"{HTP_FILES}/{n}" for n in (
                "libQnnHtp.so", "libQnnSystem.so", "libQnnHtpNetRunExtensions.so",
                f"libQnnHtpV{arch}Stub.so", f"libQnnHtpV{arch}Skel.so"))]


def geniex_layout(root: Path) -> tuple[Path | None, Path]:
    """(the geniex binary or None, the library tree) of ``--geniex DIR``: GenieX's CLI package
    puts the SDK's lib/ contents beside ``geniex`` (cli/BUILD.bazel ``//cli:artifact``); its
    Android archive (geniex-bench-android-arm64) has bin/ and lib/. Both are taken."""
    binary = next((p for p in (root / GENIEX, root / "bin" / GENIEX) if p.is_file()), None)
    lib = root / "lib" if (root / "lib" / "libgeniex.so").is_file() else root
    return binary, lib


@dataclass(frozen=True)
class GenieXPlan:
    config: dict  # the Genie folder's genie_config.json
    folder: list[Push]  # the Genie folder's files, to the bundle's folder on the phone
    runtime: list[Push]  # GenieX's files, to GENIEX_DEVICE_DIR (qairt/... keep their folder)


def _card_reason(folder: Path) -> str | None:
    """The model card's reason GenieX cannot load ``folder`` (modelcard.py writes
    "`genie-v81/`: GenieX: not loadable (WHY)."), or None."""
    card = folder.parent / "README.md"
    if not card.is_file():
        return None
    line = re.compile(rf"`{re.escape(folder.name)}/`: GenieX: not loadable \((.*)\)\.\s*$")
    for text in card.read_text(errors="replace").splitlines():
        if m := line.search(text):
            return m.group(1)
    return None


def check_loadable(folder: Path, say: Callable[[str], None]) -> None:
    """A folder without metadata.json is refused (GenieX's localfs pull would not even take it
    as a QAIRT model); what hexforge's reading of the plugin says it would still refuse
    (metadata.json's ``hexforge.blockers``) is a warning: that reading is not a run."""
    from ..forge.genie.geniex import MODEL_ID_PREFIX

    meta = folder / METADATA
    if not meta.is_file():
        why = _card_reason(folder) or (
            "hexforge writes metadata.json for the families GenieX's QAIRT plugin dispatches: "
            f"{', '.join(sorted(MODEL_ID_PREFIX))}; rebuild with --genie")
        raise BundleError(f"{folder.name}/ has no {METADATA}: the model is not loadable by "
                          f"GenieX ({why})")
    try:
        blockers = (json.loads(meta.read_text()).get("hexforge") or {}).get("blockers") or []
    except (json.JSONDecodeError, AttributeError):
        raise BundleError(f"{folder.name}/{METADATA} is not a JSON object: rebuild with "
                          "--genie") from None
    if blockers:
        say(f"warning: {folder.name}/{METADATA} lists what GenieX's plugin would refuse, by "
            f"hexforge's reading of its source: {'; '.join(blockers)}")


def geniex_plan(folder: Path, arch: int, root: Path, say: Callable[[str], None]) -> GenieXPlan:
    """Everything checked without the phone; -> what goes where."""
    check_loadable(folder, say)
    config, pushes = folder_pushes(folder)
    if not root.is_dir():
        raise BackendError(f"--geniex {root} is not a folder (GenieX's Android files: geniex "
                           "and its lib/ tree)")
    binary, lib = geniex_layout(root)
    missing = ([] if binary else [f"{GENIEX} (or bin/{GENIEX})"]) + [
        rel for rel in geniex_files(arch) if not (lib / rel).is_file()]
    if missing or binary is None:
        raise BackendError(f"GenieX {root} lacks what a v{arch} phone needs: {', '.join(missing)}")
    runtime = [Push(GENIEX, binary, sha256_of(binary))]
    # the SDK and the plugin's folder as GenieX installs them; every .so of the plugin's folder,
    # as GenieX's Android AAR packs it (its transitive libraries, libgeniex_vlm.so...)
    for p in [lib / "libgeniex.so", *sorted((lib / PLUGIN_DIR).glob("*.so"))]:
        runtime.append(Push(p.relative_to(lib).as_posix(), p, sha256_of(p)))
    # htp-files/ flat into the folder: the plugin on Android opens the QNN libraries there
    for p in sorted((lib / HTP_FILES).glob("*.so")):
        runtime.append(Push(p.name, p, sha256_of(p)))
    names = [p.name for p in runtime]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise BackendError(f"GenieX {root}: {HTP_FILES}/ holds files named as the SDK's: "
                           f"{', '.join(clash)}")
    need = compiled_by(folder, arch, config)
    if need:  # the genie runtime checks QAIRT's sdk.yaml; GenieX's libraries carry no version file
        say(f"note: {folder.name}/'s binaries were compiled by QNN {need}; GenieX's "
            "libQnnHtp.so must not be older (hexforge cannot read its version)")
    return GenieXPlan(config, pushes, runtime)


def store_name(where: str) -> str:
    """The name the folder gets in GenieX's store: "<org>/<repo>", one slash
    (model-manager's validate_model_name)."""
    return "hexforge/" + (re.sub(r"[^A-Za-z0-9._-]", "_", Path(where).name).lstrip(".")
                          or "bundle")


def _requested(prompt: str | None, chat: bool, images: list[str] | None,
               audios: list[str] | None, max_new_tokens: int | None, geniex: object) -> None:
    """What GenieX is not asked to do here, refused before anything is read."""
    if geniex is None:
        raise RequestError("--runtime geniex needs --geniex DIR: the geniex binary built for "
                           "Android and GenieX's Android lib/ tree (docs/deploy.md)")
    if chat:
        raise RequestError("--chat with --runtime geniex: GenieX applies tokenizer_config.json's "
                           "chat template itself; give the plain prompt")
    if images or audios:
        raise RequestError("--image / --audio with --runtime geniex: hexforge's Genie folders "
                           "carry no GenieX vision encoder (docs/genie.md \"GenieX\"); use "
                           "--runtime genie")
    if prompt is not None and not prompt:
        raise RequestError("--prompt is empty")
    if max_new_tokens is not None and (prompt is None or max_new_tokens < 1):
        raise RequestError("-n needs --prompt and at least 1 token")


def deploy_geniex(bundle: str | Path, geniex: str | Path | None, prompt: str | None = None,
                  serial: str | None = None, dry_run: bool = False, arch: str | None = None,
                  device_dir: str | None = None, chat: bool = False,
                  images: list[str] | None = None, audios: list[str] | None = None,
                  max_new_tokens: int | None = None, say: Callable[[str], None] | None = None,
                  out: TextIO | None = None) -> int:
    """The whole GenieX deploy (module doc); the arguments as deploy.deploy's, ``geniex`` the
    GenieX folder in place of QAIRT_HOME."""
    from ..runtime.model import parse_arch

    out = out or sys.stdout
    say = say or ((lambda m: print(m, file=out)) if dry_run
                  else (lambda m: print(m, file=sys.stderr)))
    _requested(prompt, chat, images, audios, max_new_tokens, geniex)
    assert geniex is not None  # _requested refused it
    root = Path(geniex)
    folders = genie_folders(Path(bundle))
    adb, _, plan = pick_folder(folders, parse_arch(arch), serial, dry_run, say,
                                    lambda f, a: geniex_plan(f, a, root, say))
    where = device_dir or device_folder(Path(bundle))
    gx = GENIEX_DEVICE_DIR
    n = push(adb, where, plan.folder, say)
    adb.shell(f"mkdir -p {shlex.quote(gx + '/' + PLUGIN_DIR)}")  # push makes only gx itself
    n += push(adb, gx, plan.runtime, say)
    if not dry_run:
        say(f"phone {where}, {gx}: {len(plan.folder) + len(plan.runtime)} files match "
            f"({n} pushed)")
    adb.shell(f"chmod 755 {shlex.quote(gx + '/' + GENIEX)}")
    q = shlex.quote
    env = (f"cd {q(gx)} && HOME={q(gx)} LD_LIBRARY_PATH={q(gx)}:{q(gx + '/' + PLUGIN_DIR)} "
           f"ADSP_LIBRARY_PATH={q(gx)} GENIEX_PLUGIN_PATH={q(gx)} ./{GENIEX}")
    opts = f"--data-dir {q(GENIEX_DATA_DIR)} --skip-update"
    name = store_name(where)
    # a pull keeps a stored file whose size matches (model-manager's resume.rs): a rebuilt
    # binary of the same size would stay stale, so the stored copy goes first (none: no matter)
    adb.shell(f"{env} remove {q(name)} -y {opts} >/dev/null 2>&1; true", check=False)
    code = adb.stream(f"{env} pull {q(name)} --local-path {q(where)} {opts}", out)
    if code:
        raise BackendError(f"geniex pull exited with {code} on the phone (its output is above)")
    # -n, else the Genie config's length where it says one, else GenieX's default (2048)
    tokens = max_new_tokens or plan.config["dialog"].get("max-num-tokens")
    run = f"{env} infer {q(name)} {opts}" + (f" --max-tokens {int(tokens)}" if tokens else "")
    # the prompt single-quoted for the phone's sh (shlex.quote): nothing in it is expanded
    return run_or_tell(adb, run, None if prompt is None else q(prompt), "geniex infer", out, say)
