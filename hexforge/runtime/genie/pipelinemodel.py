"""``--backend genie`` with images and audio: the bundle's Genie pipeline (GeniePipeline /
GenieNode of libGenie, through ctypes) fed the prompt in order (no torch).

    genie-<target>/genie_pipeline.json (forge/genie/towers.py)
      nodes: textGenerator (text-generator.json), imageEncoder / audioEncoder (<role>.json)
    prompt ─ids with each placeholder expanded ([begin] placeholder x n [end], as the HF
            processor and hexforge's media path expand it)─▶ segments, in order:
      text run  ─its text (checked to tokenize back to the same ids)─▶ textEncoder ─▶ generator
      media item ─host prep (runtime/vision.py, audio.py: hexforge's numbers)─▶ its encoder node
                  (IMAGE_INPUT / AUDIO_INPUT + masks), whose n rows reach the generator: Genie
                  appends them (a connection) or the host does (rows_via "host")
    GeniePipeline_execute ─▶ the text-generator's tokens (its token callback)

The C API's binding (nodes, pipelines, their IO values and callbacks): libpipeline.py.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ...bundle.errors import BundleError, RequestError
from ...bundle.lut import LutEncoding
from ..options import Done, GenerationOptions, Piece, check_request
from . import libgenie as genie
from .checks import check_prompt_fits, keep_ar1, lut_files
from .libpipeline import Node, Pipeline
from .model import GenieModel, absolute_paths, never_eos, sampler_config

# the options a pipeline honours beside a dialog's
MEDIA_OPTIONS = frozenset({"images", "audios"})

PIPELINE = "genie_pipeline.json"


def node_paths(config: dict, folder: Path) -> dict:
    """A node config with its files (binaries, extension config; a text-encoder's LUT, its PCQ
    scales and offsets, and tokenizer) made absolute: Genie resolves them against the working
    directory."""
    cfg = json.loads(json.dumps(config))
    body = next(iter(cfg.values()))
    if "engine" not in body:  # a text-encoder: its LUT (an 8-bit one's scales too) and tokenizer
        for where, path in list(lut_files(body["lut"])):
            *outer, key = where.split(".")
            block = body["lut"]
            for k in outer:
                block = block[k]
            block[key] = str(folder / path)
        body["tokenizer"]["path"] = str(folder / body["tokenizer"]["path"])
        return cfg
    engine = body["engine"]
    backend = engine["backend"]
    if isinstance(backend.get("extensions"), str):
        backend["extensions"] = str(folder / backend["extensions"])
    binary = engine["model"]["binary"]
    binary["ctx-bins"] = [str(folder / b) for b in binary["ctx-bins"]]
    return cfg


def patch_grid(position_ids: np.ndarray) -> tuple[int, int]:
    """(height, width) in patches of an image whose patch positions [1, P, 2] are (x, y), -1 on
    padding (runtime/vision.py Gemma4ImagePrep): Genie's vision-param for that image."""
    real = position_ids[0][position_ids[0, :, 0] >= 0]
    return int(real[:, 1].max()) + 1, int(real[:, 0].max()) + 1


