"""Tiny random-weight HF checkpoints made locally (no hub): for tests and ``hexforge demo``.

Real HF code writes them (``from_config`` + ``save_pretrained`` + a byte-level BPE tokenizer trained
on an embedded text), so loading them exercises the real loading path. Build-time only (torch).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

CORPUS = """\
The capital of France is Paris. The quick brown fox jumps over the lazy dog.
Hexagon NPUs run quantized transformer graphs; static shapes keep the compiler happy.
In the beginning was the word, and the word was tokenized into bytes and merges.
A bundle holds graphs, host tensors, a tokenizer and a manifest that ties them together.
東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. Ünïcödé, emoji 🚀🔥 and more.
def main():\n    print("hello, world")\n    return 0\n
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828.
"""

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0,
    ),
    # 10 layers: sliding x4, full, sliding x4, full; the last 4 share KV (donors: 5 sliding, 4 full);
    # window 8 < the test prompts; PLE on; double-wide MLP on the shared layers
    "gemma4": dict(
        model_type="gemma4_text", hidden_size=64, intermediate_size=128, num_hidden_layers=10,
        layer_types=["sliding_attention"] * 4 + ["full_attention"]
        + ["sliding_attention"] * 4 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        hidden_size_per_layer_input=8, num_kv_shared_layers=4, use_double_wide_mlp=True,
        sliding_window=8, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
    # 6 layers: sliding x2, full, sliding x2, full (Gemma-3-270M's 5:1 pattern, shortened); window
    # 8 < the test prompts; the two rope bases of Gemma-3 (1e4 sliding, 1e6 full)
    "gemma3": dict(
        model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        layer_types=["sliding_attention"] * 2 + ["full_attention"]
        + ["sliding_attention"] * 2 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=4096,
        rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=1e4),
                             full_attention=dict(rope_type="default", rope_theta=1e6)),
    ),
    # 8 layers: (linear x3, full) x2; GatedDeltaNet with 2 key / 4 value heads, conv kernel 4;
    # gated full attention with partial rotary (25% of head_dim 32)
    "qwen3_5": dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_interleaved=True, mrope_section=[2, 1, 1]),
    ),
}

# Gemma-4 with vision + audio towers (Gemma4ForConditionalGeneration): the text model above, a
# 2-layer vision tower (patch 4, pooling 3: 70 soft tokens at most = 630 patches) and a 2-layer
# conformer audio tower. Placeholder / boundary tokens are added to the tokenizer as specials.
MM_TOKENS = {"image_token_id": "<|image|>", "audio_token_id": "<|audio|>",
             "boi_token_id": "<start_of_image>", "eoi_token_id": "<end_of_image>",
             "boa_token_id": "<start_of_audio>", "eoa_token_id": "<end_of_audio>"}
TINY_CONFIGS["gemma4_mm"] = dict(
    model_type="gemma4",
    text_config={k: v for k, v in TINY_CONFIGS["gemma4"].items() if k != "model_type"},
    vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
        position_embedding_size=256,
    ),
    audio_config=dict(
        # HF sizes the subsampler's projection as (c0 // 4) * c1, i.e. it assumes c0 = 128 mel bins
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 4],
        conv_kernel_size=5, attention_chunk_size=4, attention_context_left=5,
        attention_context_right=0, output_proj_dims=48,
    ),
)

# Qwen3-VL (Qwen3VLForConditionalGeneration): a 4-layer Qwen3 text model with interleaved M-RoPE
# (sections 6/5/5 of 16 frequencies, theta 1e4 so positions turn the rotary angles visibly), a
# 3-block vision tower (patch 16, merge 2; an 8x8 learned position grid = 128x128 native) with
# deepstack features from blocks 0 and 2 (added after text layers 0 and 1).
QWEN_VL_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                  "vision_start_token_id": "<|vision_start|>",
                  "vision_end_token_id": "<|vision_end|>"}
TINY_CONFIGS["qwen3_vl"] = dict(
    model_type="qwen3_vl", tie_word_embeddings=False,
    text_config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5],
                             mrope_interleaved=True),
    ),
    vision_config=dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
        temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
        num_position_embeddings=64, deepstack_visual_indexes=[0, 2],
    ),
)
# Qwen3.5 as the hub ships it (Qwen3_5ForConditionalGeneration): the 8-layer qwen3_5 text model
# above (rope theta 1e4 so image positions turn its 4 rotary frequencies visibly) and a 2-block
# Qwen3-VL-style vision tower without deepstack.
TINY_CONFIGS["qwen3_5_vl"] = dict(
    model_type="qwen3_5", tie_word_embeddings=False,
    text_config={k: v for k, v in TINY_CONFIGS["qwen3_5"].items() if k != "model_type"}
    | dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25,
                                mrope_interleaved=True, mrope_section=[2, 1, 1])),
    vision_config=dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
        temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
        num_position_embeddings=64,
    ),
)
# placeholder / boundary tokens per multimodal family (default: MM_TOKENS, Gemma-4's)
FAMILY_MM_TOKENS = {"qwen3_vl": QWEN_VL_TOKENS, "qwen3_5_vl": QWEN_VL_TOKENS}

# Qwen's special tokens at the ids its real tokenizers give them (Qwen2-VL .. Qwen3-VL: after the
# 151,643 BPE tokens, the model's vocab_size 151,936). GenieX's QAIRT plugin takes some as constants
# (models/qwen3_vl/qwen3_vl.h: vision_start 151652, image_pad 151655; geniex-proc's qwen2vl.cpp
# splices 151652 / 151653 / 151655 around each image) and finds <|im_start|> / <|im_end|> /
# <|endoftext|> by text (its chat format, its end-of-generation candidates).
QWEN_SPECIAL_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648,
    "<|box_end|>": 151649, "<|quad_start|>": 151650, "<|quad_end|>": 151651,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}
QWEN_VOCAB_SIZE = 151936  # Qwen3-VL-2B's config (the table is padded past the tokenizer)
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Weight scales applied after from_config, by parameter-name substring. Gemma-4 at from_config
# init is chaotic: q/k norms of 1.0 with attention scaling 1.0 give scores of std sqrt(head_dim),
# near one-hot attention that fp16 rounding flips (HF's own fp16 forward reaches only logits
# cos 0.986 vs its fp32 forward, bf16 0.57). A trained model's q_norm sets a softer temperature;
# with these scales HF's fp16 forward is at cos 0.99996, so a precision gate measures the port and
# not the fixture's chaos (tests/test_gemma4.py::test_tiny_fixture_is_well_conditioned).
TEMPER: dict[str, dict[str, float]] = {
    "gemma4": {"self_attn.q_norm": 0.3, "post_attention_layernorm": 0.3,
               "post_feedforward_layernorm": 0.3, "post_per_layer_input_norm": 0.3},
}

# Gemma-4's text decoder only (TEMPER's post-norm keys also reach the vision tower; these do not).
# TEMPER alone still left the fixture chaotic for weight error: HF fp32 with int8 per-channel
# weights reached only logits cos 0.987 vs itself, 1% weight noise 0.957, int4 block-64 0.12 (tiny
# llama: 0.99986 / 0.99977 / 0.968). Cause: the token embedding (std 0.02 x sqrt(H) = RMS 0.17) was
# smaller than each of the 3 RMS-0.3 writes per layer (attention, MLP, PLE), and layer_scalar down
# to 0.5 shrank the residual further, so every layer replaced ~half the residual stream with a
# fresh nonlinear function of it and errors compounded over depth (int8 on layer 0 alone: 0.992,
# on layer 9 alone: 0.99997). A trained model's residual stream carries the token and each block
# writes a small update onto it: embedding std 1/sqrt(H) (x6.25; sqrt(H) then gives RMS 1 and the
# tied logits std ~1 instead of 0.16), post-norm gains 0.12 (update/residual ~0.1-0.3),
# layer_scalar in 0.8-1.2. That alone makes a tied model degenerate, though: with the input
# embedding dominating h, h.E^T peaks at the input token (greedy repeated it 24/24 steps); a trained
# model's last hidden state predicts the next token, not the current one. Zero-mean final-norm gains
# (N(0, 1) less its mean, ZERO_MEAN_GAINS) decorrelate the readout from the input embedding
# (teacher-forced argmax == input: 0.02; greedy no longer repeats the last token). Measured (seed 0,
# HF fp32 activations, teacher-forced logits cos_min vs fp32): fp16 forward 0.999996, int8
# per-channel 0.99994, int4 block-64 0.990, 1% noise 0.99989 (seeds 1 / 2: int4 0.953 / 0.988).
# Still not degenerate: ablating any one attention sublayer moves the logits to cos 0.95-0.99, all
# PLE 0.87, the KV-shared layers' attention 0.94; tokens beyond the sliding window move them (0.996)
# through the full layers only; attention entropy 0.70-0.80 of uniform; logits std 0.9.
DECODER_TEMPER: dict[str, dict[str, float]] = {
    "gemma4": {"embed_tokens.weight": 6.25, "post_attention_layernorm": 0.4,
               "post_feedforward_layernorm": 0.4, "post_per_layer_input_norm": 0.4},
}
ZERO_MEAN_GAINS: dict[str, tuple[str, ...]] = {"gemma4": ("model.norm.weight",)}
LAYER_SCALAR_RANGE = (0.8, 1.2)  # Gemma-4's per-layer residual scale (was 0.5-1.5: see above)
_ENCODERS = ("vision_tower", "audio_tower", "embed_vision", "embed_audio")


def make_tokenizer(out_dir: Path, vocab_size: int = 384, add_bos: bool = True,
                   extra_specials: list[str] = (), special_ids: dict[str, int] | None = None):
    """Train a byte-level BPE on CORPUS; save as a HF fast tokenizer (tokenizer.json + config).

    ``special_ids`` (token -> id, e.g. QWEN_SPECIAL_IDS): a Qwen-style tokenizer instead, its
    specials at those ids (no <pad> / <s> / </s>; eos <|im_end|>, pad <|endoftext|>, Qwen's chat
    format) -- ``_place_specials``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [] if special_ids else ["<pad>", "<s>", "</s>", *extra_specials]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    if special_ids:
        fast = PreTrainedTokenizerFast(tokenizer_object=_place_specials(tok, special_ids),
                                       eos_token="<|im_end|>", pad_token="<|endoftext|>")
        fast.chat_template = QWEN_CHAT_TEMPLATE
        fast.save_pretrained(str(out_dir))
        return fast
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    fast.save_pretrained(str(out_dir))
    return fast


