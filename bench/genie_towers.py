"""The seeds' media towers at their real shape as Genie nodes on x86, against the same tower
under ``--backend qnn-sim`` (issue 61): do libGenie's node rows equal hexforge's own HTP path?

    python bench/genie_towers.py gemma-4-e4b WORK [--image X.png] [--audio X.wav] [--json FILE]
    python bench/genie_towers.py qwen3-vl-2b WORK [--image X.png]

The bundle is bench/realsize.py's cut of the model's first decoder layer(s) with its towers whole
(random weights conditioned like a trained model's: the towers' graphs do not depend on the
decoder's depth), fp16, v81, ``--device-only --genie`` — made under WORK unless it is there:

    python bench/realsize.py MODEL WORK --layers N --quant fp16 --device-only --genie --targets v81
    (N: 1; Qwen3-VL 3, the layers its deepstack features enter)

Per item: the host preprocessing once (runtime/vision.py, runtime/audio.py: what every backend
feeds its towers), then (a) the bundle's tower graph on the HTP simulator through onnxruntime's
QNN EP, the rows ``--backend qnn-sim`` splices into a prompt, and (b) the Genie node binary
through libGenie (a GeniePipeline of that node alone, its rows handed over by Genie's embedding
callback, as the audio node's are in a prompt). Both are fp16 graphs of the same tower compiled
apart; the node's inputs arrive through Genie's uint16 quantization (docs/genie-pipelines.md),
so the rows differ by rounding, not by a contract. The gate is the HTP tower gate: cosine >=
0.999 on every soft-token row. A Genie row is a full LUT row (Gemma-4: the soft token, then the
pad token's per-layer inputs), so its first H columns are compared. Results: docs/genie-pipelines.md.

Without ``--image`` / ``--audio`` the script makes a photo-like PNG (768 x 576: gradients, discs
and edges, 2,520 patches at Gemma-4's budget) and a 3.5 s 16-bit WAV at 44.1 kHz (a vowel-like
harmonic stack under a pitch glide).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# model -> (its towers, the decoder layers of the cut: Qwen3-VL's decoder takes its 3 deepstack
# features in its first 3 layers)
MODELS = {"gemma-4-e4b": (("image", "audio"), 1), "qwen3-vl-2b": (("image",), 3)}
GATE_COS = 0.999


def make_media(folder: Path) -> tuple[Path, Path]:
    """A photo-like PNG and a speech-like 44.1 kHz 16-bit WAV (see the module doc)."""
    import soundfile as sf
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    h, w = 576, 768
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([120 + 100 * np.sin(x / 90), 90 + 80 * np.cos(y / 70),
                    60 + 50 * np.sin((x + y) / 130)], -1)
    pic = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(pic)
    for i, (cx, cy, r) in enumerate(((200, 180, 90), (520, 300, 140), (640, 120, 60))):
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(240 - 60 * i, 40 + 70 * i, 90))
    d.rectangle((60, 420, 700, 470), fill=(20, 20, 20))
    image = folder / "photo.png"
    pic.save(image)
    rate = 44100
    t = np.arange(int(rate * 3.5)) / rate
    f0 = 140 + 60 * np.sin(2 * np.pi * 0.4 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 12)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    audio = folder / "speech.wav"
    sf.write(audio, (0.25 * voice / np.abs(voice).max()).astype(np.float32), rate,
             subtype="PCM_16")
    return image, audio


def bundle_of(model: str, work: Path) -> Path:
    """bench/realsize.py's one-layer fp16 Genie bundle of ``model`` under ``work`` (made here
    if it is not there)."""
    layers = MODELS[model][1]
    bundle = work / f"{model}-L{layers}-fp16"
    if not (bundle / "manifest.json").is_file():
        subprocess.run([sys.executable, str(Path(__file__).parent / "realsize.py"), model,
                        str(work), "--layers", str(layers), "--quant", "fp16", "--device-only",
                        "--genie", "--targets", "v81"],
                       check=True)
    return bundle


def preprocess(bundle: Path, modality: str, item: str) -> tuple[object, dict, int]:
    """(the tower's EncoderSpec, its graph inputs, its soft-token count) for one item, by the
    host preprocessing every backend feeds the towers with."""
    from hexforge.bundle.manifest import load_manifest
    from hexforge.runtime.multimodal import decode_media

    manifest = load_manifest(bundle)
    images, audios = ([item], None) if modality == "image" else (None, [item])
    ((spec, prep, decoded),) = decode_media(manifest, images, audios, {}).values()
    feeds, n = prep(decoded[0])
    return spec, feeds, n


def qnn_sim_rows(bundle: Path, spec, feeds: dict, n: int) -> np.ndarray:
    """The tower's soft rows [n, H] as ``--backend qnn-sim`` splices them into a prompt (its
    sessions closed after: libGenie's node needs the simulator's HTP room, about 3.3 GB a
    process, docs/genie.md)."""
    import gc

    import hexforge
    from hexforge.runtime.multimodal import encode_items

    model = hexforge.load(bundle, backend="qnn-sim")
    ((soft, _extra),) = encode_items(model.engine, spec, [feeds], [n])
    del model  # its sessions with it
    gc.collect()
    return np.asarray(soft, np.float32)


def genie_rows(bundle: Path, modality: str, feeds: dict) -> np.ndarray:
    """The Genie node's rows [S, LUT width] for the same inputs through libGenie: one node in a
    pipeline of its own, rows from its embedding callback; the image node's vision-param set
    to the image's patch grid as a request does."""
    from hexforge.runtime.genie import libgenie as genie
    from hexforge.runtime.genie.libpipeline import Node, Pipeline
    from hexforge.runtime.genie.pipelinemodel import PIPELINE, media_feeds, node_paths, patch_grid

    folder = bundle / "genie-v81"
    desc = json.loads((folder / PIPELINE).read_text())
    spec = desc["media"][modality]
    cfg = node_paths(json.loads((folder / desc["nodes"][spec["node"]]).read_text()), folder)
    body = next(iter(cfg.values()))["engine"]["model"]
    if "vision-param" in body and "image_position_ids" in feeds:
        h, w = patch_grid(feeds["image_position_ids"])
        body["vision-param"].update(height=h, width=w)
    log = genie.GenieLog("warn")
    node = Node(cfg, log)
    pipe = Pipeline({spec["node"]: node}, [], log, embeddings_from=(spec["node"], spec["output"]))
    try:
        for io, value in media_feeds(spec, feeds):
            node.set_data(io, value)
        pipe.execute()
        if not pipe.rows:
            raise SystemExit(f"{modality}: libGenie gave no rows ({log.tail()[-3:]})")
        return pipe.rows[-1]
    finally:
        pipe.close()
        node.close()
        log.close()