class GeniePipelineModel(GenieModel):
    """``GenieModel`` whose requests with images / audio run the bundle's Genie pipeline
    (text alone still goes through the Genie dialog)."""

    def __init__(self, bundle: str | Path, arch: str | None = None, log_level: str = "warn",
                 dump_tensors: Path | None = None, prefill_mode: str = "chunked"):
        """``dump_tensors``: a folder for Genie's own dump of every tensor the text-generator's
        graphs take and give (its ``debug: dump-tensors``): what Genie feeds, measured."""
        super().__init__(bundle, arch, log_level, prefill_mode)
        from ...bundle.manifest import load_manifest

        self.dump_tensors = dump_tensors
        self.pipeline_spec = json.loads((self.folder / PIPELINE).read_text())
        self.manifest = load_manifest(self.bundle)
        d = self.config["dialog"]
        emb = d.get("embedding") or {}
        width = int(self.pipeline_spec["text"]["lut_width"])
        if int(emb.get("size", -1)) != width:
            raise BundleError(f"{self.folder}: {PIPELINE} says LUT rows of {width}, "
                              f"genie_config.json {emb.get('size')}")
        self._preps: dict = {}
        self._made: tuple[str, Pipeline, genie.GenieLog] | None = None

    # ---- the prompt ----
    def _segments(self, ids: list[int], images, audios) -> tuple[list[int], list[tuple]]:
        """ids with each item's placeholder expanded, and the segments in prompt order:
        ("text", ids) | (modality, spec, feeds) — every item decoded and preprocessed first."""
        from ..multimodal import _items, decode_media

        decoded = decode_media(self.manifest, images, audios, self._preps)
        items = {}
        for modality, (spec, prep, media) in decoded.items():
            if modality not in self.pipeline_spec["media"]:
                raise RequestError(f"this Genie bundle has no {modality} node (built before "
                                   "Genie pipelines, or its tower states no Genie form)")
            ids = _items(ids, spec, len(media), self.manifest.generation.bos_token_id)
            items[spec.placeholder_id] = (modality, spec, [prep(m) for m in media])
        out_ids, segments, run = [], [], []
        taken = dict.fromkeys(items, 0)
        for i, t in enumerate(ids):
            if t not in items:
                out_ids.append(t)
                run.append(t)
                continue
            modality, spec, prepped = items[t]
            feeds, n = prepped[taken[t]]
            taken[t] += 1
            if spec.begin_id is not None and (not out_ids or out_ids[-1] != spec.begin_id):
                out_ids.append(spec.begin_id)
                run.append(spec.begin_id)
            if run:
                segments.append(("text", run))
                run = []
            segments.append((modality, spec, feeds, n))
            out_ids.extend([t] * n)
            if spec.end_id is not None and (i + 1 == len(ids) or ids[i + 1] != spec.end_id):
                out_ids.append(spec.end_id)
                run.append(spec.end_id)
        if run:
            segments.append(("text", run))
        return out_ids, [(s[0], self._text(s[1])) if s[0] == "text" else s for s in segments]

    def _text(self, ids: list[int]) -> str:
        """The text Genie's text-encoder is given for a run of prompt ids: decoded with the
        special tokens spelled out, refused unless the bundle's tokenizer (the one Genie
        tokenizes with, without a post-processor) gives back exactly these ids."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        again = self.tokenizer.encode(text, add_special_tokens=False)
        if again != ids:
            raise RequestError("--backend genie with media: this prompt's text does not "
                               f"tokenize back to its ids (Genie tokenizes it again): {text!r}")
        return text

    def request_configs(self, segments, max_new: int, temperature, top_k, top_p, seed,
                        ignore_eos: bool, on_phone: bool = False) -> dict[str, dict]:
        """Node name -> its config for this request (the generator's sampler and length; an
        image node's vision-param is the image's grid). Here (x86) the files are absolute
        paths and the generator does not poll; ``on_phone``: paths as the bundle has them
        (relative to the folder genie-app runs in) and the bundle's polling."""
        spec = self.pipeline_spec

        def paths(cfg: dict) -> dict:
            return json.loads(json.dumps(cfg)) if on_phone else node_paths(cfg, self.folder)

        tg = json.loads((self.folder / spec["nodes"]["textGenerator"]).read_text())
        d = (json.loads(json.dumps(tg["text-generator"])) if on_phone
             else absolute_paths({"dialog": tg["text-generator"]}, self.folder)["dialog"])
        d["context"]["bos-token"] = -1  # the host's rows carry the BOS
        if ignore_eos:  # as GenieModel: a -1 pad would reach the graph's gather
            d["context"].setdefault("pad-token", self.eos[0] if self.eos else 0)
            d["context"]["eos-token"] = never_eos(tg["text-generator"], self.folder, self.n_vocab)
        d["sampler"] = sampler_config(temperature, top_k, top_p, seed)
        d["max-num-tokens"] = max_new
        if self.prefill_mode == "decode":  # as the dialog's: the AR-1 contexts alone
            keep_ar1(d, self.folder)
        if not on_phone:
            d["engine"]["backend"]["QnnHtp"]["poll"] = False  # the x86 simulator needs the core
            if self.dump_tensors is not None:
                d["debug"] = {"path": str(self.dump_tensors), "dump-tensors": True}
        text = spec["text"]
        configs = {"textGenerator": {"text-generator": d},
                   text["node"]: paths(json.loads(
                       (self.folder / spec["nodes"][text["node"]]).read_text()))}
        for seg in segments:
            if seg[0] == "text":
                continue
            media = spec["media"][seg[0]]
            cfg = paths(json.loads((self.folder / spec["nodes"][media["node"]]).read_text()))
            model = next(iter(cfg.values()))["engine"]["model"]
            if "vision-param" in model and "image_position_ids" in seg[2]:
                h, w = patch_grid(seg[2]["image_position_ids"])
                model["vision-param"].update(height=h, width=w)
            prev = configs.get(media["node"])
            if prev is not None and prev != cfg:
                raise RequestError("--backend genie: images of different grids in one prompt "
                                   "need one node each; give one image per request")
            configs[media["node"]] = cfg
        return configs

    def _pipelines_for(self, segments, max_new: int, temperature, top_k, top_p, seed,
                       ignore_eos: bool) -> dict[str, Pipeline]:
        """The nodes for this request (``request_configs``), in pipelines: "textGenerator"'s
        holds the generator and the encoders connected to it, each host-routed encoder has its
        own (keyed by its node)."""
        spec = self.pipeline_spec
        configs = self.request_configs(segments, max_new, temperature, top_k, top_p, seed,
                                       ignore_eos)
        key = json.dumps(configs, sort_keys=True)
        if self._made is not None and self._made[0] == key:
            for pipe in self._made[1].values():
                pipe.reset()
            return self._made[1]
        self.close()
        log = genie.GenieLog(self.log_level)
        nodes: dict[str, Node] = {}
        pipes: dict[str, Pipeline] = {}
        try:
            for name, cfg in configs.items():
                nodes[name] = Node(cfg, log)
            # a node is bound to one pipeline: the host-routed encoders get one each
            by_node = {m["node"]: m for m in spec["media"].values()}
            side = {n for n in nodes if n in by_node and by_node[n]["rows"] == "host"}
            main = {n: node for n, node in nodes.items() if n not in side}
            conns = [c for c in spec["connections"] if c[0] in main and c[2] in main]
            pipes["textGenerator"] = Pipeline(main, conns, log)
            for n in side:
                pipes[n] = Pipeline({n: nodes[n]}, [], log,
                                    embeddings_from=(n, by_node[n]["output"]))
        except genie.GenieError:
            for pipe in pipes.values():
                pipe.close()
            for node in nodes.values():
                node.close()
            log.close()
            raise
        self._made = (key, pipes, log)
        return pipes

    def prepare(self, prompt: str | list[int], o: GenerationOptions):
        """-> (the request, the prompt's ids with each placeholder expanded, its segments in
        order: ("text", text) | (modality, spec, feeds, rows)), every item decoded and checked."""
        r = self.request(prompt, o, media=MEDIA_OPTIONS)
        ids, segments = self._segments(r.ids, o.images, o.audios)
        check_request(ids, r.max_new, self.n_vocab, self.context)
        check_prompt_fits(len(ids), self.config)
        return r, ids, segments

    def iterate(self, prompt: str | list[int], o: GenerationOptions | None = None
                ) -> Iterator[Piece | Done]:
        """As ``GenieModel.iterate``; a request with images / audio runs the pipeline."""
        o = o or GenerationOptions()
        if not o.images and not o.audios:
            yield from super().iterate(prompt, o)
            return
        t0 = time.perf_counter()
        r, ids, segments = self.prepare(prompt, o)
        max_new, ignore_eos = r.max_new, r.ignore_eos
        pipes = self._pipelines_for(segments, max_new, r.temperature, r.top_k, r.top_p, r.seed,
                                    ignore_eos)
        pipe = pipes["textGenerator"]
        generator = pipe.nodes["textGenerator"]
        spec = self.pipeline_spec
        for seg in segments:  # Genie appends each node's rows to the prompt as they come
            if seg[0] == "text":
                pipe.nodes[spec["text"]["node"]].set_text(spec["text"]["input"], seg[1])
                continue
            modality, _, feeds, n = seg
            media = spec["media"][modality]
            node_pipe = pipes.get(media["node"], pipe)
            node_pipe.rows.clear()
            for io, value in media_feeds(media, feeds):
                node_pipe.nodes[media["node"]].set_data(io, value)
            if media["rows"] == "host":  # the node's first n rows, where the prompt has them
                node_pipe.execute()
                if not node_pipe.rows or node_pipe.rows[-1].shape[0] < n:
                    raise genie.GenieError(f"{media['node']}: its embeddings (< {n} rows)", -1,
                                           self.log_tail())
                generator.set_data(spec["rows_input"],
                                   lut_rows(node_pipe.rows[-1][:n], self.config,
                                            self.pipeline_spec["text"]))
        yield from self.pieces(pipeline_tokens(pipe, max_new), r, len(ids), t0,
                               "genie-pipeline", lambda: True)

    def log_tail(self) -> list[str]:
        return self._made[2].tail() if self._made is not None else []

    def close(self) -> None:
        if self._made is not None:
            _, pipes, log = self._made
            for pipe in pipes.values():
                pipe.close()
            for pipe in pipes.values():
                for node in pipe.nodes.values():
                    node.close()
            log.close()
            self._made = None
        super().close()