def _place_specials(tok, special_ids: dict[str, int]):
    """``tok`` (a trained BPE) with ``special_ids``' tokens at those ids, as a real Qwen
    tokenizer.json holds them: the BPE vocabulary filled up to the first special id with tokens
    no merge reaches (``[unused<i>]``: every id below it decodes, as in Qwen's 151,643 BPE tokens),
    the specials after it in the model vocab and in ``added_tokens`` with the same ids (the
    tokenizers library takes an added token's id from the model vocab when it is there)."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    first = min(special_ids.values())
    if len(vocab) > first:
        raise ValueError(f"the BPE's {len(vocab)} tokens reach the first special id {first}")
    vocab.update({f"[unused{i}]": i for i in range(len(vocab), first)})
    vocab.update(special_ids)
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t, i in sorted(special_ids.items(), key=lambda kv: kv[1])]
    out = Tokenizer.from_str(json.dumps(spec))
    wrong = {t: out.token_to_id(t) for t, i in special_ids.items() if out.token_to_id(t) != i}
    if wrong:
        raise ValueError(f"special tokens at the wrong ids: {wrong}")
    return out


def condition_gemma4_vision(model) -> None:
    """from_config leaves the vision position table at ones (every patch gets the same position
    embedding) and input_proj at std 0.02: the tower's output then barely depends on the image or
    the positions (HF's soft-token rows are cos >= 0.996 to one another; dropping RoPE still
    scored 0.999998), so no gate could see a bug. A random table and 10x input_proj make it see
    one (dropping RoPE: cos 0.96; x/y swapped: -0.08; no key mask: 0.97)."""
    condition_gemma4_vision_tower(model.model.vision_tower)


def condition_gemma4_vision_tower(tower) -> None:
    """condition_gemma4_vision on the tower alone (a checkpoint made one module at a time)."""
    import torch

    pe = tower.patch_embedder
    table = pe.position_embedding_table
    table.copy_(torch.randn(table.shape, generator=torch.Generator().manual_seed(0)))
    pe.input_proj.weight.mul_(10.0)


def save_gemma4_processor_config(out: Path, patch_size: int = 4, max_soft_tokens: int = 70,
                                 pooling_kernel_size: int = 3) -> None:
    """processor_config.json as the Gemma-4 repos carry it: image processor (the tiny's: 70 soft
    tokens at most, patch 4 to match the tiny vision tower) + audio feature extractor settings."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    image = Gemma4ImageProcessorPil(patch_size=patch_size, max_soft_tokens=max_soft_tokens,
                                    pooling_kernel_size=pooling_kernel_size)
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor", "audio_ms_per_token": 40,
        "image_processor": image.to_dict(),
        "feature_extractor": Gemma4AudioFeatureExtractor().to_dict(),
    }, indent=1, default=str))


