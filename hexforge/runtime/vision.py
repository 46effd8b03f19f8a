"""Host image preprocessing (numpy + pillow, no torch): decoded image -> vision graph inputs.

Each class takes its EncoderSpec params and maps a PIL RGB image (runtime/media.py load_image) to
``({input key: array [1, ...] fixed shape}, n soft tokens)``, exactly as the HF image processor.
"""

from __future__ import annotations

import numpy as np

# ---- Gemma-4 (transformers Gemma4ImageProcessorPil) ----------------------------------------------
#
#   RGB image ─resize (aspect kept, sides multiples of k·p, ≤ max_patches = S·k² patches)─▶ /255
#     ─patchify─▶ pixel_values [1, P, 3p²] (zero rows past the image: P = max_patches, fixed)
#     position ids (x, y) per patch, (-1, -1) on padding rows (HF's image_position_ids)
#   plus what the static graph reads instead of data-dependent indexing (families/gemma4_vision.py):
#     patch_pos  [1, P, 2] int32   (x, y) clamped >= 0: rows of the 2-D position-embedding gathers
#     patch_valid [1, P] f32       1 on image patches, 0 on padding (attention key mask)
#     pool_index [1, P] f32        pooled token each patch averages into, -1 on padding
#     rope_cos / rope_sin [1, P, D] f32  HF's axial 2-D RoPE, made in fp32 here: on the HTP's fp16
#                                  an angle like 200 rad has a 0.125 ulp, so cos/sin in-graph break

GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # HF Gemma4ImageProcessor's supported budgets


