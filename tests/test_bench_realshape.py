"""bench/realshape.py writes a real-size random checkpoint one module at a time (Gemma-4-E4B is
15.9 GB in bf16): what it writes must be what save_pretrained writes of the whole model."""

from __future__ import annotations

import json
from pathlib import Path


def read(folder: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_regression_the_real_size_checkpoint_held_the_whole_model_in_memory(tmp_path,
                                                                          bench_script):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from hexforge.forge.source.tiny import (
        LAYER_SCALAR_RANGE,
        condition_gemma4_vision_tower,
        make_tiny_checkpoint,
    )

    rs = bench_script("realshape")
    ref = make_tiny_checkpoint("gemma4_mm", tmp_path / "ref")
    config = AutoConfig.from_pretrained(ref)
    out = tmp_path / "stream"
    out.mkdir()
    # units of at most 64 KB and files of 256 KB: every module its own unit, several files
    n = rs.write_random(config, AutoModelForImageTextToText, out, "float32", "gemma4",
                        {"model.vision_tower": condition_gemma4_vision_tower},
                        unit_bytes=64e3, file_bytes=256e3)
    a, b = read(out), read(ref)
    assert set(a) == set(b)  # tied head once, persistent buffers in, non-persistent out
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and set(index["weight_map"]) == set(a)
    model, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert n == sum(p.numel() for p in model.parameters())
    # conditioned as make_tiny_checkpoint conditions: norms perturbed off 1, the vision position
    # table random (not ones), layer scalars in their range
    norm = a["model.language_model.layers.0.input_layernorm.weight"]
    assert 0.02 < float((norm - norm.mean()).std()) < 0.3
    table = a["model.vision_tower.patch_embedder.position_embedding_table"]
    assert 0.8 < float(table.std()) < 1.2
    lo, hi = LAYER_SCALAR_RANGE
    scalars = [float(v) for k, v in a.items() if k.endswith("layer_scalar")]
    assert scalars and all(lo <= s <= hi for s in scalars) and len(set(scalars)) > 1
    logits = model(input_ids=torch.tensor([[1, 5, 9]])).logits
    assert torch.isfinite(logits).all()
