"""A stand-in for ``adb`` in the deploy tests (plumbing: no phone is involved).

It records every call it is given, one JSON line each, in ``$ADB_STANDIN/calls.jsonl``, and plays
a phone whose file system is the folder ``$ADB_STANDIN/phone`` (device paths are mapped under it;
``adb shell`` commands run in /bin/sh there, with a ``getprop`` that answers the SoC of
``$ADB_STANDIN/phone.json``). That file also says which pushes go wrong::

    {"soc": "SM8850", "devices": {"STANDIN1": "device"},
     "drop": {"token_ar1_cl128_1_of_1.bin": 1},    # pushed short, exit 0 (a silent partial push)
     "cut": {"libQnnHtp.so": 1}}                    # pushed short, then exit 1 (interrupted)

the counts going down by one each time a push of that file goes wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

DEVICE_PREFIX = "/data/"


def main(argv: list[str]) -> int:
    state = Path(os.environ["ADB_STANDIN"])
    with open(state / "calls.jsonl", "a") as log:
        log.write(json.dumps(argv) + "\n")
    cfg_path = state / "phone.json"
    cfg = json.loads(cfg_path.read_text())
    phone = state / "phone"
    args = list(argv)
    serial = None
    if args[:1] == ["-s"]:
        serial, args = args[1], args[2:]
    devices = cfg.get("devices", {"STANDIN1": "device"})
    if args == ["devices"]:
        print("List of devices attached")
        for s, st in devices.items():
            print(f"{s}\t{st}")
        return 0
    if serial is None and len(devices) != 1:
        print("adb: more than one device/emulator", file=sys.stderr)
        return 1
    if serial is not None and devices.get(serial) != "device":
        print(f"adb: device '{serial}' not found", file=sys.stderr)
        return 1

    def local(device_path: str) -> Path:
        return phone / device_path.lstrip("/")

    if args[0] == "push":
        src, dst = Path(args[1]), local(args[2])
        dst.parent.mkdir(parents=True, exist_ok=True)
        for kind in ("drop", "cut"):
            if cfg.get(kind, {}).get(dst.name, 0) > 0:
                cfg[kind][dst.name] -= 1
                cfg_path.write_text(json.dumps(cfg))
                data = src.read_bytes()
                dst.write_bytes(data[:len(data) // 2])
                if kind == "cut":
                    print("adb: error: failed to copy: connection reset", file=sys.stderr)
                    return 1
                print(f"{src}: 1 file pushed.")
                return 0
        shutil.copyfile(src, dst)
        print(f"{src}: 1 file pushed.")
        return 0
    if args[0] == "shell":
        command = " ".join(args[1:]).replace(DEVICE_PREFIX, str(phone) + DEVICE_PREFIX)
        getprop = f'getprop() {{ [ "$1" = ro.soc.model ] && echo {cfg.get("soc", "")}; }}; '
        return subprocess.call(["/bin/sh", "-c", getprop + command])
    print(f"adb stand-in: {args[0]} is not played", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
