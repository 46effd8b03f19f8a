"""onnxruntime contrib ops as single ONNX nodes from either exporter (cpu graphs only: the HTP
has none of them), with their eager math, and the rope they share with the HTP graphs.

    rotary_embedding       com.microsoft RotaryEmbedding      on the step's host tables
    simplified_layer_norm  SimplifiedLayerNormalization       one node, not seven
    group_query_attention  com.microsoft GroupQueryAttention  on the KV cache in place
                                                              (optionally with the rope inside)
    linear_attention_gate  com.microsoft LinearAttentionGate  its decay and beta
    linear_attention       com.microsoft LinearAttention      its gated delta rule, T >= 1
    leading_rows           Slice                              a run-time number of cache rows
    fast_gelu              com.microsoft FastGelu             gelu (tanh approximation)

Not used: CausalConvWithState (GatedDeltaNet's short conv) and GatedRMSNorm (its per-head norm
x SiLU(z)): they took 3x and ~8x the time of the plain nodes that replace them
(qwen3_5.GatedDeltaNet._forward_cpu; docs/notes/measurements.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, H, T, D]; cos/sin [1, 1, T, R] with R <= D (partial rotary: the first R dims rotate)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)


class _RotaryEmbeddingOp(torch.autograd.Function):
    """The op for the torchscript exporter (its symbolic: the reshapes to and from the op's
    [1, T, H*D] layout included — traced outside it, they broke the exporter's peephole pass on
    Gemma-4 graphs); eager: ``apply_rope``. x [1, T, H, D], or [1, T, H*D] when ``flat``."""

    @staticmethod
    def forward(ctx, x, positions, cos_half, sin_half, rot, T, H, D, flat):
        cos, sin = (torch.cat((t, t), -1)[positions[0]][None, None] for t in (cos_half, sin_half))
        x4 = x.reshape(1, T, H, D)
        return apply_rope(x4.transpose(1, 2), cos, sin).transpose(1, 2).reshape(x.shape)

    @staticmethod
    def symbolic(g, x, positions, cos_half, sin_half, rot, T, H, D, flat):
        extra = {"rotary_embedding_dim_i": rot} if rot else {}
        inp = x if flat else g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([1, T, H * D])))
        out = g.op("com.microsoft::RotaryEmbedding", inp, positions, cos_half, sin_half,
                   num_heads_i=H, **extra)
        if not flat:
            out = g.op("Reshape", out, g.op("Constant", value_t=torch.tensor([1, T, H, D])))
        out.setType(x.type())
        return out


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     heads: int | None = None) -> torch.Tensor:
    """``apply_rope`` as onnxruntime's fused com.microsoft RotaryEmbedding (cpu graphs: one node,
    not six). x [1, T, H, D], or the op's own flat [1, T, H*D] with ``heads`` = H -> the same
    layout, rotated (on [1, H, T, D] transposes were left around it: +82 per step at
    Qwen3-0.6B). The step's own host-made tables serve as its cache, row t for query t, so any
    position rule the host applies (M-RoPE, offsets) holds; cos/sin [1, 1, T, R] are in
    rotate-half layout (equal halves: the op takes one)."""
    flat = x.dim() == 3
    T, R = int(x.shape[1]), int(cos.shape[-1])  # static: python ints
    H = int(heads) if flat else int(x.shape[2])
    D = int(x.shape[-1]) // H if flat else int(x.shape[3])
    positions = torch.arange(T, dtype=torch.int64)[None]  # [1, T]
    cos_half, sin_half = cos[0, 0, :, :R // 2], sin[0, 0, :, :R // 2]  # [T, R/2]
    rot = R if R < D else 0  # partial rotary: the rotated width
    if torch.jit.is_tracing():  # the torchscript exporter
        return _RotaryEmbeddingOp.apply(x, positions, cos_half, sin_half, rot, T, H, D, flat)
    if not torch.onnx.is_in_onnx_export():  # eager
        return _RotaryEmbeddingOp.forward(None, x, positions, cos_half, sin_half, rot, T, H, D,
                                          flat)
    out = torch.onnx.ops.symbolic(  # dynamo
        "com.microsoft::RotaryEmbedding", [x.reshape(1, T, H * D), positions, cos_half, sin_half],
        {"num_heads": H, **({"rotary_embedding_dim": rot} if rot else {})},
        dtype=x.dtype, shape=(1, T, H * D), version=1)
    return out if flat else out.reshape(1, T, H, D)


class _SimplifiedLayerNormOp(torch.autograd.Function):
    """The op for the torchscript exporter (its symbolic); eager: the same math."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    @staticmethod
    def symbolic(g, x, weight, eps):
        out = g.op("SimplifiedLayerNormalization", x, weight, axis_i=-1, epsilon_f=eps,
                   stash_type_i=1)
        out.setType(x.type())
        return out


