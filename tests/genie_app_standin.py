"""A stand-in for QAIRT's Android ``genie-app`` in the deploy tests: ``genie-app -s SCRIPT`` read a
line at a time, each command making the GenieNode / GeniePipeline calls genie-app makes for it
(those hexforge/commands/genie_app.py writes; any other command fails, as an ill-formatted one does in
genie-app), on x86 by the onnxruntime-qnn wheel's libGenie over the HTP simulator, in the folder
the adb stand-in pushed to: Genie resolves the configs' paths against it, so an answer says the
pushed folder holds all Genie reads.

The text-generator makes at most ``$GENIE_STANDIN_TOKENS`` tokens (default 8) and does not poll
(x86). Where genie-app registers its text callback, the stand-in registers Genie's token callback
(Genie takes one or the other) and writes the ids to ``standin-tokens.json`` in the working
folder, printing them between ``[BEGIN]: `` and ``[END]``: a random tiny model's tokens
detokenize to empty pieces in Genie's text callback (one call a token, measured), so its text
cannot say which tokens came.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import sys


def main(argv: list[str]) -> int:
    from hexforge.runtime.genie import libgenie as genie
    from hexforge.runtime.genie.libpipeline import IO, TOKEN_CB, load

    if argv[:1] != ["-s"] or len(argv) != 2:
        print("usage: genie-app -s SCRIPT", file=sys.stderr)
        return 1
    lib = load()
    log = genie.GenieLog("warn")
    configs: dict[str, bytes] = {}
    nodes: dict[str, ctypes.c_void_p] = {}
    pipes: dict[str, ctypes.c_void_p] = {}
    keep = []  # buffers and callbacks Genie may read until it is done

    def check(status: int, what: str) -> None:
        if status < 0:
            raise SystemExit(f"[genie-app stand-in] {what} failed ({status}): {log.tail()}")

    tokens: list[int] = []

    def took(ids, n, _code, _user) -> None:
        tokens.extend(int(ids[i]) for i in range(n))

    token_cb = TOKEN_CB(took)
    for line in open(argv[1]).read().splitlines():
        cmd = shlex.split(line)
        if not cmd:
            continue
        match cmd:
            case ["node", "config", "create", name, path]:
                cfg = json.loads(open(path).read())
                if "text-generator" in cfg:
                    d = cfg["text-generator"]
                    d["engine"]["backend"]["QnnHtp"]["poll"] = False
                    d["max-num-tokens"] = int(os.environ.get("GENIE_STANDIN_TOKENS", 8))
                configs[name] = json.dumps(cfg).encode()
            case ["node", "create", node, name]:
                cfg, handle = ctypes.c_void_p(), ctypes.c_void_p()
                check(lib.GenieNodeConfig_createFromJson(configs[name], ctypes.byref(cfg)), line)
                check(lib.GenieNodeConfig_bindLogger(cfg, log.handle), line)
                check(lib.GenieNode_create(cfg, ctypes.byref(handle)), line)
                nodes[node] = handle
            case ["pipeline", "config", "create", name, path]:
                configs[name] = open(path, "rb").read()
            case ["pipeline", "create", pipe, name]:
                cfg, handle = ctypes.c_void_p(), ctypes.c_void_p()
                check(lib.GeniePipelineConfig_createFromJson(configs[name], ctypes.byref(cfg)),
                      line)
                check(lib.GeniePipeline_create(cfg, ctypes.byref(handle)), line)
                pipes[pipe] = handle
            case ["pipeline", "add", pipe, node]:
                check(lib.GeniePipeline_addNode(pipes[pipe], nodes[node]), line)
            case ["pipeline", "connect", pipe, prod, prod_io, cons, cons_io]:
                check(lib.GeniePipeline_connect(pipes[pipe], nodes[prod], IO[prod_io],
                                                nodes[cons], IO[cons_io]), line)
            case ["node", "set", "textCallback", node, "GENIE_NODE_TEXT_GENERATOR_TEXT_OUTPUT"]:
                check(lib.GenieNode_setTokenCallback(
                    nodes[node], IO["GENIE_NODE_TEXT_GENERATOR_TOKEN_OUTPUT"], token_cb), line)
            case ["node", "set", "textFile", node, io, path]:
                data = open(path, "rb").read() + b"\0"
                buf = ctypes.create_string_buffer(data, len(data))
                keep.append(buf)
                check(lib.GenieNode_setData(nodes[node], IO[io], buf, len(data), None), line)
            case ["node", "set", "image", node, io, path]:
                data = open(path, "rb").read()
                buf = ctypes.create_string_buffer(data, len(data))
                keep.append(buf)
                check(lib.GenieNode_setData(nodes[node], IO[io], buf, len(data), None), line)
            case ["pipeline", "execute", pipe]:
                print("[BEGIN]: ", end="", flush=True)
                check(lib.GeniePipeline_execute(pipes[pipe], None), line)
                print(" ".join(map(str, tokens)) + "[END]", flush=True)
                with open("standin-tokens.json", "w") as f:
                    json.dump(tokens, f)
            case _:
                print(f"Ill-formatted command: {line}.", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
