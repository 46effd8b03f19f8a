"""The int8 weight format's block size on real trained models: HF itself with its decoder Linear
weights rounded to nearest int8 in blocks of 32 / 64 / 128 input columns, or per output channel,
judged against HF fp32 on the held-out text (KL mean / p99, top-1): the floor a weight-only int8
bundle of that format reaches, and the bits a weight it costs (fp16 scales).

    python bench/experiments/int8_blocks.py [--work W]

Results and the choice they made: docs/htp.md ("int8's block").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="int8-blocks-work", help="where Gemma-3's GGUF is assembled")
    a = ap.parse_args()

    from quality_table import references

    from hexforge.forge.oracle.quality import fake_quant_floor

    print("| model | int8 block | bits a weight | KL mean | KL p99 | top-1 |\n|---|---|---|---|---|---|")
    for name, m in references(Path(a.work), 256):
        for block in (32, 64, 128, None):
            r = fake_quant_floor(m.hf, 8, block, m.ids, m.ref, m.fam.reference_layers(m.hf))
            bits = 8 + 16 / block if block else 8.0
            print(f"| {name} | {block or 'per channel'} | {bits:.3g} | {r['kl_mean']:.3g} | "
                  f"{r['kl_p99']:.3g} | {r['top1']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
