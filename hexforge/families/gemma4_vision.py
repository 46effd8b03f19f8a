"""Gemma-4 vision tower (vision_config.model_type "gemma4_vision") as a static-shape encoder graph.

    image ─runtime/vision.py Gemma4ImagePrep (host, numpy)─▶ P = max_soft_tokens·k² patch rows
      pixel_values [1, P, 3p²]  patch_pos [1, P, 2] i32  patch_valid [1, P]  pool_index [1, P]
      rope_cos / rope_sin [1, P, D]
    ─graph─▶ input_proj(2·px − 1) + pos_x[x] + pos_y[y]      (2 gathers on a truncated table)
             L × [bidirectional attention (q/k/v norms, axial 2-D RoPE, keys masked by validity)
                  + gated MLP]
             pooled = onehot(pool_index)ᵀ · h / k²            (HF's position-based k×k average)
             standardize (if configured) · RMSNorm · embed_vision projection
    ─▶ soft [1, S, H_text]: rows 0..n−1 are the image's n tokens (HF pools row-major over the
       pooled grid, so its valid rows are the first n too); rows n.. are padding, never read.

Host vs graph (why):
  * position embeddings: a gather in-graph. The preprocessor holds only manifest params (no host
    tensors), and the gather reads P·H values; a one-hot matmul would cost 2·P·R·H MACs (real
    280-token model: 2·2520·840·768 ≈ 3.3 G, comparable to a layer) for the same rows. The table
    is cut to the R = max_soft_tokens·k rows an image can reach (real: 840 of 10240 rows, 12× less
    weight); the host refuses an image that would index past it.
  * RoPE cos/sin on the host in fp32: on the HTP's fp16, angles up to R rad lose ~0.1 rad.
  * pooling: host sends each patch's pooled-token index, the graph builds the one-hot with float
    ops (relu(1 − |i − j|): the HTP rejects bool Equal) and pools with one MatMul [S,P]·[P,H].
  * √H pooler scale: folded into the scale-free pre-projection RMSNorm's eps (exact algebra), so
    the graph never holds the √H-scaled values HF keeps in fp32 because they overflow fp16.
  * attention mask: bounded additive bias (MASK_VALUE) from patch_valid, never -inf (HTP_NOTES).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..bundle.errors import BuildError, UnsupportedModelError
from ..bundle.manifest import EncoderSpec
from .base import EncoderFamily, from_config
from .graphio import GraphIO

HF_MAX_SOFT_TOKENS = 280  # Gemma4ImageProcessor's default budget
MASK_VALUE = -1.0e4  # additive bias on padding keys: exp() of it is 0 in fp32 and fp16, bounded
# graph inputs, in forward-argument order; each bound to the preprocessor output of the same name
INPUT_KEYS = ("pixel_values", "patch_pos", "patch_valid", "pool_index", "rope_cos", "rope_sin")
EXAMPLE_SIZE = (45, 83)  # (height, width): non-square, resized to fewer than max_soft_tokens



def embedder_bound(embed) -> float:
    """Gemma-4's soft tokens leave the tower through ``Gemma4MultimodalEmbedder``: a scale-free
    RMSNorm (so ||y||_2 = sqrt(d) x rms / sqrt(rms^2 + eps) < sqrt(d)) then a Linear with no
    bias, so by Cauchy-Schwarz each output column i is within sqrt(d) x ||W_i||_2, whatever
    the image or recording."""
    w = embed.embedding_projection.weight.detach().float()  # [H_text, d]
    return float(math.sqrt(w.shape[1]) * w.norm(dim=1).max())

@dataclass
class Args:
    """HF Gemma4VisionConfig field names."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int = 3072
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_parameters: dict = field(default_factory=dict)
    model_type: str = "gemma4_vision"

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict) -> Args:
        return from_config(cls, config)

    @property
    def rope_theta(self) -> float:
        return float((self.rope_parameters or {}).get("rope_theta", 100.0))


