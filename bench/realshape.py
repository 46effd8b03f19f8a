"""Real-shape random-weight checkpoints (speed does not depend on the weights' values).

    python bench/realshape.py SHAPE OUT_DIR
        [--dtype bfloat16|float32] [--layers N]

Shapes are the published configs' numbers (hidden, layers, heads, head_dim, intermediate, vocab,
tying). The model is made on the meta device and written one module at a time (``write_random``:
what save_pretrained would write, never the whole model in memory — Gemma-4-E4B is 15.9 GB in
bf16). Tokenizer: hexforge's tiny byte-level BPE (the benchmarks feed token ids; only the vocab
size of the *model* matters for speed).

``qwen3.5-0.8b-vl`` is the layout Qwen/Qwen3.5-0.8B ships (Qwen3_5ForConditionalGeneration: the
same text model under ``model.language_model`` plus its vision tower); onnxruntime-genai's builder
takes only that layout, so bench/compare.py's Qwen3.5 side-by-side uses it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SHAPES: dict[str, dict] = {
    # Qwen/Qwen3-0.6B config.json
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    # google/gemma-4-E2B text_config (the text decoder of the multimodal checkpoint): 35 layers
    # (4 sliding : 1 full), the last 20 KV-shared with double-wide MLPs, per-layer embeddings
    # 262144 x 35*256 (2.35B of the ~4.6B text parameters), tied head, logit softcap 30
    "gemma-4-e2b": dict(
        model_type="gemma4_text", hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
        sliding_window=512, num_kv_shared_layers=20, use_double_wide_mlp=True,
        hidden_size_per_layer_input=256, vocab_size=262144, vocab_size_per_layer_input=262144,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        max_position_embeddings=131072, tie_word_embeddings=True, attention_k_eq_v=False,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                rope_theta=1000000.0)),
    ),
    # Qwen/Qwen3.5-0.8B text_config (the text decoder of the multimodal checkpoint)
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, vocab_size=248320,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        attn_output_gate=True, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=262144,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_interleaved=True, mrope_section=[11, 11, 10]),
    ),
    # the seed bundles' models at real size (docs/notes/realsize.md). Values from the
    # published configs as copied in public code and cross-checked against the checkpoints'
    # safetensors sizes (Qwen3-VL-2B: 2.128B params = 4.26 GB bf16; Qwen3.5-4B: 4.54B) and, for
    # Gemma-4-E4B, transformers' convert_gemma4_weights.py (_VARIANTS["gemma-4-e4b"])
    # Qwen/Qwen3-VL-2B-Instruct text_config (transformers has no causal-LM class for
    # qwen3_vl_text alone: the checkpoint is always the composite, qwen3-vl-2b-vl)
    "qwen3-vl-2b-text": dict(
        model_type="qwen3_vl_text", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_interleaved=True,
                             mrope_section=[24, 20, 20]),
    ),
    # Qwen3-VL-2B's text decoder as a qwen3 text model: the same widths and, on text (t = h = w
    # in its M-RoPE), the same graphs -- what Genie forms of the dense families alone take
    # (--genie-kv lade) are built for at its size
    "qwen3-vl-2b-as-qwen3": dict(
        model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=5000000.0,
        tie_word_embeddings=True,
    ),
    # Qwen/Qwen3.5-4B text_config: 32 layers = 8 x (3 Gated DeltaNet + 1 gated full attention)
    "qwen3.5-4b": dict(
        model_type="qwen3_5_text", hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        attn_output_gate=True, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=262144,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_interleaved=True, mrope_section=[11, 11, 10]),
    ),
    # google/gemma-4-E4B text_config: 42 layers (5 sliding : 1 full), the last 18 KV-shared,
    # single-width MLPs (E2B's are double-wide), per-layer embeddings 262144 x 42*256
    "gemma-4-e4b": dict(
        model_type="gemma4_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
        sliding_window=512, num_kv_shared_layers=18, use_double_wide_mlp=False,
        hidden_size_per_layer_input=256, vocab_size=262144, vocab_size_per_layer_input=262144,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        max_position_embeddings=131072, tie_word_embeddings=True, attention_k_eq_v=False,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                rope_theta=1000000.0)),
    ),
}
SHAPES["qwen3.5-0.8b-vl"] = SHAPES["qwen3.5-0.8b"]
# shape -> (the composite's model_type, its tower sub-configs)
TOWERS: dict[str, tuple[str, dict]] = {
    # Qwen/Qwen3.5-0.8B vision_config
    "qwen3.5-0.8b-vl": ("qwen3_5", dict(vision_config=dict(
        depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304))),
    # Qwen/Qwen3-VL-2B-Instruct vision_config (deepstack mergers after blocks 5, 11, 17)
    "qwen3-vl-2b-vl": ("qwen3_vl", dict(vision_config=dict(
        depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
        deepstack_visual_indexes=[5, 11, 17]))),
    # Qwen/Qwen3.5-4B vision_config
    "qwen3.5-4b-vl": ("qwen3_5", dict(vision_config=dict(
        depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304))),
    # google/gemma-4-E4B: transformers' convert_gemma4_weights.py _VARIANTS["gemma-4-e4b"] (the
    # on-device vision config E2B shares: 16 layers, pooled 3x3 to at most 280 soft tokens from
    # 2,520 patches; the default 12-layer audio conformer). 7.94 B parameters in all.
    "gemma-4-e4b-mm": ("gemma4", dict(
        vision_config=dict(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
            num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
            position_embedding_size=10240, use_clipped_linears=True),
        audio_config=dict(
            hidden_size=1024, num_hidden_layers=12, num_attention_heads=8,
            subsampling_conv_channels=[128, 32], conv_kernel_size=5, attention_chunk_size=12,
            attention_context_left=13, attention_context_right=0, output_proj_dims=1536),
        vision_soft_tokens_per_image=280)),
}
SHAPES["qwen3-vl-2b-vl"] = SHAPES.pop("qwen3-vl-2b-text")
SHAPES["qwen3.5-4b-vl"] = SHAPES["qwen3.5-4b"]
SHAPES["gemma-4-e4b-mm"] = SHAPES["gemma-4-e4b"]
# the image processor E4B ships (processor_config.json): 16 px patches, <= 280 soft tokens
GEMMA4_IMAGE = dict(patch_size=16, max_soft_tokens=280, pooling_kernel_size=3)


def _cut(cfg: dict, layers: int) -> dict:
    """Config fields of the first ``layers`` layers: per-layer lists truncated, and KV sharing
    (Gemma-4) scaled to the cut but leaving every attention type a donor among the layers that
    keep their own cache (transformers refuses per-layer entries past the last layer)."""
    out = {"num_hidden_layers": layers}
    types = cfg.get("layer_types")
    if types:
        out["layer_types"] = types = list(types[:layers])
    shared = cfg.get("num_kv_shared_layers")
    if shared:
        need = max(types.index(t) for t in set(types)) + 1  # every type's first layer kept
        scaled = round(shared * layers / cfg["num_hidden_layers"])
        out["num_kv_shared_layers"] = max(0, min(scaled, layers - need))
    return out


def make_checkpoint(shape: str, out: str | Path, dtype: str = "bfloat16", seed: int = 0,
                    layers: int | None = None) -> Path:
    """layers: keep only the first ``layers`` decoder layers (a real-width cut: the HTP simulator
    runs a full-depth model at about a minute per decode step)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        GenerationConfig,
    )

    from hexforge.forge.source.tiny import (
        MM_TOKENS,
        QWEN_SPECIAL_IDS,
        condition_gemma4_vision_tower,
        make_tokenizer,
        save_gemma4_processor_config,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(SHAPES[shape])
    model_type = cfg.pop("model_type")
    gemma = model_type.startswith("gemma")
    # Gemma-4's composite names its media tokens by id: the tiny tokenizer gets them as specials;
    # Qwen3-VL's config names Qwen's (<|vision_start|> 151652 ...): its tokenizer holds them at
    # those ids, so a prompt's media markers decode and tokenize back (Genie tokenizes the text
    # around an image again; without them the markers decoded to '' and were refused)
    qwen_vl = shape in TOWERS and TOWERS[shape][0] == "qwen3_vl"
    tok = make_tokenizer(out, add_bos=False,
                         extra_specials=list(MM_TOKENS.values()) if shape in TOWERS and gemma else [],
                         special_ids=QWEN_SPECIAL_IDS if qwen_vl else None)
    if layers:
        cfg.update(_cut(cfg, layers))
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    if qwen_vl:  # as Qwen3-VL's config: bos = pad = <|endoftext|>
        ids["bos_token_id"] = QWEN_SPECIAL_IDS["<|endoftext|>"]
    auto = AutoModelForCausalLM
    if shape in TOWERS:
        model_type, towers = TOWERS[shape]
        media = {}
        if gemma:
            media = {k: tok.convert_tokens_to_ids(t) for k, t in MM_TOKENS.items()}
            media["eoa_token_index"] = media["eoa_token_id"]
        config = AutoConfig.for_model(model_type, text_config={**cfg, **ids}, **towers, **media,
                                      tie_word_embeddings=cfg["tie_word_embeddings"], **ids)
        auto = AutoModelForImageTextToText
    else:
        config = AutoConfig.for_model(model_type, **ids, **cfg)
    t = time.perf_counter()
    # norms perturbed; Gemma-4 conditioned as a trained model is (else it is chaotic at depth)
    units = {"model.vision_tower": condition_gemma4_vision_tower} if gemma and shape in TOWERS else {}
    n = write_random(config, auto, out, dtype, model_type.removesuffix("_text"), units, seed=seed)
    if gemma and shape in TOWERS:
        save_gemma4_processor_config(out, **GEMMA4_IMAGE)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(str(out))
    (out / "hexforge_realshape.json").write_text(json.dumps(
        {"shape": shape, "dtype": dtype, "layers": config.get_text_config().num_hidden_layers,
         "params": n, "conditioned": True, "make_s": time.perf_counter() - t}))
    return out


def write_random(config, auto, out: Path, dtype: str, base: str, unit_conditions: dict,
                 seed: int = 0, unit_bytes: float = 1e9, file_bytes: float = 2e9) -> int:
    """Write ``auto.from_config(config)``'s random weights as save_pretrained would (sharded
    safetensors + index, tied weights once, config.json) without ever holding the model: it is
    made on the meta device and materialized one unit at a time — the largest module under
    ``unit_bytes``, a module named in ``unit_conditions``, or a single tensor-holding module —
    initialized by its own PreTrainedModel's ``_init_weights``, conditioned
    (hexforge.forge.source.tiny.condition_params / condition_buffers, and ``unit_conditions[name](module)``
    for named units), queued for the current file in the dtype it was made in, and sent back to
    meta. Gemma-4-E4B's 7.9B parameters (15.9 GB bf16) peak at its largest tensor,
    the 5.6 GB per-layer embedding table. -> the parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import PreTrainedModel

    from hexforge.forge.source.tiny import condition_buffers, condition_params

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = auto.from_config(config, dtype=getattr(torch, dtype))
    saved = set(model.state_dict())  # persistent buffers and parameters ...
    kept = {n for n, _ in model.named_parameters()}  # ... each tied parameter under its first name
    kept |= {n for n, _ in model.named_buffers() if n in saved}
    owner: dict[str, PreTrainedModel] = {}  # module name -> the sub-model whose _init_weights runs
    for name, m in model.named_modules():
        parent = owner.get(name.rpartition(".")[0], model) if name else model
        owner[name] = m if isinstance(m, PreTrainedModel) else parent

    def nbytes(m) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    def units(name: str, m):  # -> (name, module, recurse)
        if nbytes(m) <= unit_bytes or name in unit_conditions or not list(m.children()):
            yield name, m, True
            return
        if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
            yield name, m, False
        for child, c in m.named_children():
            yield from units(f"{name}.{child}" if name else child, c)

    queued: dict[str, torch.Tensor] = {}
    pending = 0
    shards: list[str] = []
    weight_map: dict[str, str] = {}
    total = params = 0

    def flush() -> None:
        nonlocal queued, pending
        if queued:
            fname = f"part-{len(shards):05d}.safetensors"
            save_file(queued, str(out / fname), metadata={"format": "pt"})
            shards.append(fname)
            weight_map.update(dict.fromkeys(queued, fname))
            queued, pending = {}, 0

    with torch.no_grad():
        for name, m, recurse in units("", model):
            mods = list(m.named_modules(prefix=name)) if recurse else [(name, m)]
            m.to_empty(device="cpu", recurse=recurse)
            for mname, sub in reversed(mods):  # children first, as initialize_weights does
                owner[mname]._init_weights(sub)
            own = dict(m.named_parameters(prefix=name, recurse=recurse))
            condition_params(own.items(), base)
            if name in unit_conditions:
                unit_conditions[name](m)
            bufs = dict(m.named_buffers(prefix=name, recurse=recurse))
            condition_buffers(bufs.items())
            for key, tensor in {**own, **bufs}.items():
                if key not in kept:
                    continue
                queued[key] = tensor.detach().contiguous()  # as made (save_pretrained's dtype)
                size = tensor.numel() * tensor.element_size()
                pending, total = pending + size, total + size
                params += tensor.numel() if key in own else 0
            del own, bufs
            m.to_empty(device="meta", recurse=recurse)  # the queued tensors keep their storage
            if pending >= file_bytes:
                flush()
    flush()
    missing = kept - set(weight_map)
    if missing:
        raise RuntimeError(f"not written: {sorted(missing)[:5]}")
    if len(shards) == 1:
        (out / shards[0]).rename(out / "model.safetensors")
    else:
        width = len(shards)
        names = {f: f"model-{i + 1:05d}-of-{width:05d}.safetensors" for i, f in enumerate(shards)}
        for f, n in names.items():
            (out / f).rename(out / n)
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total},
             "weight_map": {k: names[f] for k, f in sorted(weight_map.items())}}, indent=2))
    model.config.save_pretrained(str(out))
    return params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers only")
    a = ap.parse_args()
    print(make_checkpoint(a.shape, a.out, a.dtype, layers=a.layers))


if __name__ == "__main__":
    main()