def simplified_layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight as onnxruntime's fused SimplifiedLayerNormalization
    (one node, not seven: cpu graphs only — the HTP has no such op)."""
    if torch.jit.is_tracing():  # the torchscript exporter
        return _SimplifiedLayerNormOp.apply(x, weight, eps)
    if torch.onnx.is_in_onnx_export():  # dynamo
        return torch.onnx.ops.symbolic(
            "::SimplifiedLayerNormalization", [x, weight],
            dict(axis=-1, epsilon=float(eps), stash_type=1), dtype=x.dtype, shape=x.shape,
            version=1)
    return _SimplifiedLayerNormOp.forward(None, x, weight, eps)


class _LeadingRowsOp(torch.autograd.Function):
    """The op for the torchscript exporter (its symbolic: one Slice with a run-time end, the
    axis left without a size so that nothing downstream folds it); eager: ``narrow``."""

    @staticmethod
    def forward(ctx, x, n, axis):
        return x.narrow(axis, 0, int(n))

    @staticmethod
    def symbolic(g, x, n, axis):
        const = lambda v: g.op("Constant", value_t=torch.tensor([v]))  # noqa: E731  [1] int64
        out = g.op("Slice", x, const(0), n, const(axis))
        sizes = x.type().sizes()
        sizes[axis] = None
        out.setType(x.type().with_sizes(sizes))
        return out


def leading_rows(x: torch.Tensor, n: torch.Tensor, axis: int) -> torch.Tensor:
    """x's first ``n`` ([1] int64, a graph value) entries along ``axis``: a Slice whose length is
    known only when the graph runs (cpu graphs: attention over the ring rows that hold a
    position, ``gemma4.Gemma4Shard`` with cpu=True). Eager or the torchscript exporter only: see
    ``run_time_sizes``."""
    if torch.jit.is_tracing():  # the torchscript exporter
        return _LeadingRowsOp.apply(x, n, axis)
    return _LeadingRowsOp.forward(None, x, n, axis)


def run_time_sizes() -> bool:
    """Whether this forward may make a size known only at run time (``leading_rows``): not under
    the dynamo exporter, whose fake tensors need every size when it traces."""
    return torch.jit.is_tracing() or not (torch.onnx.is_in_onnx_export()
                                          or torch.compiler.is_compiling())


class _GroupQueryAttentionOp(torch.autograd.Function):
    """The op for the torchscript exporter (its symbolic); eager values are placeholders.
    ``rotary``: (cos_cache, sin_cache, position_ids) or () — with it the op rotates q and k."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total, num_heads, kv_num_heads, scale,
                *rotary):
        return torch.zeros_like(q), torch.zeros_like(past_k), torch.zeros_like(past_v)

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total, num_heads, kv_num_heads, scale,
                 *rotary):
        extra = {"do_rotary_i": 1} if rotary else {}
        outs = g.op("com.microsoft::GroupQueryAttention", q, k, v, past_k, past_v, seqlens_k,
                    total, *rotary, num_heads_i=num_heads, kv_num_heads_i=kv_num_heads,
                    scale_f=scale, outputs=3, **extra)
        for out, like in zip(outs, (q, past_k, past_v), strict=True):
            out.setType(like.type())  # static shapes downstream: constant-folded reshapes
        return outs


def group_query_attention(q, k, v, past_k, past_v, seqlens_k, total, num_heads: int,
                          kv_num_heads: int, scale: float, rotary: tuple = ()):
    """onnxruntime's com.microsoft GroupQueryAttention as one ONNX node, from either exporter:
    q [1,T,nH*D], k/v [1,T,KVH*D], past [1,KVH,C,D], seqlens_k [1] int32, total [] int32
    -> (out [1,T,nH*D], present_k, present_v [1,KVH,C,D]). ``rotary`` = (cos_cache, sin_cache
    [>= total, R/2], position_ids [1, T] int64): the op applies the rope to q and k itself
    (``do_rotary``). Export-only: eager values are zeros."""
    if torch.jit.is_tracing():  # the torchscript exporter
        return _GroupQueryAttentionOp.apply(q, k, v, past_k, past_v, seqlens_k, total, num_heads,
                                            kv_num_heads, scale, *rotary)
    return torch.onnx.ops.symbolic_multi_out(
        "com.microsoft::GroupQueryAttention", [q, k, v, past_k, past_v, seqlens_k, total, *rotary],
        dict(num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale,
             **({"do_rotary": 1} if rotary else {})),
        dtypes=[q.dtype, past_k.dtype, past_v.dtype],
        shapes=[list(q.shape), list(past_k.shape), list(past_v.shape)], version=1)