def gemma4_target_size(height: int, width: int, patch_size: int, max_patches: int,
                       pooling_kernel_size: int) -> tuple[int, int]:
    """HF ``get_aspect_ratio_preserving_size``, line for line (same float math, same branches):
    the largest (height, width), multiples of k·p, with at most max_patches patches."""
    import math

    from ..bundle.errors import MediaError

    total_px = height * width
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / total_px)
    side = pooling_kernel_size * patch_size
    th = math.floor(factor * height / side) * side
    tw = math.floor(factor * width / side) * side
    if th == 0 and tw == 0:
        raise MediaError(f"a {width}x{height} image cannot be resized to a non-empty multiple of "
                         f"{side} pixels")
    max_side = (max_patches // pooling_kernel_size**2) * side
    if th == 0:  # very wide: one pooled row, as wide as the ratio allows
        th, tw = side, min(math.floor(width / height) * side, max_side)
    elif tw == 0:  # very tall
        tw, th = side, min(math.floor(height / width) * side, max_side)
    if th * tw > target_px:
        raise MediaError(f"a {width}x{height} image resized to {tw}x{th} exceeds {max_patches} "
                         f"patches of {patch_size} pixels")
    return th, tw


class Gemma4ImagePrep:
    """transformers ``Gemma4ImageProcessorPil`` (do_resize, rescale 1/255, no normalization: the
    model maps pixels to [-1, 1] itself) + the static vision graph's index inputs.

    params: patch_size, max_soft_tokens, pooling_kernel_size (the processor's), head_dim and
    rope_theta (the vision tower's axial RoPE), position_rows (rows of the graph's position
    table), resample (PIL filter id, HF default 3 = BICUBIC), rescale_factor (1/255)."""

    def __init__(self, params: dict):
        from ..bundle.errors import BundleError

        def get(name: str, kind: type | tuple[type, ...], default=None):
            value = params.get(name, default)
            if value is None or isinstance(value, bool) or not isinstance(value, kind):
                what = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
                raise BundleError(f"gemma4_image: parameter {name} must be a {what}, "
                                  f"got {value!r}")
            return value

        self.patch_size: int = get("patch_size", int)
        self.max_soft_tokens: int = get("max_soft_tokens", int)
        self.k: int = get("pooling_kernel_size", int)
        self.head_dim: int = get("head_dim", int)
        self.rope_theta = float(get("rope_theta", (int, float)))
        self.position_rows: int = get("position_rows", int)
        self.resample: int = get("resample", int, 3)
        self.rescale = float(get("rescale_factor", (int, float), 1 / 255))
        if self.max_soft_tokens not in GEMMA4_SOFT_TOKENS:
            raise BundleError(f"gemma4_image: max_soft_tokens must be one of {GEMMA4_SOFT_TOKENS} "
                              f"(as HF's processor), got {self.max_soft_tokens}")
        if min(self.patch_size, self.k, self.position_rows) < 1 or self.head_dim % 4:
            raise BundleError(f"gemma4_image: bad parameters {params!r}")
        self.max_patches = self.max_soft_tokens * self.k**2
        # HF axial RoPE: one frequency set over head_dim // 2 channels, shared by x and y
        half = self.head_dim // 2
        self.inv_freq = (1.0 / self.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half)
                         ).astype(np.float32)  # [D/4], HF's float32 torch math

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return gemma4_target_size(height, width, self.patch_size, self.max_patches, self.k)

    def __call__(self, image) -> tuple[dict[str, np.ndarray], int]:
        from PIL import Image

        from ..bundle.errors import MediaError

        if not isinstance(image, Image.Image) or image.mode != "RGB":
            raise MediaError("gemma4_image expects a decoded RGB image (runtime/media.py load_image)")
        w, h = image.size
        if w < 1 or h < 1:
            raise MediaError(f"the image is empty ({w}x{h})")
        th, tw = self.target_size(h, w)
        p, k = self.patch_size, self.k
        hp, wp = th // p, tw // p  # patch grid
        if max(hp, wp) > self.position_rows:  # HF would index past its position table
            raise MediaError(f"a {w}x{h} image needs {max(hp, wp)} patches along one side; this "
                             f"model's position table has {self.position_rows} (aspect ratio too "
                             "extreme: crop it)")
        if (th, tw) != (h, w):  # HF: image_transforms.resize -> PIL resize, reducing_gap None
            image = image.resize((tw, th), resample=self.resample, reducing_gap=None)
        # HF rescale: float64 multiply, then float32
        pixels = (np.asarray(image, dtype=np.uint8).astype(np.float64) * self.rescale
                  ).astype(np.float32)  # [th, tw, 3]
        n_patches = hp * wp
        # HF patch layout: (y, x) row-major patches, each flattened (py, px, c)
        patches = pixels.reshape(hp, p, wp, p, 3).transpose(0, 2, 1, 3, 4).reshape(n_patches, -1)
        P = self.max_patches
        pixel_values = np.zeros((1, P, 3 * p * p), np.float32)
        pixel_values[0, :n_patches] = patches
        gy, gx = np.divmod(np.arange(n_patches), wp)  # patch i = (y, x) with i = y·wp + x
        position_ids = np.full((1, P, 2), -1, np.int64)
        position_ids[0, :n_patches, 0] = gx
        position_ids[0, :n_patches, 1] = gy
        valid = np.zeros((1, P), np.float32)
        valid[0, :n_patches] = 1.0
        # HF pooler: token (x // k) + (wp // k) · (y // k), row-major over the pooled grid, so the
        # n real tokens are rows 0..n-1 of the pooled output
        pool_index = np.full((1, P), -1.0, np.float32)
        pool_index[0, :n_patches] = gx // k + (wp // k) * (gy // k)
        n_soft = n_patches // k**2
        # HF Gemma4VisionRotaryEmbedding: angles pos · inv_freq per axis (padding: pos -1, as HF),
        # laid out [x, x, y, y] quarters of head_dim
        freqs = position_ids[0, :, :, None].astype(np.float32) * self.inv_freq  # [P, 2, D/4]
        fx, fy = freqs[:, 0], freqs[:, 1]
        angles = np.concatenate([fx, fx, fy, fy], axis=-1)[None]  # [1, P, D]
        inputs = {
            "pixel_values": pixel_values,
            "image_position_ids": position_ids,
            "patch_pos": np.maximum(position_ids, 0).astype(np.int32),
            "patch_valid": valid,
            "pool_index": pool_index,
            "rope_cos": np.cos(angles).astype(np.float32),
            "rope_sin": np.sin(angles).astype(np.float32),
        }
        return inputs, n_soft