def processor_config(ckpt_dir: Path) -> dict:
    """The image processor's settings as the checkpoint ships them: processor_config.json
    ("image_processor" section) or preprocessor_config.json (flat); {} when neither exists."""
    for name, section in (("processor_config.json", "image_processor"),
                          ("preprocessor_config.json", None)):
        path = ckpt_dir / name
        if path.is_file():
            data = json.loads(path.read_text())
            data = data.get(section, {}) if section else data
            if isinstance(data, dict) and ("max_soft_tokens" in data or "patch_size" in data):
                return data
    return {}


def _token_text(ckpt_dir: Path, token_id: int) -> str:
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(ckpt_dir / "tokenizer.json")).id_to_token(token_id)
    if text is None:
        raise UnsupportedModelError(f"image_token_id {token_id} is not in the tokenizer")
    return text


class Gemma4VisionEncoder(EncoderFamily):
    modality = "image"
    Args = Args

    def spec(self, hf, config: dict) -> EncoderSpec:
        args = Args.from_config(config["vision_config"])
        self.check_supported(args)
        ckpt_dir = Path(hf.config._name_or_path)
        proc = processor_config(ckpt_dir)
        if not proc.get("do_resize", True) or proc.get("do_normalize", False):
            raise UnsupportedModelError("gemma4 image processor with do_resize=False or "
                                        "do_normalize=True is not what Gemma-4 ships; unsupported")
        max_soft = int(proc.get("max_soft_tokens", HF_MAX_SOFT_TOKENS))
        k = int(proc.get("pooling_kernel_size", args.pooling_kernel_size))
        if int(proc.get("patch_size", args.patch_size)) != args.patch_size or \
                k != args.pooling_kernel_size:
            raise UnsupportedModelError("the image processor's patch_size / pooling_kernel_size "
                                        "differ from vision_config's")
        params = {
            "patch_size": args.patch_size, "max_soft_tokens": max_soft, "pooling_kernel_size": k,
            "head_dim": args.head_dim, "rope_theta": args.rope_theta,
            # the longest side an image can have is max_soft_tokens·k patches (one pooled row)
            "position_rows": min(args.position_embedding_size, max_soft * k),
            "resample": int(proc.get("resample", 3)),
            "rescale_factor": float(proc.get("rescale_factor", 1 / 255)),
        }
        from ..runtime.vision import Gemma4ImagePrep

        prep = Gemma4ImagePrep(params)  # validates the params as the runtime will
        hf_inv = hf.model.vision_tower.encoder.rotary_emb.inv_freq.detach().float().numpy()
        if hf_inv.shape != prep.inv_freq.shape or not np.allclose(hf_inv, prep.inv_freq, rtol=1e-6):
            raise BuildError("gemma4 vision RoPE frequencies made on the host differ from HF's")
        image_id = int(config["image_token_id"])
        return EncoderSpec(
            name="vision", modality="image", preprocessor="gemma4_image", params=params,
            placeholder_id=image_id, placeholder_text=_token_text(ckpt_dir, image_id),
            begin_id=config.get("boi_token_id"), end_id=config.get("eoi_token_id"),
            max_soft_tokens=max_soft)

    def check_supported(self, args: Args) -> None:
        rope_type = (args.rope_parameters or {}).get("rope_type", "axial")
        if rope_type != "axial" or args.head_dim % 4:
            raise UnsupportedModelError(f"gemma4 vision needs axial RoPE over a head_dim divisible "
                                        f"by 4 (got {rope_type}, {args.head_dim})")
        if args.num_attention_heads % args.num_key_value_heads:
            raise UnsupportedModelError("gemma4 vision: heads not a multiple of kv heads")

    def encoder_module(self, hf, spec: EncoderSpec):
        args = Args.from_config(hf.config.vision_config.to_dict())
        return VisionGraph(hf, args, spec)

    def example_inputs(self, spec: EncoderSpec) -> dict[str, np.ndarray]:
        """A synthetic non-square image (smooth gradients + noise, so resize filters matter)
        through the runtime preprocessor."""
        from PIL import Image

        from ..runtime.vision import Gemma4ImagePrep

        h, w = EXAMPLE_SIZE
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        noise = np.random.default_rng(0).random((h, w, 3), dtype=np.float32)
        rgb = np.stack([xx / w, yy / h, 0.5 + 0.5 * np.sin(xx / 5 + yy / 7)], -1) * 0.7 + 0.3 * noise
        img = Image.fromarray((rgb * 255).astype(np.uint8), "RGB")
        inputs, _ = Gemma4ImagePrep(spec.params)(img)
        return inputs

    def genie_row_bound(self, hf, spec: EncoderSpec) -> float:
        return embedder_bound(hf.model.embed_vision)

    def genie_node(self, hf, spec: EncoderSpec, row_tail: np.ndarray | None):
        """The tower as Genie's image-encoder node (``GenieVisionNode``): pixels uint16 on [0, 1]
        (k/255 is 257k/65535: exact), the patch grid's positions and pooled indices Genie's own
        (it computes them from the node's vision-param: height x width patches, pooling-kernel-
        size); each output row the soft token then ``row_tail`` (the text LUT's other columns of
        a media row: Gemma-4's per-layer inputs of the pad token)."""
        from .genienode import IMAGE_INPUT, GenieNodeForm

        args = Args.from_config(hf.config.vision_config.to_dict())
        k = int(spec.params["pooling_kernel_size"])
        return GenieNodeForm(role="image-encoder", mode="image",
                             module=GenieVisionNode(hf, args, spec, row_tail),
                             fixed_point={"pixel_values": (0.0, 1.0)},
                             feeds={"pixel_values": IMAGE_INPUT},
                             model={"vision-param": {"pooling-kernel-size": k}})

    def reference(self, hf, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """HF's own soft tokens for the image: get_image_features (tower + embed_vision)."""
        import torch

        with torch.no_grad():
            out = hf.model.get_image_features(torch.from_numpy(inputs["pixel_values"]),
                                              torch.from_numpy(inputs["image_position_ids"]))
        return {"soft": out.pooler_output[0].float().numpy()}


ENCODER = Gemma4VisionEncoder()


# ---- the export module (torch: imported only at build time) -------------------------------------
def _torch():
    import torch
    from torch import nn

    return torch, nn


def rope_2d(x, cos, sin):
    """HF apply_multidimensional_rope with 2 axes: rotate_half within each half of head_dim.
    x [1, P, nH, D]; cos/sin [1, P, 1, D] laid out [x, x, y, y] quarters."""
    torch, _ = _torch()
    q = x.shape[-1] // 4
    rot = torch.cat((-x[..., q:2 * q], x[..., :q], -x[..., 3 * q:], x[..., 2 * q:3 * q]), dim=-1)
    return x * cos + rot * sin


def _linear(hf_linear):
    """Gemma4ClippableLinear -> a callable: its Linear, with only the finite clip bounds (the HTP
    rejects Clip with ±inf bounds, and an infinite bound clips nothing)."""
    torch, _ = _torch()
    lin = hf_linear.linear
    if not getattr(hf_linear, "use_clipped_linears", False):
        return lin

    def bounds(lo, hi):
        lo, hi = float(lo), float(hi)
        return (lo if math.isfinite(lo) else None), (hi if math.isfinite(hi) else None)

    in_b = bounds(hf_linear.input_min, hf_linear.input_max)
    out_b = bounds(hf_linear.output_min, hf_linear.output_max)

    def clip(x, b):
        return x if b == (None, None) else torch.clamp(x, min=b[0], max=b[1])

    return lambda x: clip(lin(clip(x, in_b)), out_b)


def VisionGraph(hf, args: Args, spec: EncoderSpec):
    """Build the static module (a factory: keeps torch out of this module's import)."""
    torch, nn = _torch()
    from .blocks import ACTIVATIONS, RMSNorm

    class Layer(nn.Module):
        def __init__(self, hf_layer):
            super().__init__()
            self.hf = hf_layer  # registers the HF weights once; the graph reads them
            a = hf_layer.self_attn
            self.q, self.k, self.v, self.o = (_linear(m) for m in
                                              (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
            self.q_norm, self.k_norm = RMSNorm.from_hf(a.q_norm), RMSNorm.from_hf(a.k_norm)
            self.v_norm = RMSNorm.from_hf(a.v_norm)
            self.scaling = float(a.scaling)
            m = hf_layer.mlp
            self.gate, self.up, self.down = (_linear(x) for x in (m.gate_proj, m.up_proj, m.down_proj))
            self.act = ACTIVATIONS[args.hidden_activation]
            self.norms = [RMSNorm.from_hf(getattr(hf_layer, n)) for n in (
                "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")]

        def attention(self, x, cos, sin, bias):
            P, nH, nKV, D = x.shape[1], args.num_attention_heads, args.num_key_value_heads, args.head_dim
            g = nH // nKV
            q = rope_2d(self.q_norm(self.q(x).view(1, P, nH, D)), cos, sin).transpose(1, 2)
            k = rope_2d(self.k_norm(self.k(x).view(1, P, nKV, D)), cos, sin).transpose(1, 2)
            v = self.v_norm(self.v(x).view(1, P, nKV, D)).transpose(1, 2)  # [1, KVH, P, D]
            # GQA without repeating K/V: head h = kvh·g + j reads kv head kvh (HF repeat_kv)
            q = q.reshape(1, nKV, g * P, D)
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling + bias  # [1, KVH, gP, P]
            out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [1, KVH, gP, D]
            out = out.reshape(1, nH, P, D).transpose(1, 2).reshape(1, P, nH * D)
            return self.o(out)

        def forward(self, x, cos, sin, bias):
            n_in, n_post_attn, n_pre_ff, n_post_ff = self.norms
            x = x + n_post_attn(self.attention(n_in(x), cos, sin, bias))
            h = n_pre_ff(x)
            return x + n_post_ff(self.down(self.act(self.gate(h)) * self.up(h)))

    class Graph(nn.Module):
        def __init__(self):
            super().__init__()
            tower, embed = hf.model.vision_tower, hf.model.embed_vision
            pe = tower.patch_embedder
            self.input_proj = pe.input_proj
            R = int(spec.params["position_rows"])
            table = pe.position_embedding_table.detach()[:, :R]  # [2, R, H]: reachable rows only
            self.register_buffer("pos_x", table[0].clone(), persistent=False)
            self.register_buffer("pos_y", table[1].clone(), persistent=False)
            self.layers = nn.ModuleList(Layer(lyr) for lyr in tower.encoder.layers)
            S, k = spec.max_soft_tokens, int(spec.params["pooling_kernel_size"])
            self.register_buffer("token_ids", torch.arange(S, dtype=torch.float32).view(1, S, 1),
                                 persistent=False)
            self.inv_k2 = 1.0 / k**2
            H = args.hidden_size
            if args.standardize:  # HF: (pooled·√H − b)·s == √H·(pooled − b/√H)·s
                self.register_buffer("std_bias", tower.std_bias.detach().float() / math.sqrt(H),
                                     persistent=False)
                self.register_buffer("std_scale", tower.std_scale.detach().float().clone(),
                                     persistent=False)
            # embed_vision's scale-free RMSNorm of √H·y equals that of y with eps/H: the √H
            # (whose product HF keeps in fp32 because it overflows fp16) never materializes
            self.pre_norm = RMSNorm(None, embed.eps / H)
            self.proj = embed.embedding_projection
            self.io = GraphIO(inputs=[(key, f"media:{key}") for key in INPUT_KEYS],
                              outputs=[("soft", "soft")])

        def forward(self, pixel_values, patch_pos, patch_valid, pool_index, rope_cos, rope_sin):
            # patch embedding: HF maps pixels [0, 1] -> [-1, 1] in model code
            h = self.input_proj(2.0 * (pixel_values - 0.5))  # [1, P, H]
            pos = self.pos_x[patch_pos[..., 0]] + self.pos_y[patch_pos[..., 1]]  # [1, P, H]
            h = h + pos * patch_valid.unsqueeze(-1)  # HF zeroes padding rows' position embedding
            cos, sin = rope_cos.unsqueeze(2), rope_sin.unsqueeze(2)  # [1, P, 1, D]
            bias = ((1.0 - patch_valid) * MASK_VALUE).view(1, 1, 1, -1)  # [1, 1, 1, P] keys
            for layer in self.layers:
                h = layer(h, cos, sin, bias)
            # HF pooler: mean of each k×k patch block; padding patches (index -1) weigh 0
            onehot = torch.relu(1.0 - torch.abs(self.token_ids - pool_index.unsqueeze(1)))
            pooled = torch.matmul(onehot * self.inv_k2, h)  # [1, S, P] · [1, P, H] -> [1, S, H]
            if args.standardize:
                pooled = (pooled - self.std_bias) * self.std_scale
            return self.proj(self.pre_norm(pooled))  # [1, S, H_text]

    return Graph().eval()


def GenieVisionNode(hf, args: Args, spec: EncoderSpec, row_tail: np.ndarray | None):
    """``VisionGraph`` behind Genie's image-encoder inputs (families/genienode.py)::

        pixel_values       [1, P, 3p²]  uint16 in the binary (Genie quantizes the host's f32)
        image_position_ids [1, P, 2] i32  (x, y) per patch, -1 on padding   } Genie fills them
        image_pooling_idx  [1, P] i32     x//k + (w/k)(y//k), 0 on padding  } from vision-param
        ─▶ valid = pos_x >= 0; patch_pos = max(pos, 0); pool_index -1 on padding; rope cos/sin
           gathered from tables of HF's float32 angles r · inv_freq (the host's own numbers)
        ─▶ VisionGraph ─▶ image_features [1, S, H_text (+ tail)]

    Padding patches take position 0's rope where the host gives position -1's: they are masked
    as keys and pooled with weight 0, so no valid row reads them."""
    torch, nn = _torch()
    from ..runtime.vision import Gemma4ImagePrep
    from .genienode import IMAGE_FEATURES

    graph = VisionGraph(hf, args, spec)
    rows = int(spec.params["position_rows"])
    angles = np.arange(rows, dtype=np.float32)[:, None] * Gemma4ImagePrep(spec.params).inv_freq

    class Node(nn.Module):
        def __init__(self):
            super().__init__()
            self.graph = graph
            self.register_buffer("cos_t", torch.from_numpy(np.cos(angles)), persistent=False)
            self.register_buffer("sin_t", torch.from_numpy(np.sin(angles)), persistent=False)
            tail = None if row_tail is None else torch.from_numpy(
                np.asarray(row_tail, np.float32)).view(1, 1, -1)
            self.register_buffer("tail", tail, persistent=False)
            self.io = GraphIO(inputs=[("pixel_values", "media:pixel_values"),
                                      ("image_position_ids", "genie:image_position_ids"),
                                      ("image_pooling_idx", "genie:image_pooling_idx")],
                              outputs=[(IMAGE_FEATURES, "soft")])

        def example_inputs(self):
            inputs = ENCODER.example_inputs(spec)
            pos = inputs["image_position_ids"].astype(np.int32)
            pool = np.maximum(inputs["pool_index"], 0).astype(np.int32)  # Genie: 0 on padding
            return (torch.from_numpy(inputs["pixel_values"]), torch.from_numpy(pos),
                    torch.from_numpy(pool))

        def forward(self, pixel_values, image_position_ids, image_pooling_idx):
            pos = image_position_ids
            valid = torch.clamp(pos[..., 0].float() + 1.0, 0.0, 1.0)  # [1, P]: 0 where x = -1
            patch_pos = torch.maximum(pos, torch.zeros((), dtype=torch.int32))
            pool_index = image_pooling_idx.float() * valid + (valid - 1.0)  # -1 on padding
            cx, cy = self.cos_t[patch_pos[..., 0]], self.cos_t[patch_pos[..., 1]]
            sx, sy = self.sin_t[patch_pos[..., 0]], self.sin_t[patch_pos[..., 1]]
            cos = torch.cat([cx, cx, cy, cy], dim=-1)  # [1, P, D]: the host's [x, x, y, y]
            sin = torch.cat([sx, sx, sy, sy], dim=-1)
            soft = self.graph(pixel_values, patch_pos, valid, pool_index, cos, sin)
            if self.tail is None:
                return soft
            return torch.cat([soft, self.tail.expand(1, soft.shape[1], -1)], dim=-1)

    return Node().eval()
