"""A stand-in for QAIRT's Android ``genie-t2t-run`` in the deploy tests: the same arguments
(``-c genie_config.json -p PROMPT``), run on x86 by the onnxruntime-qnn wheel's libGenie over the
HTP simulator, from the folder the adb stand-in pushed to. Genie resolves the config's paths
against the working directory, so an answer says the pushed folder holds all Genie reads.

Prints what genie-t2t-run prints around the answer (``[BEGIN]: ... [END]``); at most
``$GENIE_STANDIN_TOKENS`` tokens (default 8: a random tiny model rarely stops by itself).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str]) -> int:
    from hexforge.runtime.genie import libgenie as genie

    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("-p", "--prompt", required=True)
    a = ap.parse_args(argv)
    config = json.loads(open(a.config).read())
    config["dialog"]["engine"]["backend"]["QnnHtp"]["poll"] = False  # x86: no polling thread
    print(f"Using libGenie.so version {genie.api_version()}\n", flush=True)
    print(f"[PROMPT]: {a.prompt}\n", flush=True)
    print("[BEGIN]: ", end="", flush=True)
    with genie.Dialog(config) as dialog:
        genie.load().GenieDialog_setMaxNumTokens(dialog.handle,
                                                 int(os.environ.get("GENIE_STANDIN_TOKENS", 8)))
        dialog.query(a.prompt, lambda piece: print(piece, end="", flush=True))
    print("[END]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