def compare(want: np.ndarray, got: np.ndarray) -> dict:
    from hexforge.forge.oracle.verify import cosine_rows

    got = got[: want.shape[0], : want.shape[1]]
    cos = cosine_rows(got, want)
    return {"rows": int(want.shape[0]), "width": int(want.shape[1]),
            "cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
            "max_abs": float(np.abs(got - want).max()),
            "rel_err": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
            "passed": bool(cos.min() >= GATE_COS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("work")
    ap.add_argument("--bundle", default=None, help="the bundle (default: made under WORK)")
    ap.add_argument("--image", default=None)
    ap.add_argument("--audio", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = Path(a.work)
    image, audio = make_media(work / "media")
    items = {"image": a.image or str(image), "audio": a.audio or str(audio)}
    bundle = Path(a.bundle) if a.bundle else bundle_of(a.model, work)
    out = {"model": a.model, "bundle": str(bundle)}
    for modality in MODELS[a.model][0]:
        spec, feeds, n = preprocess(bundle, modality, items[modality])
        t = time.perf_counter()
        want = qnn_sim_rows(bundle, spec, feeds, n)
        t_sim = time.perf_counter() - t
        t = time.perf_counter()
        got = genie_rows(bundle, modality, feeds)
        r = compare(want, got)
        r |= {"item": items[modality], "genie_rows": list(got.shape), "soft_tokens": n,
              "qnn_sim_s": round(t_sim, 1), "genie_s": round(time.perf_counter() - t, 1)}
        out[modality] = r
        print(f"{a.model} {modality}: {json.dumps(r)}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