def pipeline_tokens(pipe: Pipeline, max_new: int) -> Iterator[int]:
    """The text-generator's tokens (at most ``max_new``) as its callback hands them over: the
    pipeline runs on a thread. Closed early (an EOS), the pipeline runs out before the pipe may
    be used again (no ABORT here); an error on its thread is raised here, on the caller's."""
    tokens: queue.Queue = queue.Queue()
    done = object()
    pipe.on_token = tokens.put
    error: list[BaseException] = []

    def run():
        try:
            pipe.execute()
        except BaseException as e:  # raised again on the caller's thread
            error.append(e)
        finally:
            tokens.put(done)

    worker = threading.Thread(target=run, name="genie-pipeline", daemon=True)
    worker.start()
    n, t = 0, None
    try:
        while (t := tokens.get()) is not done:
            if n < max_new:
                n += 1
                yield t
    finally:
        while t is not done:  # closed at a token: the rest are drained
            t = tokens.get()
        worker.join()
        if error:
            raise error[0]


def lut_rows(rows: np.ndarray, config: dict, text: dict | None = None) -> np.ndarray:
    """Rows the host hands the text-generator, in the 16-bit codes Genie feeds its graphs: a
    16-bit LUT's own encoding (a float32 row set on a uint16 LUT read as garbage: a tiny
    Gemma-4's audio answer differed from the first token); with an 8-bit LUT, a scale a row,
    the graph input's (``text``: genie_pipeline.json's, ``rows_encoding``; measured on tiny
    Gemma-4: float32 rows gave other tokens from the 4th, these qnn-sim's). A node's
    connection converts its rows itself."""
    emb = config["dialog"].get("embedding", {})
    if emb.get("datatype") == "ufixed8":  # a LUT past 4 GiB at 16 bits, a scale a row
        enc = (text or {}).get("rows_encoding")
        if enc is None:
            raise RequestError("this Genie folder's 8-bit embedding LUT comes without the "
                               "encoding rows from the host must be in (built before hexforge "
                               "wrote it): rebuild it, or use --backend qnn-sim")
        return LutEncoding(float(enc[0]), int(enc[1])).quantize(rows)
    if emb.get("datatype") != "ufixed16":
        return rows
    return LutEncoding.of_quant_param(emb["quant-param"]).quantize(rows)


