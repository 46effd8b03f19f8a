"""``qhx-generate``: the argument order of the seed bundles' runtime (docs/notes/realsize.md), as a
second entry point.

    qhx-generate MANIFEST libQnnHtp.so libQnnSystem.so ARTIFACTS_ROOT N_TOKENS PROMPT [IMAGE]

MANIFEST is a bundle's manifest.json (or the bundle dir); ARTIFACTS_ROOT must be that bundle (the
seed kept graphs apart from the manifest; a bundle holds both). The backend library picks the
backend: libQnnHtp.so -> the HTP (qnn on a Snapdragon, the simulator qnn-sim on x86),
libQnnCpu.so -> our CPU backend; libQnnSystem.so is accepted (QNN loads it by itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..bundle.errors import HexforgeError, RequestError

USAGE = ("usage: qhx-generate MANIFEST libQnnHtp.so libQnnSystem.so ARTIFACTS_ROOT N_TOKENS "
         "PROMPT [IMAGE]")


def backend_of(lib: str) -> str:
    name = Path(lib).name.lower()
    if "htp" in name:
        from ..runtime import qnn

        return "qnn" if qnn.is_arm_host() else "qnn-sim"
    if "cpu" in name:
        return "cpu"
    raise RequestError(f"backend library {lib!r}: expected libQnnHtp.so or libQnnCpu.so")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (6, 7):
        print(USAGE, file=sys.stderr)
        return 2
    manifest, backend_lib, system_lib, root, n, prompt = args[:6]
    try:
        from .. import load

        bundle = Path(manifest)
        bundle = bundle.parent if bundle.name.endswith(".json") else bundle
        if Path(root).resolve() != bundle.resolve():
            raise RequestError(f"ARTIFACTS_ROOT {root} is not the bundle of {manifest}")
        if "system" not in Path(system_lib).name.lower():
            raise RequestError(f"expected libQnnSystem.so as the third argument, got {system_lib}")
        if not n.isdigit() or int(n) < 1:
            raise RequestError(f"N_TOKENS must be a positive integer, got {n!r}")
        if len(args) == 7:
            raise RequestError("this bundle has no vision component: IMAGE is not supported")
        model = load(bundle, backend=backend_of(backend_lib))
        for piece in model.stream(prompt, max_new_tokens=int(n)):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    except HexforgeError as e:
        print(f"qhx-generate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