def gqa_rotary(cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rows: int,
               lengths: CacheLengths) -> tuple:
    """GroupQueryAttention's own rope inputs for the step's host tables cos/sin [1, 1, T, R], or
    () where the op cannot take them (its kernel wants R/2 a multiple of 8). Made once per shard
    and table (``lengths.rotary``), not two RotaryEmbedding nodes a layer (56 of a Qwen3-0.6B
    step). The op checks that its tables hold at least ``total`` rows, so they span the cache.

    - ``lengths.tables`` set (a 1-D rope whose positions are the cache rows): the whole table
      as a constant, and no position_ids — the op reads row seqlens_k - T + 1 + t for query t,
      which is that token's position. Nothing is made per step (onnxruntime-genai's form).
    - else (M-RoPE, or positions the host shifts): the step's own rows, padded, with query t
      reading row t — any position rule the host applies holds::

        step tables  [T, R/2] ─Concat zeros─▶ [C, R/2] ─┐
        position_ids [[0 .. T-1]] ──────────────────────┴─▶ GroupQueryAttention(do_rotary=1)

    Why the first: the Concat writes 2 x C x R/2 floats a step (512 KB at Qwen3-0.6B, C = 1024),
    with 8 more small nodes; nothing is made per step, as in genai's graph. The gain is within
    the noise (docs/notes/measurements.md): the form is kept for being the simpler step."""
    T, R = int(cos.shape[2]), int(cos.shape[-1])
    if R > head_dim or (R // 2) % 8:
        return ()
    made = lengths.rotary.get(id(cos))
    if made is None and lengths.tables is not None:
        table_cos, table_sin = lengths.tables
        if table_cos.shape[0] < rows or table_cos.shape[1] != R:
            raise ValueError(f"rope tables {list(table_cos.shape)} do not cover {rows} cache rows "
                             f"of {R} rotary dims")
        made = lengths.rotary[id(cos)] = (table_cos[:rows, :R // 2].contiguous(),
                                          table_sin[:rows, :R // 2].contiguous())
    elif made is None:
        # rows past T as a constant Concat (the exporter's Pad left a Transpose-Slice-Cast chain
        # making its pads)
        zeros = torch.zeros(rows - T, R // 2, dtype=cos.dtype)
        made = lengths.rotary[id(cos)] = (
            *(torch.cat((t[0, 0, :, :R // 2], zeros)) for t in (cos, sin)),
            torch.arange(T, dtype=torch.int64)[None])
    return made


@dataclass
class CacheLengths:
    """Stands in for the ``mask:full`` tensor in cpu graphs (``InPlaceCache``): the cache
    rows that hold a position once this step is written (a full cache holds position p at row p)."""

    seqlens_k: torch.Tensor  # [1] int32: rows held after the step - 1 (GroupQueryAttention's)
    total: torch.Tensor  # [] int32: rows held after the step
    presents: list = field(default_factory=list)  # (cache input, its present output), call order
    rotary: dict = field(default_factory=dict)  # id(host cos table) -> gqa_rotary's inputs
    # (cos, sin) [>= C, R] constant: the shard's one rope, where a token's position is its cache
    # row (1-D positions), as the host computes it (``runtime.host.rope_tables``); else None
    tables: tuple[torch.Tensor, torch.Tensor] | None = None


# ---- GatedDeltaNet (Qwen3.5) as four contrib ops ---------------------------------------------------
# Written out, a linear layer's decode step is ~95 nodes (conv as K shifted multiply-adds, the key
# heads expanded to the value heads, l2 norms, softplus gate, the delta-rule matmuls, the gated
# norm); with these, 13, and LinearAttention writes the state in place
# (``qwen3_5.Qwen35Family.cpu_step_module``), which is where the decode gains (docs/notes/measurements.md).


class _ContribOp(torch.autograd.Function):
    """One com.microsoft node for the torchscript exporter (its symbolic). Non-tensor arguments:
    the op name, its attributes as (key, value) pairs, for each output the index of the input
    whose type it has. Traced values are placeholders (the tracer broke on the eager math of
    a Function's forward: "Argument passed to at() was not in the map"); eager is ``_EAGER``."""

    @staticmethod
    def forward(ctx, name, attrs, likes, *inputs):
        outs = tuple(torch.zeros_like(inputs[i]) for i in likes)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def symbolic(g, name, attrs, likes, *inputs):
        suffix = {int: "_i", float: "_f", str: "_s"}
        kw = {k + suffix[type(v)]: v for k, v in attrs}
        outs = g.op(f"com.microsoft::{name}", *inputs, outputs=len(likes), **kw)
        outs = outs if isinstance(outs, tuple | list) else (outs,)
        for out, i in zip(outs, likes, strict=True):
            out.setType(inputs[i].type())
        return tuple(outs) if len(outs) > 1 else outs[0]


def _contrib(name: str, inputs: list, attrs: dict):
    """``name`` as one node from either exporter; eager: ``_EAGER[name](attrs, *inputs)``. Each
    output has the dtype and shape of ``inputs[OUTPUT_LIKES[name][j]]``."""
    likes = OUTPUT_LIKES[name]
    if torch.jit.is_tracing():
        return _ContribOp.apply(name, tuple(attrs.items()), likes, *inputs)
    if torch.onnx.is_in_onnx_export():
        outs = torch.onnx.ops.symbolic_multi_out(
            f"com.microsoft::{name}", inputs, attrs, dtypes=[inputs[i].dtype for i in likes],
            shapes=[list(inputs[i].shape) for i in likes], version=1)
        return tuple(outs) if len(likes) > 1 else outs[0]
    return _EAGER[name](attrs, *inputs)


def _gate_eager(attrs, a, dt_bias, decay_scale, b):
    return decay_scale * torch.nn.functional.softplus(a + dt_bias), torch.sigmoid(b)


def _linear_attention_eager(attrs, q, k, v, S, g, beta):
    hq, hv, scale = attrs["q_num_heads"], attrs["kv_num_heads"], attrs["scale"]
    T, dk, dv = q.shape[1], q.shape[2] // hq, v.shape[2] // hv

    def heads(x, n, d):
        return x.reshape(1, T, n, d).repeat_interleave(hv // n, 2).transpose(1, 2)

    q, k, v = heads(q, hq, dk) * scale, heads(k, hq, dk), heads(v, hv, dv)
    outs = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None, None]
        kt = k[:, :, t:t + 1]
        delta = (v[:, :, t:t + 1] - torch.matmul(kt, S)) * beta[:, t, :, None, None]
        S = S + torch.matmul(kt.transpose(2, 3), delta)
        outs.append(torch.matmul(q[:, :, t:t + 1], S))
    return torch.cat(outs, 2).transpose(1, 2).reshape(1, T, hv * dv), S


def _fast_gelu_eager(attrs, x):
    return torch.nn.functional.gelu(x, approximate="tanh")


# op -> for each output, the input whose dtype and shape it has (also forge/export/fuse.py's shape
# inference for these ops, which onnxruntime's symbolic inference does not know)
OUTPUT_LIKES = {"LinearAttentionGate": (0, 3), "LinearAttention": (2, 3), "FastGelu": (0,)}
_EAGER = {"LinearAttentionGate": _gate_eager, "LinearAttention": _linear_attention_eager,
          "FastGelu": _fast_gelu_eager}


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """gelu with the tanh approximation (HF gelu_pytorch_tanh) as onnxruntime's com.microsoft
    FastGelu: one node, not the seven of the written-out form (cpu graphs)."""
    return _contrib("FastGelu", [x], {})


def linear_attention_gate(a, dt_bias, decay_scale, b):
    """(decay, beta) = (decay_scale * softplus(a + dt_bias), sigmoid(b)); a, b [1,T,Hv]."""
    return _contrib("LinearAttentionGate", [a, dt_bias, decay_scale, b], {})


def linear_attention(q, k, v, state, decay, beta, q_heads: int, v_heads: int, scale: float):
    """The gated delta rule over T tokens, state S [1,Hv,dk,dv] (decay g in log space):

        S <- exp(g_t) S;  S <- S + k_t^T (beta_t (v_t - k_t S));  o_t = scale q_t S

    q, k [1,T,Hq*dk] (key heads repeated interleaved up to v_heads, as HF), v [1,T,Hv*dv],
    decay / beta [1,T,Hv] -> (o [1,T,Hv*dv], S')."""
    return _contrib("LinearAttention", [q, k, v, state, decay, beta],
                    dict(q_num_heads=q_heads, kv_num_heads=v_heads, update_rule="gated_delta",
                         scale=float(scale)))