# ---- Qwen2-VL / Qwen3-VL (transformers Qwen2VLImageProcessorPil) ---------------------------------
#
#   RGB image ─resize to the build's fixed H x W (PIL, bicubic; aspect not kept: one static graph)─▶
#     x/255, (x - mean)/std ─▶ [3, H, W] ─duplicated temporal_patch_size times (a still image is
#     a 2-frame clip to the Conv3d patch embed)─▶ patches in *merge order*: the m x m patches of
#     each merged token adjacent, merged tokens row-major ─▶ pixel_values [1, N, 3·tp·p²]
#   plus image_grid_thw [1, 3] = (1, H/p, W/p), HF's name: the oracle and M-RoPE positions read it.


class Qwen2VLImagePrep:
    """transformers ``Qwen2VLImageProcessorPil`` at one fixed size (its smart_resize replaced by
    the build's H x W): resize, rescale, normalize, temporal duplicate, patchify.

    params: height, width (multiples of patch_size x merge_size), patch_size, temporal_patch_size,
    merge_size, image_mean, image_std (3 floats each), rescale_factor (1/255), resample (PIL
    filter id, HF default 3 = BICUBIC)."""

    def __init__(self, params: dict):
        from ..bundle.errors import BundleError

        def get(name: str, kind: type | tuple, default=None):
            value = params.get(name, default)
            if value is None or isinstance(value, bool) or not isinstance(value, kind):
                raise BundleError(f"qwen2vl_image: parameter {name} must be a {kind}, got {value!r}")
            return value

        self.height: int = get("height", int)
        self.width: int = get("width", int)
        self.patch: int = get("patch_size", int)
        self.tp: int = get("temporal_patch_size", int)
        self.merge: int = get("merge_size", int)
        self.resample: int = get("resample", int, 3)
        self.rescale = float(get("rescale_factor", (int, float), 1 / 255))
        mean, std = get("image_mean", list), get("image_std", list)
        if len(mean) != 3 or len(std) != 3 or not all(isinstance(x, int | float) and x > 0
                                                       for x in std):
            raise BundleError(f"qwen2vl_image: image_mean / image_std must be 3 numbers (std > 0), "
                              f"got {mean!r} / {std!r}")
        # HF normalize: float32 mean/std arrays, (x - mean) / std in float32
        self.mean = np.asarray(mean, np.float32)
        self.std = np.asarray(std, np.float32)
        unit = self.patch * self.merge
        if min(self.height, self.width, self.patch, self.tp, self.merge) < 1 or (
                self.height % unit or self.width % unit):
            raise BundleError(f"qwen2vl_image: {self.height}x{self.width} must be positive "
                              f"multiples of patch x merge = {unit}")

    @property
    def grid(self) -> tuple[int, int, int]:
        """(t, h, w) in patches, as HF's image_grid_thw."""
        return 1, self.height // self.patch, self.width // self.patch

    @property
    def n_soft(self) -> int:
        _, gh, gw = self.grid
        return gh * gw // self.merge**2

    def __call__(self, image) -> tuple[dict[str, np.ndarray], int]:
        from PIL import Image

        from ..bundle.errors import MediaError

        if not isinstance(image, Image.Image) or image.mode != "RGB":
            raise MediaError("qwen2vl_image expects a decoded RGB image (runtime/media.py "
                             "load_image)")
        if min(image.size) < 1:
            raise MediaError(f"the image is empty ({image.size[0]}x{image.size[1]})")
        H, W, p, m = self.height, self.width, self.patch, self.merge
        if image.size != (W, H):  # HF: image_transforms.resize -> PIL resize, reducing_gap None
            image = image.resize((W, H), resample=self.resample, reducing_gap=None)
        # HF rescale: float64 multiply, then float32; normalize in float32
        x = (np.asarray(image, dtype=np.uint8).astype(np.float64) * self.rescale).astype(np.float32)
        x = ((x - self.mean) / self.std).transpose(2, 0, 1)  # [3, H, W]
        _, gh, gw = self.grid
        # HF patchify: (c, gh/m, m, p, gw/m, m, p) -> (gh/m, gw/m, m, m, c, p, p), then a temporal
        # axis before (p, p): each patch flattens as (c, t, py, px), the Conv3d kernel's order
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], self.tp, p, p))
        pixel_values = np.ascontiguousarray(x.reshape(1, gh * gw, 3 * self.tp * p * p))
        grid = np.asarray([self.grid], np.int64)
        return {"pixel_values": pixel_values, "image_grid_thw": grid}, self.n_soft