def media_feeds(media: dict, feeds: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(node IO, float32 array) per input of a media node (genie_pipeline.json's ``media``
    entry), each checked inside its fixed-point range: what GenieNode_setData is given."""
    return [(io, _in_range(feeds[key], media["fixed_point"].get(key), key))
            for key, io in media["inputs"].items()]


def _in_range(value: np.ndarray, bounds: list[float] | None, name: str) -> np.ndarray:
    """float32 for Genie, refused past the node input's fixed-point range (Genie would clip it
    without a word: a louder-than-full-scale float WAV's log-mel)."""
    x = np.asarray(value, np.float32)
    if bounds is not None and x.size and (x.min() < bounds[0] or x.max() > bounds[1]):
        raise RequestError(f"{name} spans [{x.min():.4g}, {x.max():.4g}], past the [{bounds[0]:.4g},"
                           f" {bounds[1]:.4g}] this Genie node's input holds (audio louder than "
                           "full scale?)")
    return x


def open_genie(bundle: str | Path, arch: str | None = None, log_level: str = "warn",
               prefill_mode: str = "chunked", dialog: str = "basic"):
    """The Genie model of a bundle: with its pipeline when the Genie folder has one."""
    from .model import find_folder

    folder = find_folder(Path(bundle), arch if arch is None or arch.startswith("v")
                         else f"v{arch}")
    if (folder / PIPELINE).is_file():
        if dialog != "basic":
            raise RequestError(f"--dialog {dialog}: a Genie pipeline (media) runs its "
                               "text-generator's basic dialog only")
        return GeniePipelineModel(bundle, arch, log_level, prefill_mode=prefill_mode)
    return GenieModel(bundle, arch, log_level, prefill_mode=prefill_mode, dialog=dialog)
