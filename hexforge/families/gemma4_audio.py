"""Gemma-4 audio tower (``audio_config.model_type == "gemma4_audio"``): USM conformer -> soft tokens.

    host (runtime/audio.py Gemma4AudioPrep): waveform -> log-mel [1, F, 128] + frame mask [1, F]
    graph (this file): mask the mel frames ─2× (Conv2d 3×3/2 → LayerNorm → ReLU)─▶ Linear
        ─N conformer layers (½FFN, chunked local attention, causal depthwise conv, ½FFN)─▶
        output_proj ─embed_audio (RMSNorm, Linear)─▶ soft [1, S, H_text], S = ceil(ceil(F/2)/2)

What the static graph does differently from HF (same numbers on the valid rows):
  * the window is fixed (F frames); validity is a float input, the subsampled masks are strided
    slices of it, and rows past the audio are zeroed at the output (HF drops them).
  * chunked local attention with static shapes: the key/value context windows are one constant
    Gather (HF: unfold), the relative-position logits keep HF's pad/reshape shift, the position
    keys ``relative_k_proj(sinusoids)`` are a constant, and everything runs at rank 4 with the
    batch (1) dropped (the HTP rejects rank-5 Tanh).
  * the attention mask is a 0/1 float product (structure constant × key validity) added as a
    bounded bias, (allowed - 1) · (2·cap + 30): logits are softcapped to [-cap, cap], so masked
    keys sit >= 30 below every allowed one (weight <= e^-30) and the softmax input stays within
    [-3·cap - 30, cap] — finite in fp16 and narrow enough for uint16 activation quantization.
    HF fills masked logits with -1e9 (-inf in fp16); the HTP Softmax handles every fill alike, so
    the bound is for quantization and fp16 hygiene, not a Softmax bug (docs/notes/measurements.md).
  * clamps whose bound is infinite or beyond fp16's range are left out (unbounded Clip is rejected
    by the HTP; such a bound cannot act on anything an fp16 graph holds); finite bounds of the
    clippable linears stay, as constants.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..bundle.errors import CheckpointError, UnsupportedModelError
from ..bundle.manifest import EncoderSpec
from .base import EncoderFamily, from_config
from .blocks import norm_prescale
from .graphio import GraphIO

FP16_MAX = 65504.0
MASK_GAP = 30.0  # masked attention logits sit this far below the softcapped range
HF_MAX_SAMPLES = 480_000  # Gemma4AudioFeatureExtractor.__call__ max_length: HF truncates past it
INPUT_KEYS = ("input_features", "input_features_mask")


@dataclass
class Args:
    """The audio sub-config (Gemma4AudioConfig field names and defaults)."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: list[int] = field(default_factory=lambda: [128, 32])
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    @classmethod
    def from_config(cls, config: dict) -> Args:
        """From the audio sub-config dict, or a full Gemma-4 config holding ``audio_config``."""
        return from_config(cls, config.get("audio_config") or config)


def _bound(x) -> float | None:
    """A clamp bound the graph keeps, or None for one that cannot act (inf, beyond fp16)."""
    v = float(x)
    return v if math.isfinite(v) and abs(v) < FP16_MAX else None


def _clamp(x: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
    return x if lo is None and hi is None else torch.clamp(x, lo, hi)


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float, k: float = 1.0) -> torch.Tensor:
    """Gemma4RMSNorm over the last dim of a rank-3 tensor (the HTP norm chain is right at rank 3),
    on k·x (k: the calibrated power-of-two prescale, blocks.record_norm_prescales; exact in fp32,
    keeps the fp16 squares out of the subnormals)."""
    if k != 1.0:
        x, eps = x * k, eps * k * k
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


