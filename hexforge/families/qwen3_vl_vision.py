"""Qwen3-VL vision tower (vision_config.model_type qwen3_vl_vision) as one fixed-resolution graph.
Qwen3.5's tower (qwen3_5_vision) is the same without the deepstack mergers: it comes here too.

HF's tower is data-dependent (grid_thw -> interpolation taps, rotary ids, cu_seqlens splits); for
one image at a resolution fixed at build time every one of those is a constant, so the build
computes them with HF's own helpers (``transformers.vision_utils``) and bakes the results::

    pixel_values [1, N, 3*tp*p*p]   (host: resize to H x W, normalize, temporal duplicate,
       │                             patchify in merge order; runtime/vision.py Qwen2VLImagePrep)
       ├─ patch embed: Conv3d with kernel = stride = patch  ==  one MatMul on the flat patch
       ├─ + pos      [N, C] const   learned 2-D table resampled bilinearly to the grid (baked)
       ├─ blocks x depth: LN ─ attention (2-D axial rope, cos/sin [N, hd] baked; one image = one
       │                   cu_seqlens segment = full attention, no mask) ─ + ─ LN ─ MLP ─ +
       │    └─ after block deepstack_visual_indexes[i]: deepstack merger i ─▶ deepstack:<i>
       └─ merger: LN(C) ─ view [N/m², m²C] ─ fc1 ─ GELU ─ fc2 ─▶ soft [1, S, H_text]

N = (H/p)(W/p) patches, S = N/m² soft tokens (m = spatial_merge_size). The merge order (each m x m
block's patches adjacent) is the host's patchify order, so the mergers are plain reshapes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers.vision_utils import (
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from ..bundle.errors import UnsupportedModelError
from ..bundle.manifest import EncoderSpec
from . import blocks
from .base import EncoderFamily
from .graphio import GraphIO

DEFAULT_SIZE = 512  # px per side, unless the learned position grid is natively smaller
# a prompt marks an image with the pad token; the host expands it to
# <|vision_start|> <|image_pad|> x S <|vision_end|> (begin_id / end_id), as HF's processor does
PLACEHOLDER_TEXT = "<|image_pad|>"


def _processor_config(hf) -> dict:
    """The checkpoint's preprocessor_config.json (mean/std, patch sizes), {} if it has none."""
    path = Path(getattr(hf, "name_or_path", "") or "") / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def default_size(vcfg, unit: int) -> tuple[int, int]:
    """512 x 512, or the learned position grid's native resolution if smaller (beyond it the
    table is upsampled); snapped down to a multiple of patch x merge."""
    native = math.isqrt(vcfg.num_position_embeddings) * vcfg.patch_size
    side = max(unit, min(DEFAULT_SIZE, native) // unit * unit)
    return side, side


class Qwen3VLVisionEncoder(EncoderFamily):
    modality = "image"

    def spec(self, hf, config: dict, image_size: int | tuple[int, int] | None = None
             ) -> EncoderSpec:
        """image_size: the fixed H x W every image is resized to (int = square); default
        ``default_size``. Must be a multiple of patch_size x spatial_merge_size."""
        from ..bundle.errors import UnsupportedModelError

        v = hf.model.visual.config
        m, p, tp = v.spatial_merge_size, v.patch_size, v.temporal_patch_size
        proc = _processor_config(hf)
        for key, want in (("patch_size", p), ("merge_size", m), ("temporal_patch_size", tp)):
            if key in proc and proc[key] != want:
                raise UnsupportedModelError(f"preprocessor_config.json {key}={proc[key]} differs "
                                            f"from the vision tower's {want}")
        unit = p * m
        if image_size is None:
            h, w = default_size(v, unit)
        else:
            h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
        if h % unit or w % unit or h <= 0 or w <= 0:
            raise UnsupportedModelError(f"Qwen3-VL image size {h}x{w} must be a positive multiple "
                                        f"of patch x merge = {unit}")
        params = {
            "height": h, "width": w, "patch_size": p, "temporal_patch_size": tp, "merge_size": m,
            # the Qwen3-VL repos ship mean = std = 0.5 (not the Qwen2-VL processor's CLIP default)
            "image_mean": [float(x) for x in proc.get("image_mean", [0.5] * 3)],
            "image_std": [float(x) for x in proc.get("image_std", [0.5] * 3)],
            "rescale_factor": float(proc.get("rescale_factor", 1 / 255)),
        }
        return EncoderSpec(
            name="vision", modality="image", preprocessor="qwen2vl_image", params=params,
            placeholder_id=int(config["image_token_id"]), placeholder_text=PLACEHOLDER_TEXT,
            begin_id=config.get("vision_start_token_id"), end_id=config.get("vision_end_token_id"),
            max_soft_tokens=(h // unit) * (w // unit))

    def encoder_module(self, hf, spec: EncoderSpec):
        return VisionGraph(hf.model.visual, spec)

    def example_inputs(self, spec: EncoderSpec) -> dict[str, np.ndarray]:
        """A synthetic non-square RGB image (smooth gradients + a checkerboard: every patch
        differs) through the runtime preprocessor."""
        from PIL import Image

        from ..runtime.vision import Qwen2VLImagePrep

        h, w = 3 * spec.params["height"] // 4 + 5, spec.params["width"] + 37
        y, x = np.mgrid[0:h, 0:w]
        rgb = np.stack([255 * x / w, 255 * y / h, 127 + 120 * ((x // 9 + y // 7) % 2 - 0.5)], -1)
        inputs, _ = Qwen2VLImagePrep(spec.params)(Image.fromarray(rgb.astype(np.uint8)))
        return inputs

    def genie_node(self, hf, spec: EncoderSpec, row_tail: np.ndarray | None):
        """The tower as Genie's image-encoder node (``GenieVisionNode``): pixels uint16 over the
        normalized range, the image's patch grid as the node's vision-param (Genie places the
        image tokens' M-RoPE positions from it: qwen3vl-mrope), the deepstack features as
        side outputs the text-generator takes by name (a WILDCARD connection); each image row
        ends with ``row_tail`` (the LUT's media flag, 1.0: ``GenieSpec.media_flag``)."""
        from .genienode import IMAGE_INPUT, GenieNodeForm

        if row_tail is None or row_tail.shape != (1,):
            raise UnsupportedModelError("Qwen3-VL's Genie LUT is the token embedding and its "
                                        "media flag: an image row's tail is the flag alone")
        p = spec.params
        lo = min((0.0 - m) / s for m, s in zip(p["image_mean"], p["image_std"], strict=True))
        hi = max((1.0 - m) / s for m, s in zip(p["image_mean"], p["image_std"], strict=True))
        patch = p["patch_size"]
        return GenieNodeForm(role="image-encoder", mode="image",
                             module=GenieVisionNode(self.encoder_module(hf, spec), row_tail),
                             fixed_point={"pixel_values": (lo, hi)},
                             feeds={"pixel_values": IMAGE_INPUT},
                             model={"vision-param": {"height": p["height"] // patch,
                                                     "width": p["width"] // patch}})

    def geniex_node(self, hf, spec: EncoderSpec, row_tail: np.ndarray | None):
        """The tower as GenieX's ``vision_encoder.bin`` (forge/genie/geniex.py): ``genie_node``'s
        graph with the plugin's position_ids_cos / _sin inputs (``GenieVisionNode`` rope)."""
        from dataclasses import replace

        form = self.genie_node(hf, spec, row_tail)
        return replace(form, module=GenieVisionNode(form.module.graph, row_tail, rope=True))

    def reference(self, hf, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """HF's tower on the same pixels: merged embeddings + each deepstack feature, [S, H]."""
        with torch.no_grad():
            out = hf.model.visual(torch.from_numpy(inputs["pixel_values"][0]),
                                  grid_thw=torch.from_numpy(inputs["image_grid_thw"]))
        ref = {"soft": out.pooler_output.float().numpy()}
        for i, feat in enumerate(getattr(out, "deepstack_features", None) or []):  # Qwen3.5: none
            ref[f"deepstack:{i}"] = feat.float().numpy()
        return ref


# ---- export module (torch) -----------------------------------------------------------------------


class Block(nn.Module):
    """HF Qwen3VLVisionBlock on its own modules; full attention over the N patches."""

    def __init__(self, hf_blk: nn.Module, heads: int, act):
        super().__init__()
        self.norm1, self.norm2 = hf_blk.norm1, hf_blk.norm2
        self.qkv, self.proj = hf_blk.attn.qkv, hf_blk.attn.proj
        self.fc1, self.fc2 = hf_blk.mlp.linear_fc1, hf_blk.mlp.linear_fc2
        self.heads, self.scaling, self.act = heads, hf_blk.attn.scaling, act

    def forward(self, x, cos, sin):  # x [1, N, C]; cos/sin [1, 1, N, hd]
        N, C = x.shape[1], x.shape[2]
        qkv = self.qkv(self.norm1(x)).view(1, N, 3, self.heads, C // self.heads)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [1, nh, N, hd]
        q, k = blocks.apply_rope(q, cos, sin), blocks.apply_rope(k, cos, sin)
        probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scaling, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(1, N, C)
        x = x + self.proj(out)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Merger(nn.Module):
    """HF Qwen3VLVisionPatchMerger: m² adjacent patches -> one text-width token. The main merger
    normalizes per patch before the view, the deepstack ones after it (use_postshuffle_norm)."""

    def __init__(self, hf_merger: nn.Module):
        super().__init__()
        self.norm, self.fc1, self.fc2 = hf_merger.norm, hf_merger.linear_fc1, hf_merger.linear_fc2
        self.post = hf_merger.use_postshuffle_norm
        self.width = hf_merger.hidden_size  # m² C

    def forward(self, x):  # [1, N, C] -> [1, S, H_text]
        if not self.post:
            x = self.norm(x)
        x = x.reshape(1, -1, self.width)
        if self.post:
            x = self.norm(x)
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))  # HF nn.GELU(): exact erf


class VisionGraph(nn.Module):
    """The tower for one image of spec's fixed size: pixel_values [1, N, D] -> soft [1, S, H],
    deepstack_<i> [1, S, H]."""

    def __init__(self, visual: nn.Module, spec: EncoderSpec):
        super().__init__()
        p = spec.params
        m, patch = p["merge_size"], p["patch_size"]
        gh, gw = p["height"] // patch, p["width"] // patch
        grid = torch.tensor([[1, gh, gw]])
        with torch.no_grad():  # the grid-derived inputs, once, with HF's own helpers
            idx, w = get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
                align_corners=visual.interpolation_align_corners, spatial_merge_size=m)
            pos = (visual.pos_embed(idx) * w[:, :, None]).sum(1)  # [N, C], merge order
            cos, sin = visual.rotary_pos_emb(pos, get_vision_position_ids(grid, m))  # [N, hd]
        self.register_buffer("pos", pos[None].float().clone())
        self.register_buffer("cos", cos[None, None].float().clone())
        self.register_buffer("sin", sin[None, None].float().clone())
        conv = visual.patch_embed.proj  # Conv3d, kernel = stride: a Linear on the flat patch
        self.patch_w = nn.Parameter(conv.weight.detach().reshape(conv.weight.shape[0], -1),
                                    requires_grad=False)  # [C, 3 tp p p], (c, t, y, x) order
        self.patch_b = conv.bias
        cfg = visual.config
        act = blocks.ACTIVATIONS.get(cfg.hidden_act) or visual.blocks[0].mlp.act_fn
        self.blocks = nn.ModuleList([Block(b, cfg.num_heads, act) for b in visual.blocks])
        self.merger = Merger(visual.merger)
        # Qwen3.5's tower deletes both attributes: no deepstack features
        indexes = getattr(visual, "deepstack_visual_indexes", [])
        self.deepstack = {int(layer): i for i, layer in enumerate(indexes)}
        self.ds_mergers = nn.ModuleList([Merger(x) for x in getattr(visual, "deepstack_merger_list",
                                                                    [])])
        self.n_patches, self.patch_dim = gh * gw, self.patch_w.shape[1]
        self.grid, self.merge = (gh, gw), m
        self.io = GraphIO(inputs=[("pixel_values", "media:pixel_values")],
                          outputs=[("soft", "soft")] + [(f"deepstack_{i}", f"deepstack:{i}")
                                                        for i in range(len(self.ds_mergers))])

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return (torch.randn(1, self.n_patches, self.patch_dim),)

    def forward(self, pixel_values, cos=None, sin=None):
        """``cos`` / ``sin`` [1, 1, N, hd]: the rope from outside (GenieX's inputs), else the
        baked tables."""
        cos = self.cos if cos is None else cos
        sin = self.sin if sin is None else sin
        x = torch.nn.functional.linear(pixel_values, self.patch_w, self.patch_b) + self.pos
        feats = []
        for layer, blk in enumerate(self.blocks):
            x = blk(x, cos, sin)
            if layer in self.deepstack:
                feats.append(self.ds_mergers[self.deepstack[layer]](x))
        return (self.merger(x), *feats)


class GenieVisionNode(nn.Module):
    """``VisionGraph`` with Genie's tensor names, as the text-generator's inputs take them (a
    WILDCARD connection matches names and ranks)::

        pixel_values [1, N, 3·tp·p²] (uint16 in the binary) ─▶ image_features [S, H_text + 1],
                                                               deepstack_visual_embeds_<i>
                                                                 [1, S, H_text + 1]

    image_features' last column is the LUT's media flag, 1.0: the decoder adds the deepstack
    rows where it is set (Genie leaves the other rows of those inputs unwritten). The deepstack
    rows end in a 0.0 column the decoder does not read: GenieX's plugin takes every row of
    inputs_embeds, image_features and the deepstack tensors at one width (forge/genie/geniex.py).

    ``rope``: GenieX's form (``vision_encoder.bin``): two more inputs, position_ids_cos / _sin
    [N, 32], the 2-D rope the plugin computes for a 64-wide head (models/qwen3_vl/qwen3_vl.h
    kVitRopeDim = 32: cos(h f_j) j < 16, then cos(w f_j), f_j = 1e4^(-j/16)); the tower's own
    rope (d = head_dim / 2 dims, f'_i = theta^(-2i/d)) is read from their columns 32 i / d."""

    def __init__(self, graph: VisionGraph, row_tail: np.ndarray, rope: bool = False):
        super().__init__()
        from .genienode import IMAGE_FEATURES

        self.graph = graph
        self.register_buffer("tail", torch.from_numpy(np.asarray(row_tail, np.float32)).view(1, -1),
                             persistent=False)
        self.rope = rope
        inputs = [("pixel_values", "media:pixel_values")]
        if rope:
            d = graph.cos.shape[-1] // 2  # the tower's rotary dims per axis pair
            if GENIEX_ROPE % d or d % 2:
                raise UnsupportedModelError(
                    f"the vision tower's rope ({d} dims) is not a part of the {GENIEX_ROPE}-dim "
                    "2-D rope GenieX's Qwen3-VL plugin computes")
            step = GENIEX_ROPE // d
            cols = [step * i for i in range(d // 2)]
            cols = cols + [GENIEX_ROPE // 2 + c for c in cols]
            self.register_buffer("cols", torch.tensor(cols + cols), persistent=False)
            inputs += [("position_ids_cos", "vision:cos"), ("position_ids_sin", "vision:sin")]
        self.io = GraphIO(inputs=inputs,
                          outputs=[(IMAGE_FEATURES, "soft")] + [
                              (f"{DEEPSTACK}{i}", f"deepstack:{i}")
                              for i in range(len(graph.ds_mergers))])

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        px = self.graph.example_inputs()
        if not self.rope:
            return px
        cos, sin = geniex_vision_rope(self.graph.grid, self.graph.merge)
        return (*px, torch.from_numpy(cos), torch.from_numpy(sin))

    def forward(self, pixel_values, cos=None, sin=None):
        if self.rope:  # [N, 32] -> the tower's [1, 1, N, hd]
            cos = cos.index_select(1, self.cols).view(self.graph.cos.shape)
            sin = sin.index_select(1, self.cols).view(self.graph.sin.shape)
        soft, *deep = (x[0] for x in self.graph(pixel_values, cos, sin))
        pad = torch.zeros(1, soft.shape[0], 1, dtype=soft.dtype)
        return (torch.cat([soft, self.tail.expand(soft.shape[0], -1)], dim=-1),
                *(torch.cat([x.unsqueeze(0), pad], dim=-1) for x in deep))


GENIEX_ROPE = 32  # the plugin's kVitRopeDim: its position_ids_cos / _sin width


def geniex_vision_rope(grid: tuple[int, int], merge: int) -> tuple[np.ndarray, np.ndarray]:
    """What GenieX's plugin writes to a Qwen3-VL vision graph's position_ids_cos / _sin for one
    image of ``grid`` (h, w) patches (core/src/vlm/vit_utils.cpp computePatchRoPE with
    makeInvFreq(32, 1e4)): per patch in merge order (block row, block col, row, col in the
    block) cos / sin of h f_j, then of w f_j, j < 16, [N, 32] float32."""
    gh, gw = grid
    inv = 1.0 / 10000.0 ** (np.arange(0, GENIEX_ROPE, 2, dtype=np.float64) / GENIEX_ROPE)
    hs, ws = [], []
    for br in range(gh // merge):
        for bc in range(gw // merge):
            for ir in range(merge):
                for ic in range(merge):
                    hs.append(br * merge + ir)
                    ws.append(bc * merge + ic)
    ang = np.concatenate([np.outer(hs, inv), np.outer(ws, inv)], axis=1).astype(np.float32)
    return np.cos(ang), np.sin(ang)


DEEPSTACK = "deepstack_visual_embeds_"  # + i: AI Hub's Qwen3-VL tensor names, Genie routes them
ENCODER = Qwen3VLVisionEncoder()
