"""A request with images as a script for QAIRT's ``genie-app``: what ``hexforge deploy --image``
runs on a phone, where no Python drives libGenie.

genie-app (QAIRT's ``bin/aarch64-android/genie-app``, run as ``genie-app -s SCRIPT``) reads one
command a line and makes the GenieNode / GeniePipeline calls runtime/genie/pipelinemodel.py makes
through ctypes on x86 — in the same order, from the same request configs
(``GeniePipelineModel.request_configs``, with the bundle's relative paths)::

    node config create <node> request-<node>.json      per node this request uses
    node create <node> <node>
    pipeline config create pipeline request-pipeline.json
    pipeline create pipeline pipeline
    pipeline add pipeline <node>                        each node
    pipeline connect pipeline <producer> <IO> <consumer> <IO>   genie_pipeline.json's connections
    node set textCallback textGenerator GENIE_NODE_TEXT_GENERATOR_TEXT_OUTPUT   the answer, printed
    node set textFile textEncoder GENIE_NODE_TEXT_ENCODER_TEXT_INPUT request-<i>.txt  a text run
    node set image imageEncoder <IO> request-<i>-<k>.raw    a media input: its float32 bytes, as
                                                        setData takes them (Genie quantizes them)
    pipeline execute pipeline

Why these commands (genie-app's command table, read for its names): ``set image`` hands a file's
bytes to GenieNode_setData unchanged, so it serves every media input; a text run goes as a file
(``textFile``) because a script line cannot hold the chat template's newlines; IO names are
GenieNode.h's, and genie-app knows none for an audio encoder's inputs, so audio prompts cannot be
scripted — refused in one line before anything is pushed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..bundle.errors import RequestError

APP = "genie-app"
SCRIPT = "request.script"
TEXT_CALLBACK = "node set textCallback textGenerator GENIE_NODE_TEXT_GENERATOR_TEXT_OUTPUT"
AUDIO_REFUSED = ("--audio on a phone: QAIRT's genie-app names no audio-encoder input in its "
                 "scripts, so an audio prompt runs only where hexforge drives libGenie itself "
                 "(hexforge run --backend genie)")


@dataclass(frozen=True)
class ScriptedRequest:
    """The script and the files it reads, by their names in the phone's folder."""

    script: str
    files: dict[str, bytes]

    def write(self, folder: Path) -> list[Path]:
        """The script and its files into ``folder``; -> their paths, the script first."""
        out = [folder / SCRIPT]
        out[0].write_text(self.script)
        for name, data in self.files.items():
            (folder / name).write_bytes(data)
            out.append(folder / name)
        return out


def script_request(model, prompt: str | list[int], options) -> ScriptedRequest:
    """``model``: the bundle's ``GeniePipelineModel`` (no libGenie is opened); ``prompt`` and
    ``options`` as its ``iterate`` takes them (the images in ``options.images``)."""
    from ..runtime.genie.pipelinemodel import media_feeds

    spec = model.pipeline_spec
    if options.audios:
        raise RequestError(AUDIO_REFUSED)
    r, _ids, segments = model.prepare(prompt, options)
    configs = model.request_configs(segments, r.max_new, r.temperature, r.top_k, r.top_p, r.seed,
                                    r.ignore_eos, on_phone=True)
    for seg in segments:
        if seg[0] != "text" and spec["media"][seg[0]]["rows"] != "node":
            raise RequestError(f"a {seg[0]} whose rows pass through the host (this bundle's "
                               f"{spec['media'][seg[0]]['node']}) cannot be scripted for "
                               "genie-app")
    files: dict[str, bytes] = {}
    lines = []
    for name, cfg in configs.items():
        files[f"request-{name}.json"] = (json.dumps(cfg, indent=1) + "\n").encode()
        lines += [f"node config create {name} request-{name}.json", f"node create {name} {name}"]
    files["request-pipeline.json"] = b"{}\n"
    lines += ["pipeline config create pipeline request-pipeline.json",
              "pipeline create pipeline pipeline"]
    lines += [f"pipeline add pipeline {name}" for name in configs]
    lines += [f"pipeline connect pipeline {p} {p_io} {c} {c_io}"
              for p, p_io, c, c_io in spec["connections"] if p in configs and c in configs]
    lines.append(TEXT_CALLBACK)
    text = spec["text"]
    for i, seg in enumerate(segments):
        if seg[0] == "text":
            files[f"request-{i}.txt"] = seg[1].encode()
            lines.append(f"node set textFile {text['node']} {text['input']} request-{i}.txt")
            continue
        media = spec["media"][seg[0]]
        for k, (io, value) in enumerate(media_feeds(media, seg[2])):
            files[f"request-{i}-{k}.raw"] = np.ascontiguousarray(value, np.float32).tobytes()
            lines.append(f"node set image {media['node']} {io} request-{i}-{k}.raw")
    lines.append("pipeline execute pipeline")
    return ScriptedRequest("\n".join(lines) + "\n", files)