def _save_qwen2vl_processor_config(out: Path, vision: dict) -> None:
    """preprocessor_config.json as the Qwen3-VL repos carry it (mean/std 0.5), sized to the tiny
    tower's patch / merge sizes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"], image_mean=[0.5] * 3, image_std=[0.5] * 3)
    proc.save_pretrained(str(out))


def condition_weights(model, base: str, towers=None) -> None:
    """Make a from_config model behave like a trained one where the oracle needs it (in place).

    from_config leaves norms (and Gemma-4's layer_scalar) at 1.0: they are perturbed so they
    matter. Gemma-4 also gets TEMPER / DECODER_TEMPER / ZERO_MEAN_GAINS / LAYER_SCALAR_RANGE (see
    above): unconditioned, it amplifies fp32 rounding through depth — at real size (35 layers)
    HF against itself with 1e-7 relative noise on the embeddings gives logits cos 0.99988 and
    greedy 7/16, so no correct port could pass a greedy-exact gate on it (bench/realshape.py
    uses this too). ``towers(model)``: the encoders' own conditioning, between the two passes
    (the order fixes the random stream the tiny fixtures' seeds were chosen on)."""
    import torch

    with torch.no_grad():
        condition_params(model.named_parameters(), base)
        if towers is not None:
            towers(model)
        condition_buffers(model.named_buffers())


def condition_params(named, base: str) -> None:
    """condition_weights' pass over (full name, parameter) pairs, in place, under no_grad."""
    import torch

    for name, p in named:
        if "norm" in name:
            p.add_(torch.randn_like(p) * 0.1)
        for key, factor in TEMPER.get(base, {}).items():
            if key in name:
                p.mul_(factor)
        if any(e in name for e in _ENCODERS):
            continue
        for key, factor in DECODER_TEMPER.get(base, {}).items():
            if key in name:
                p.mul_(factor)
        if name.replace("language_model.", "") in ZERO_MEAN_GAINS.get(base, ()):
            p.normal_()
            p.sub_(p.mean())


def condition_buffers(named) -> None:
    """Gemma-4's layer_scalar buffers drawn in LAYER_SCALAR_RANGE (in place, under no_grad)."""
    import torch

    for name, b in named:
        if name.endswith("layer_scalar"):
            lo, hi = LAYER_SCALAR_RANGE
            b.fill_(float(lo + (hi - lo) * torch.rand(1)))


def make_tiny_checkpoint(family: str, out_dir: str | Path, seed: int = 0,
                         qwen_special_ids: bool = False, **overrides) -> Path:
    """Write a random-weight checkpoint of ``family`` (a TINY_CONFIGS key) to ``out_dir``.

    ``qwen_special_ids`` (qwen3_vl): Qwen's special tokens at their real ids (QWEN_SPECIAL_IDS;
    image 151655, vision start / end 151652 / 151653, eos <|im_end|> 151645) and Qwen3-VL-2B's
    vocab_size 151,936 (embedding and head that many rows), everything else as tiny: what
    GenieX's plugin takes as constants."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_kwargs = copy.deepcopy({**TINY_CONFIGS[family], **overrides})
    if qwen_special_ids and family != "qwen3_vl":
        raise ValueError(f"qwen_special_ids is for qwen3_vl, not {family}")
    add_bos = cfg_kwargs["model_type"] not in ("qwen3", "qwen2", "qwen3_5_text", "qwen3_5",
                                               "qwen3_vl")
    multimodal = "text_config" in cfg_kwargs
    mm_tokens = FAMILY_MM_TOKENS.get(family, MM_TOKENS)
    tok = make_tokenizer(out, add_bos=add_bos,
                         extra_specials=list(mm_tokens.values()) if multimodal else [],
                         special_ids=QWEN_SPECIAL_IDS if qwen_special_ids else None)
    text_kwargs = cfg_kwargs["text_config"] if multimodal else cfg_kwargs
    if "hidden_size_per_layer_input" in text_kwargs:
        text_kwargs["vocab_size_per_layer_input"] = len(tok)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if qwen_special_ids:  # as Qwen3-VL's config: bos = pad = <|endoftext|>, the padded table
        ids.update(vocab_size=QWEN_VOCAB_SIZE, bos_token_id=QWEN_SPECIAL_IDS["<|endoftext|>"])
    text_kwargs.update(ids)
    model_type = cfg_kwargs.pop("model_type")
    if multimodal:
        cfg_kwargs.update({k: tok.convert_tokens_to_ids(t) for k, t in mm_tokens.items()})
        if "eoa_token_id" in cfg_kwargs:
            cfg_kwargs["eoa_token_index"] = cfg_kwargs["eoa_token_id"]
        cfg_kwargs.update({k: v for k, v in ids.items() if k != "vocab_size"})
    config = AutoConfig.for_model(model_type, **cfg_kwargs)
    torch.manual_seed(seed)
    if multimodal:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    condition_weights(model, family.removesuffix("_mm"),
                      condition_gemma4_vision if family == "gemma4_mm" else None)
    model.save_pretrained(str(out), safe_serialization=True)
    if family == "gemma4_mm":
        save_gemma4_processor_config(out)
    if family in FAMILY_MM_TOKENS:
        _save_qwen2vl_processor_config(out, cfg_kwargs["vision_config"])
    GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(str(out))
    tiny = {"family": family, "seed": seed} | ({"qwen_special_ids": True} if qwen_special_ids else {})
    (out / "hexforge_tiny.json").write_text(json.dumps(tiny))
    return out