class ClipLinear(nn.Module):
    """Gemma4ClippableLinear with its (finite) clip bounds as constants."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.linear = hf.linear
        clip = getattr(hf, "use_clipped_linears", False)
        self.lo_in, self.hi_in, self.lo_out, self.hi_out = (
            (_bound(hf.input_min), _bound(hf.input_max), _bound(hf.output_min), _bound(hf.output_max))
            if clip else (None, None, None, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _clamp(self.linear(_clamp(x, self.lo_in, self.hi_in)), self.lo_out, self.hi_out)


class ChunkedAttention(nn.Module):
    """Gemma4AudioAttention on a fixed length T: blocks of C queries, each over a context of
    K = C + P + R keys (P = context_left - 1 past, R = context_right future)."""

    def __init__(self, hf: nn.Module, args: Args, pos_emb: torch.Tensor, T: int):
        super().__init__()
        self.H, self.D = hf.num_heads, hf.head_dim
        self.C, self.P, self.R = hf.chunk_size, hf.max_past_horizon, hf.max_future_horizon
        self.K, self.T = hf.context_size, T
        self.NB = -(-T // self.C)  # blocks
        self.cap = float(args.attention_logit_cap)
        self.q_proj, self.k_proj = ClipLinear(hf.q_proj), ClipLinear(hf.k_proj)
        self.v_proj, self.post = ClipLinear(hf.v_proj), ClipLinear(hf.post)
        with torch.no_grad():
            q_scale = hf.q_scale * F.softplus(hf.per_dim_scale)  # [D]
            rel_k = hf.relative_k_proj(pos_emb).view(-1, self.H, self.D)  # [Lp, H, D]
        self.k_scale = float(hf.k_scale)
        self.register_buffer("q_scale", q_scale.detach().clone(), persistent=False)
        self.register_buffer("rel_k", rel_k.permute(1, 2, 0).contiguous(), persistent=False)  # [H, D, Lp]

    def context(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [NB, K, ...]: the key window of every block (HF pad + unfold)."""
        pad = [0, 0] * (x.dim() - 1) + [self.P, self.R + self.C - 1]
        x = F.pad(x, pad)  # [P + T + R + C - 1, ...]
        return torch.index_select(x, 0, index).view(self.NB, self.K, *x.shape[1:])

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x [1, T, hidden], allowed [1, NB, C, K] 0/1 -> [1, T, hidden]."""
        H, D, C, K, NB, T = self.H, self.D, self.C, self.K, self.NB, self.T
        q = self.q_proj(x).view(T, H, D) * self.q_scale
        k = self.k_proj(x).view(T, H, D) * self.k_scale
        v = self.v_proj(x).view(T, H, D)
        q = F.pad(q, (0, 0, 0, 0, 0, NB * C - T)).view(NB, C, H, D).permute(2, 0, 1, 3)  # [H, NB, C, D]
        kc = self.context(k, index).permute(2, 0, 3, 1)  # [H, NB, D, K]
        vc = self.context(v, index).permute(2, 0, 1, 3)  # [H, NB, K, D]
        ac = q @ kc  # [H, NB, C, K]
        # relative-position logits, shifted as HF _rel_shift (Transformer-XL appendix B)
        bd = (q.reshape(H, NB * C, D) @ self.rel_k).view(H, NB, C, -1)  # [H, NB, C, Lp]
        bd = F.pad(bd, (0, K + 1 - bd.shape[-1])).reshape(H, NB, C * (K + 1))
        bd = bd[..., : C * K].reshape(H, NB, C, K)
        logits = torch.tanh((ac + bd) / self.cap) * self.cap  # [H, NB, C, K] in [-cap, cap]
        # bounded mask: a masked logit lands >= MASK_GAP below every allowed one (weight
        # <= e^-30 of the row's top key; HF's -1e9 gives exactly 0)
        p = torch.softmax(logits + (allowed - 1.0) * (2.0 * self.cap + MASK_GAP), dim=-1)
        out = (p @ vc).permute(1, 2, 0, 3).reshape(NB * C, H * D)[:T]  # [T, H·D]
        return self.post(out.unsqueeze(0))


class ConformerLayer(nn.Module):
    """Gemma4AudioLayer: ½FFN, attention, light conv, ½FFN, norm (HF's clamps where they can act)."""

    def __init__(self, hf: nn.Module, args: Args, pos_emb: torch.Tensor, T: int):
        super().__init__()
        self.gc = _bound(args.gradient_clipping)
        self.hf = hf  # norms, conv and activations are read from it
        self.ff1, self.ff2 = self._ffn(hf.feed_forward1), self._ffn(hf.feed_forward2)
        self.attn = ChunkedAttention(hf.self_attn, args, pos_emb, T)
        lc = hf.lconv1d
        self.lin_start, self.lin_end = ClipLinear(lc.linear_start), ClipLinear(lc.linear_end)
        self.kernel = lc.depthwise_conv1d.kernel_size[0]

    @staticmethod
    def _ffn(ff: nn.Module) -> nn.ModuleList:
        return nn.ModuleList([ClipLinear(ff.ffw_layer_1), ClipLinear(ff.ffw_layer_2)])

    def _norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return _rms(x, norm.weight if norm.with_scale else None, norm.eps,
                    norm_prescale(norm))

    def ffn(self, x: torch.Tensor, ff: nn.Module, lin: nn.ModuleList) -> torch.Tensor:
        g = -self.gc if self.gc is not None else None
        h = self._norm(_clamp(x, g, self.gc), ff.pre_layer_norm)
        h = lin[1](ff.act_fn(lin[0](h)))
        h = self._norm(_clamp(h, g, self.gc), ff.post_layer_norm)
        return h * ff.post_layer_scale + x

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        hf, gc = self.hf, self.gc
        g = -gc if gc is not None else None
        x = self.ffn(x, hf.feed_forward1, self.ff1)  # [1, T, hidden]
        h = self.attn(self._norm(_clamp(x, g, gc), hf.norm_pre_attn), allowed, index)
        x = self._norm(_clamp(h, g, gc), hf.norm_post_attn) + x
        # light conv: GLU, causal depthwise conv (left pad kernel - 1), norm, act, linear
        lc = hf.lconv1d
        h = F.glu(self.lin_start(self._norm(x, lc.pre_layer_norm)), dim=-1)  # [1, T, hidden]
        conv = lc.depthwise_conv1d
        h = F.conv1d(F.pad(h.transpose(1, 2), (self.kernel - 1, 0)), conv.weight, conv.bias,
                     groups=conv.groups).transpose(1, 2)
        h = lc.act_fn(self._norm(_clamp(h, g, gc), lc.conv_norm))
        x = self.lin_end(h) + x
        x = self.ffn(x, hf.feed_forward2, self.ff2)
        return self._norm(_clamp(x, g, gc), hf.norm_out)


class AudioEncoder(nn.Module):
    """(input_features [1, F, n_mels], input_features_mask [1, F] 0/1) -> soft [1, S, H_text]."""

    def __init__(self, tower: nn.Module, embed: nn.Module, args: Args, frames: int,
                 example: dict[str, np.ndarray]):
        super().__init__()
        self.tower, self.embed, self.frames = tower, embed, frames
        self.S = (((frames - 1) // 2 + 1) - 1) // 2 + 1  # two stride-2, kernel-3, pad-1 convs
        with torch.no_grad():
            pos_emb = tower.rel_pos_enc(torch.zeros(1, 1, args.hidden_size))  # [1, Lp, hidden]
        self.layers = nn.ModuleList(ConformerLayer(layer, args, pos_emb, self.S)
                                    for layer in tower.layers[: args.num_hidden_layers])
        a = self.layers[0].attn  # every layer has the same chunking
        C, P, R, K, NB = a.C, a.P, a.R, a.K, a.NB
        # block n's key window starts at padded index n·C (= position n·C - P)
        index = (torch.arange(NB)[:, None] * C + torch.arange(K)[None, :]).reshape(-1)
        self.register_buffer("index", index, persistent=False)  # [NB·K] int64
        # HF's sliding window as dist = q - k: visible iff 0 <= dist < P or 0 < -dist < R;
        # query c of a block vs key slot k of its window: dist = c + P - k
        dist = torch.arange(C)[:, None] + P - torch.arange(K)[None, :]  # [C, K]
        struct = ((dist >= 0) & (dist < P)) | ((dist < 0) & (-dist < R))
        self.register_buffer("struct", struct.float(), persistent=False)  # [C, K]
        self.io = GraphIO(inputs=[(k, f"media:{k}") for k in INPUT_KEYS], outputs=[("soft", "soft")])
        self._example = example

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(self._example[k]) for k in INPUT_KEYS)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        half = mask[:, ::2]
        return self.encode(features, (mask, half), half[:, ::2])

    def encode(self, features: torch.Tensor, conv_masks: tuple, mask: torch.Tensor
               ) -> torch.Tensor:
        """The tower on features [1, F, n_mels] given each subsampling conv's input mask (the
        frame mask, then its stride-2 [::2]; None: the input is zero where masked already) and
        the soft tokens' mask [1, S] (mask[::2][::2])."""
        sub = self.tower.subsample_conv_projection
        h = features.unsqueeze(1)  # [1, 1, F, n_mels]
        for layer, m in zip((sub.layer0, sub.layer1), conv_masks, strict=True):
            # HF: mask the input, conv, norm over channels, ReLU
            h = layer.conv(h if m is None else h * m[:, None, :, None])  # [1, c, F', n_mels']
            h = layer.act(layer.norm(h.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        _, c, T, f = h.shape
        h = sub.input_proj_linear(h.permute(0, 2, 3, 1).reshape(1, T, f * c))  # [1, S, hidden]
        a = self.layers[0].attn
        keys = F.pad(mask[0], (a.P, a.R + a.C - 1))  # [P + S + R + C - 1] key validity
        keys = torch.index_select(keys, 0, self.index).view(1, a.NB, 1, a.K)
        allowed = self.struct * keys  # [1, NB, C, K]
        for layer in self.layers:
            h = layer(h, allowed, self.index)
        h = self.tower.output_proj(h)  # [1, S, output_proj_dims]
        e = self.embed
        pre = e.embedding_pre_projection_norm
        h = e.embedding_projection(_rms(h, None, pre.eps, norm_prescale(pre)))
        return h * mask.unsqueeze(-1)  # [1, S, H_text]; rows past the audio zeroed


def _checkpoint_dir(hf) -> Path:
    path = Path(getattr(hf, "name_or_path", "") or getattr(hf.config, "_name_or_path", ""))
    if not (path / "config.json").is_file():
        raise CheckpointError(f"cannot find the checkpoint directory of the HF model ({path})")
    return path


def feature_extractor_params(ckpt: Path) -> dict:
    """The feature extractor as HF resolves it from the checkpoint's processor_config.json
    ("feature_extractor") or preprocessor_config.json, else its defaults -> Gemma4AudioPrep params."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    cfg: dict = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = ckpt / name
        if f.is_file():
            data = json.loads(f.read_text())
            cfg = data.get("feature_extractor", data)
            break
    fe = Gemma4AudioFeatureExtractor.from_dict(cfg)

    def arr(x):
        return None if x is None else [float(v) for v in np.asarray(x).reshape(-1)]

    return dict(
        sampling_rate=int(fe.sampling_rate), feature_size=int(fe.feature_size),
        frame_length=int(fe.frame_length), hop_length=int(fe.hop_length),
        fft_length=int(fe.fft_length), min_frequency=float(fe.min_frequency),
        max_frequency=float(fe.max_frequency), preemphasis=float(fe.preemphasis),
        preemphasis_htk_flavor=bool(fe.preemphasis_htk_flavor),
        input_scale_factor=float(fe.input_scale_factor), mel_floor=float(fe.mel_floor),
        per_bin_mean=arr(fe.per_bin_mean), per_bin_stddev=arr(fe.per_bin_stddev),
        pad_to_multiple_of=128, max_seconds=HF_MAX_SAMPLES / fe.sampling_rate,
    )


def chirp(seconds: float, sampling_rate: int) -> np.ndarray:
    """A 200 Hz -> 3 kHz linear chirp at half scale with a slow tremolo: float32 [n]."""
    t = np.arange(round(seconds * sampling_rate)) / sampling_rate
    f0, f1 = 200.0, 3000.0
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * max(seconds, 1e-9)))
    return (0.5 * np.sin(phase) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


class Gemma4AudioEncoder(EncoderFamily):
    modality = "audio"
    example_fraction = 0.7  # example audio fills 70% of the window: padding rows get exercised

    def check_supported(self, args: Args) -> None:
        if len(args.subsampling_conv_channels) != 2 or args.attention_context_left < 2:
            raise UnsupportedModelError(
                f"gemma4_audio: subsampling_conv_channels {args.subsampling_conv_channels} / "
                f"attention_context_left {args.attention_context_left} are not what this export "
                "reproduces (2 subsampling convs, at least one past key)")

    def spec(self, hf, config: dict, max_seconds: float | None = None) -> EncoderSpec:
        """The manifest entry; ``max_seconds`` sets the audio window (default HF's 30 s cap)."""
        from tokenizers import Tokenizer

        from ..runtime.audio import Gemma4AudioPrep

        self.check_supported(Args.from_config(config))
        ckpt = _checkpoint_dir(hf)
        params = feature_extractor_params(ckpt)
        if max_seconds is not None:
            cap = params["max_seconds"]
            if not 0 < max_seconds <= cap:
                raise CheckpointError(f"audio window {max_seconds:g} s: must be in (0, {cap:g}] s "
                                      "(HF truncates audio past that)")
            params["max_seconds"] = float(max_seconds)
        prep = Gemma4AudioPrep(params)
        audio_id = int(config["audio_token_id"])
        text = Tokenizer.from_file(str(ckpt / "tokenizer.json")).id_to_token(audio_id)
        if text is None:
            raise CheckpointError(f"the tokenizer has no token for audio_token_id {audio_id}")
        end = config.get("eoa_token_id", config.get("eoa_token_index"))
        return EncoderSpec(
            name="audio", modality="audio", preprocessor="gemma4_audio", params=params,
            placeholder_id=audio_id, placeholder_text=text, begin_id=config.get("boa_token_id"),
            end_id=None if end is None else int(end), max_soft_tokens=prep.max_soft_tokens)

    def example_inputs(self, spec: EncoderSpec) -> dict[str, np.ndarray]:
        from ..runtime.audio import Gemma4AudioPrep

        prep = Gemma4AudioPrep(spec.params)
        inputs, _ = prep(chirp(prep.max_seconds * self.example_fraction, prep.sampling_rate))
        return inputs

    def encoder_module(self, hf, spec: EncoderSpec) -> AudioEncoder:
        from ..runtime.audio import Gemma4AudioPrep

        args = Args.from_config(hf.config.audio_config.to_dict())
        self.check_supported(args)
        prep = Gemma4AudioPrep(spec.params)
        module = AudioEncoder(hf.model.audio_tower, hf.model.embed_audio, args, prep.num_frames,
                              self.example_inputs(spec))
        if module.S != spec.max_soft_tokens:
            raise CheckpointError(f"gemma4_audio: the graph makes {module.S} rows, the spec says "
                                  f"{spec.max_soft_tokens}")
        return module.eval()

    def genie_row_bound(self, hf, spec: EncoderSpec) -> float:
        from .gemma4_vision import embedder_bound

        return embedder_bound(hf.model.embed_audio)

    def genie_node(self, hf, spec: EncoderSpec, row_tail: np.ndarray | None):
        """The tower as Genie's audio-encoder node (``GenieAudioNode``): the log-mel uint16 over
        the range a waveform in [-1, 1] can reach (``feature_range``), the conv and soft-token
        masks bools, each output row the soft token then ``row_tail``."""
        from ..runtime.audio import Gemma4AudioPrep
        from .genienode import AUDIO_INPUT, AUDIO_MASK, AUDIO_MASK_AFTER_CNN, GenieNodeForm

        module = GenieAudioNode(self.encoder_module(hf, spec), row_tail)
        return GenieNodeForm(role="audio-encoder", mode="audio", module=module,
                             fixed_point={"input_features":
                                          feature_range(Gemma4AudioPrep(spec.params))},
                             # the masks first: Genie runs the node when its features come
                             feeds={"soft_token_mask": AUDIO_MASK,
                                    "mask_after_cnn": AUDIO_MASK_AFTER_CNN,
                                    "input_features": AUDIO_INPUT},
                             model={"truncation-method": "default"}, rows_via="host")

    def reference(self, hf, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """HF get_audio_features (audio tower + embed_audio) on the same features: valid rows."""
        feats = torch.from_numpy(inputs["input_features"])
        mask = torch.from_numpy(inputs["input_features_mask"]) > 0.5
        with torch.no_grad():
            out = hf.model.get_audio_features(feats, mask)
        return {"soft": out.pooler_output[0][out.attention_mask[0]].float().numpy()}


ENCODER = Gemma4AudioEncoder()


def feature_range(prep) -> tuple[float, float]:
    """The log-mel values a waveform with samples in [-1, 1] can give (runtime/audio.py's
    arithmetic): log(floor) when silent, at most log(A · Σ|window| · max_j Σ_b mel[b, j] + floor)
    with A the frame's peak (scale, and 1 + p after preemphasis), then each bin's mean / stddev.
    A Genie node's uint16 input covers it (the host refuses features past it, never clips)."""
    a = prep.input_scale_factor * ((1.0 + prep.preemphasis) if prep.preemphasis > 0 else 1.0)
    peak = a * float(np.abs(prep.window).astype(np.float64).sum())
    lo = math.log(prep.mel_floor)
    hi = math.log(peak * float(prep.mel_filters.sum(0).max()) + prep.mel_floor)
    lo_b, hi_b = np.full(prep.n_mels, lo), np.full(prep.n_mels, hi)
    if prep.per_bin_mean is not None:
        lo_b, hi_b = lo_b - prep.per_bin_mean.ravel(), hi_b - prep.per_bin_mean.ravel()
    if prep.per_bin_stddev is not None:
        std = prep.per_bin_stddev.ravel()
        lo_b, hi_b = np.minimum(lo_b / std, hi_b / std), np.maximum(lo_b / std, hi_b / std)
    return float(lo_b.min()), float(hi_b.max())


class GenieAudioNode(nn.Module):
    """``AudioEncoder`` behind Genie's audio-encoder tensors (families/genienode.py)::

        input_features        [1, F, n_mels] uint16 in the binary (Genie quantizes the host's
                                             f32; zero past the audio, as the host makes them)
        padded_mask_after_cnn [1, F/2] bool  the first conv's output mask (mask[::2])
        input_features_mask   [1, S] bool    the soft tokens' mask (mask[::2][::2]): Genie
                                             appends as many output rows as it holds ones
        ─▶ AudioEncoder.encode ─▶ hidden_states [1, S, H_text (+ tail)], rows past the audio 0

    The masks are bools the host hands over as 0/1 float32; why the soft tokens' mask and not
    the frames' goes under Genie's input_features_mask: docs/genie-pipelines.md."""

    def __init__(self, encoder: AudioEncoder, row_tail: np.ndarray | None):
        super().__init__()
        from .genienode import AUDIO_FEATURES

        self.encoder = encoder
        tail = None if row_tail is None else torch.from_numpy(
            np.asarray(row_tail, np.float32)).view(1, 1, -1)
        self.register_buffer("tail", tail, persistent=False)
        self.io = GraphIO(inputs=[("input_features", "media:input_features"),
                                  ("padded_mask_after_cnn", "media:mask_after_cnn"),
                                  ("input_features_mask", "media:soft_token_mask")],
                          outputs=[(AUDIO_FEATURES, "soft")])

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        feats, mask = self.encoder.example_inputs()
        half = mask[:, ::2]
        return feats, half > 0.5, half[:, ::2] > 0.5

    def forward(self, features: torch.Tensor, mask_after_cnn: torch.Tensor,
                soft_token_mask: torch.Tensor) -> torch.Tensor:
        soft = self.encoder.encode(features, (None, mask_after_cnn.float()),
                                   soft_token_mask.float())
        if self.tail is None:
            return soft
        return torch.cat([soft, self.tail.expand(1, soft.shape[1], -1)], dim=-1)
