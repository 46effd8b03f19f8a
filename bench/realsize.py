"""The seeds' models at real size, from nothing: published config -> random-weight bf16
checkpoint -> bundle, with each build stage's wall time and peak memory.

    python bench/realsize.py qwen3-vl-2b WORK [--quant w8-fp16] [--json FILE] [--layers N]

Random weights change nothing about size, memory or compile time (the accuracy of a real-size
build is the real models' business: docs/quality.md). Each model builds for the targets and
the encoder resolution the bundles this project replaces were built with:

    qwen3-vl-2b       v79,v81  Qwen3-VL-2B-Instruct with its 24-block ViT at 512x512 (256 tokens)
    qwen3.5-4b        v81      Qwen3.5-4B with its vision tower
    qwen3.5-4b-text   v81      its decoder alone (what a Genie bundle of it holds)
    gemma-4-e4b       v81      Gemma-4-E4B with its vision tower (2,520 patches -> 280 tokens)
                               and its 12-layer audio conformer
    gemma-4-e4b-text  v81      its 42-layer decoder alone: the towers' graphs do not depend on
                               the depth, and their check is an hour of the ~3 h here
    gemma-4-e2b       v81      Gemma-4-E2B's 35-layer decoder (KV sharing, PLE, two head dims)
    qwen3-vl-2b-as-qwen3  v81  Qwen3-VL-2B's decoder as a qwen3 text model (its graphs on text;
                               the Genie forms only the dense families take: --genie-kv lade)

``--genie`` adds the Genie bundle (genie-v81/: the decoder in Genie's contract, docs/genie.md).

The checkpoint is made once under WORK/<model> (minutes; skipped if present); the bundle is
WORK/<model>-<quant>. Prints the stage table (bench/build_profile.py) and writes it as JSON.

``--layers N`` is the pre-flight: the same build of the first N decoder layers at real width
(checkpoint WORK/<model>-L<N>, bundle WORK/<model>-L<N>-<quant>). Real-size failures (a graph
over the 2 GB protobuf limit, a compiler's memory, two threads racing) show there in minutes
instead of after an hour of the full build; the tiny fixtures cannot show them.
Results: docs/notes/realsize.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from build_profile import profile_build, status_kb
from realshape import make_checkpoint

MODELS: dict[str, dict] = {
    "qwen3-vl-2b": dict(shape="qwen3-vl-2b-vl", targets="v79,v81", image_size=(512, 512)),
    "qwen3.5-4b": dict(shape="qwen3.5-4b-vl", targets="v81", image_size=(512, 512)),
    "qwen3.5-4b-text": dict(shape="qwen3.5-4b", targets="v81"),  # the decoder (Genie: text)
    "gemma-4-e4b": dict(shape="gemma-4-e4b-mm", targets="v81"),
    "gemma-4-e4b-text": dict(shape="gemma-4-e4b", targets="v81"),
    "gemma-4-e2b": dict(shape="gemma-4-e2b", targets="v81"),
    "qwen3-vl-2b-as-qwen3": dict(shape="qwen3-vl-2b-as-qwen3", targets="v81"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("work")
    ap.add_argument("--quant", default="w8-fp16", choices=("w8-fp16", "w4-fp16", "fp16", "w8a16", "w4a16"))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill-len", type=int, default=64)
    ap.add_argument("--share-weights", action="store_true")
    ap.add_argument("--device-only", action="store_true", help="no cpu target (hexforge build's)")
    ap.add_argument("--genie", action="store_true", help="also the Genie bundle (build --genie)")
    ap.add_argument("--genie-host-rows", action="store_true",
                    help="build --genie-host-rows: the host in Genie's 8-bit LUT rows (E2B, E4B)")
    ap.add_argument("--genie-kv", default="concat", choices=("concat", "scatter", "lade"))
    ap.add_argument("--keep-work", action="store_true",
                    help="keep _work/ (the graphs' ONNX: bench/genie_lade.py --hextimate reads "
                         "the Genie ones)")
    ap.add_argument("--estimate", action="store_true", help="hexforge build --estimate")
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=None, help="build a cut of the first N layers")
    ap.add_argument("--targets", default=None, help="instead of the model's own (e.g. v81)")
    a = ap.parse_args()

    from hexforge.forge.pipeline import BuildOptions

    spec = MODELS[a.model]
    work = Path(a.work)
    name = f"{a.model}-L{a.layers}" if a.layers else a.model
    ckpt = work / name
    made = None
    if not (ckpt / "config.json").is_file():
        t = time.perf_counter()
        make_checkpoint(spec["shape"], ckpt, layers=a.layers)
        made = {"wall_s": round(time.perf_counter() - t, 1),
                "peak_rss_gb": round(status_kb("VmHWM") / 2**20, 2)}
        print(f"checkpoint {ckpt}: {made}", file=sys.stderr)
    opts = BuildOptions(targets=a.targets or spec["targets"],
                        quant=a.quant, context=a.context, prefill_len=a.prefill_len,
                        verify=False, share_weights=a.share_weights, device_only=a.device_only,
                        genie=a.genie, genie_host_rows=a.genie_host_rows,
                        genie_kv=a.genie_kv, keep_work=a.keep_work, estimate=a.estimate,
                        image_size=spec.get("image_size"))
    out = profile_build(str(ckpt), str(work / f"{name}-{a.quant}"), opts)
    out["model"], out["checkpoint_made"] = name, made
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
