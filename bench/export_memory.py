"""What one graph's export adds to the build process at its peak, against --context: the
measurement behind ``forge/heap.py``'s export_need_bytes and ``forge/budget.py``'s estimate.

    python bench/export_memory.py CKPT --role prefill --context 8192 [--htp] [--json out.json]

Loads CKPT (a checkpoint dir, or a .gguf) as a build does, makes the whole decoder's cpu step
module (``--htp``: the static HTP shard) for one role at that context, and exports it in this
process while a thread samples the anonymous memory (RssAnon, every 50 ms): the peak over the
level before the export is what one export child adds. Also prints the module's weights and the
bytes of its example inputs (the caches at that context), which the estimate is written in.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--role", choices=("prefill", "decode", "verify"), default="prefill")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--htp", action="store_true", help="the HTP target's static shard instead")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch

    from hexforge.families import load_family
    from hexforge.forge.export.onnxexport import export_module
    from hexforge.forge.source.checkpoint import read_checkpoint

    ck = read_checkpoint(a.checkpoint)
    fam = load_family(ck.model_type).FAMILY
    args = fam.Args.from_config(ck.config)
    hf = fam.load_hf(ck.dir)
    rows = {"prefill": 64, "decode": 1, "verify": 8}[a.role]
    layers = (0, args.num_hidden_layers)
    make = fam.decoder_module if a.htp else fam.cpu_step_module
    with fam.float32(hf, layers=layers, head=False, towers=False):
        module = make(hf, args, layers, rows, a.context)
        with torch.device("meta"):  # sized, not allocated
            inputs = sum(t.numel() * t.element_size() for t in module.example_inputs())
        weights = sum(p.numel() for p in module.parameters())
        peak = [0]

        def sample() -> None:
            while True:
                peak[0] = max(peak[0], rss_anon())
                time.sleep(0.05)

        threading.Thread(target=sample, daemon=True).start()
        time.sleep(0.2)
        before = rss_anon()
        with tempfile.TemporaryDirectory() as tmp:
            export_module(module, Path(tmp) / "g.onnx", "torchscript", fold=True)
        time.sleep(0.2)
    out = {"checkpoint": a.checkpoint, "role": a.role, "context": a.context, "htp": a.htp,
           "weights": weights, "inputs_gb": round(inputs / 1e9, 3),
           "process_gb": round(before / 1e9, 3), "export_adds_gb": round((peak[0] - before) / 1e9, 3)}
    print(json.dumps(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
