"""Static-shape torch export blocks shared by all families (build time only: imports torch).

They wrap the HF modules' own weights (no copies) and rewrite the forward into a form that exports
to plain ONNX and that the HTP claims (docs/htp.md):
  * every shape is static: T tokens per call (AR-N prefill or AR-1 decode), cache of S rows;
  * K/V: the graph reads the whole static cache but returns only the T *new* rows; the host writes
    them into its preallocated buffers (no Scatter in-graph, no whole-cache copy out);
  * masks and rope cos/sin are graph inputs made by the host in fp32;
  * norms are computed at rank 3 (the HTP returned wrong rows for some rank-4 RMSNorm shapes), on
    inputs prescaled by a calibrated power of two (small activations: fp16 subnormals, A16 range).

Attention over [cache | new] keys::

            keys:  slot 0 ... slot S-1 | new 0 ... new T-1
    query t=0      <-- mask from host --> | 0  -  -  -
    query t=1      (slot occupancy,       | 0  0  -  -      '-' = mask_value
    query t=2       window, position)     | 0  0  0  -
"""

from __future__ import annotations

import torch
from torch import nn

from .form import PLAIN, ExportForm
from .graphio import GraphIO
from .ortops import (
    CacheLengths,
    apply_rope,
    fast_gelu,
    gqa_rotary,
    group_query_attention,
    rotary_embedding,
    simplified_layer_norm,
)

# the power-of-two input prescale ``record_norm_prescales`` measured, kept on the HF norm module
# itself: the measurement belongs to that model (a process-wide dict keyed by id(module) outlived
# the model and handed its entries to whatever module was allocated at a reused address)
PRESCALE_ATTR = "hexforge_prescale"


def norm_prescale(hf_norm: nn.Module) -> float:
    """The prescale recorded on ``hf_norm`` (1.0 before calibration)."""
    return float(hf_norm.__dict__.get(PRESCALE_ATTR, 1.0))


def clear_norm_prescales(root: nn.Module) -> None:
    """Forget every prescale recorded under ``root`` (its norms as before calibration)."""
    for mod in root.modules():
        mod.__dict__.pop(PRESCALE_ATTR, None)


def calibrate_norm_scales(hf, input_ids: list[int], layers=()) -> float:
    """Run the HF decoder on calibration ids; record every RMSNorm's prescale (``record_norm_
    prescales``). The media towers' norms are not reached by a text forward: the build records
    theirs on the encoders' own inputs (forge/export/encoders.py ``calibrate_encoder_norms``).
    -> the residual stream's peak |x| (the outputs of ``layers``, HF's decoder layers)."""
    peak = [0.0]

    def out(_m, _i, o):
        o = o[0] if isinstance(o, tuple) else o
        peak[0] = max(peak[0], float(o.detach().abs().max()))

    hooks = [layer.register_forward_hook(out) for layer in layers]
    ids = torch.tensor([input_ids])
    try:
        record_norm_prescales(hf, lambda: hf(ids, attention_mask=torch.ones_like(ids)))
    finally:
        for h in hooks:
            h.remove()
    return peak[0]


def record_norm_prescales(root: nn.Module, run) -> dict[str, float]:
    """Run ``run()`` (an HF forward) with a hook on every RMSNorm under ``root``; for each norm it
    reached record k = 2^-round(log2(rms(input))) so the export computes the norm on k*x, whose
    mean square is O(1).

    Why: activations entering some norms are tiny (Gemma-4's PLE branch ~1e-3, mean square ~1e-6;
    the tiny vision tower's post-FFN norm the same): fp16 puts that in its subnormals (HTP decode
    cos fell to 0.64; an HTP that flushes them to zero, 0.989 on the vision tower) and a 16-bit
    fixed-point range cannot resolve it. A power of two is exact in floating point, so the cpu
    graphs stay exact. -> {module name: k} for the record."""
    import math

    hooks, seen = [], {}
    for name, mod in root.named_modules():
        if "RMSNorm" in type(mod).__name__:  # Qwen3_5RMSNormGated too (its input: args[0])
            def pre(m, args, name=name):
                x = args[0].detach().float()
                rms = x.pow(2).mean(-1).sqrt().flatten()
                rms = rms[rms > 0]
                if rms.numel():
                    seen[name] = (m, float(rms.median()))
            hooks.append(mod.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, (mod, rms) in seen.items():
        k = 2.0 ** -round(math.log2(rms)) if rms > 0 else 1.0
        mod.__dict__[PRESCALE_ATTR] = k
        out[name] = k
    return out


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: rank 3 (the HTP returned wrong rows for some rank-4 RMSNorm
    shapes), input prescaled by a power of two (``calibrate_norm_scales``); ``unit_offset`` for
    (1 + w) checkpoints, ``weight`` None for scale-free norms (Gemma-4's v_norm).
    ``form.kernels`` "cpu": one fused onnxruntime node, for cpu graphs. "fp16": the same fused
    node on the prescaled input, for HTP graphs with fp16 activations: the decomposed chain
    materialises x*x, which overflows fp16 on the massive activations of trained models
    (SmolLM2's first row reaches 22,500 in one channel: x*x = 5e8 > 65504), while the HTP's own
    RmsNorm kept that row exact (docs/htp.md).
    ``input_scale`` / ``out_scale``: the graph's input is HF's times ``input_scale``, the output
    is HF's times ``out_scale`` (a residual stream carried at 1/s: ``ExportForm.stream``); the
    module that owns the norm knows which side of it is the stream."""

    def __init__(self, weight: torch.Tensor | None, eps: float, unit_offset: bool = False,
                 prescale: float = 1.0, form: ExportForm = PLAIN, *, input_scale: float = 1.0,
                 out_scale: float = 1.0):
        super().__init__()
        self.weight, self.eps, self.unit_offset, self.prescale = weight, eps, unit_offset, prescale
        self.cpu_kernel, self.fused = form.cpu, form.fused_norm
        self.input_scale, self.out_scale = input_scale, out_scale

    def _gain(self, dim: int, like: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            g = torch.ones(dim, dtype=like.dtype)
        else:
            g = self.weight + 1.0 if self.unit_offset else self.weight
        return g * self.out_scale if self.out_scale != 1.0 else g

    @classmethod
    def from_hf(cls, hf_norm: nn.Module, unit_offset: bool = False, form: ExportForm = PLAIN, *,
                input_scale: float = 1.0, out_scale: float = 1.0) -> RMSNorm:
        eps = getattr(hf_norm, "variance_epsilon", None) or getattr(hf_norm, "eps", 1e-6)
        return cls(getattr(hf_norm, "weight", None), eps, unit_offset,
                   norm_prescale(hf_norm), form, input_scale=input_scale, out_scale=out_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel:  # any rank, and fp32 needs no prescale (it is exact anyway: k = 2^n)
            return simplified_layer_norm(x, self._gain(x.shape[-1], x), self.eps)
        # (k x) * rsqrt(mean((k x)^2) + eps k^2) == x * rsqrt(mean(x^2) + eps) for any k > 0;
        # the graph's input is u x (u = input_scale), so it is scaled by k / u
        shape = x.shape
        x3 = x.reshape(-1, shape[-2], shape[-1]) if x.dim() > 3 else x  # [B', T', D]
        k, m = self.prescale, self.prescale / self.input_scale
        if m != 1.0:
            x3 = x3 * m
        if self.fused:  # [1, rows, D]: the HTP's fused norm zeroed rows of a [16, 4, 32] input
            # (batch 16) and is exact at batch 1 (probed on v81, fp16)
            x1 = x3.reshape(1, -1, shape[-1])
            return simplified_layer_norm(x1, self._gain(shape[-1], x1), self.eps * k * k
                                         ).reshape(shape)
        # x*x, not pow(x, 2): quantizers route Pow's exponent through Q/DQ, and an exponent that
        # dequantizes to 1.99997 turns negative bases into NaN
        x3 = x3 * torch.rsqrt((x3 * x3).mean(-1, keepdim=True) + self.eps * k * k)
        if self.weight is not None or self.out_scale != 1.0:
            x3 = x3 * self._gain(shape[-1], x3)
        return x3.reshape(shape)


def residual_scale(absmax: float, limit: float = 8192.0) -> float:
    """The power of two s that brings a residual stream of peak ``absmax`` (calibrated) under
    ``limit``: 8x headroom below fp16's maximum for prompts that peak higher. 1 if it fits."""
    import math

    return 2.0 ** max(0, math.ceil(math.log2(absmax / limit))) if absmax > 2 * limit else 1.0


EXP_FLOOR = -80.0  # fp16 Exp on the HTP returns garbage below about -88 (docs/htp.md)


def safe_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= 0 (log-space decays), floored at EXP_FLOOR: exp(-80) ~ 2e-35 is zero for
    every use, and the HTP's fp16 Exp is wrong below about -88."""
    return torch.exp(torch.clamp(x, min=EXP_FLOOR))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As HF (FLA): x * rsqrt(sum(x^2) + eps) over the last dim (x*x: see RMSNorm on Pow)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF gelu_pytorch_tanh, written as x * sigmoid(2z) (= 0.5x(1 + tanh z)): the same function,
    but not the pattern the QNN compiler fuses into its fp16 GELU, which was off by up to 3% in
    cos on Gemma-4 decode steps (measured on v81, x86 simulator)."""
    return x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "silu": torch.nn.functional.silu,
               "gelu_tanh": gelu_tanh}


class GeluTanh(nn.Module):
    """``gelu_tanh``; cpu graphs (``form.cpu``): onnxruntime's FastGelu, one node for seven —
    two a Gemma-4 layer (MLP, per-layer-input gate), each node a dispatch and a pass over the
    row."""

    def __init__(self, form: ExportForm = PLAIN):
        super().__init__()
        self.cpu_kernel = form.cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_gelu(x) if self.cpu_kernel else gelu_tanh(x)


def activation(name: str, form: ExportForm = PLAIN):
    """The decoder's activation ``name`` (a key of ACTIVATIONS): a module where cpu graphs
    export it as one fused node, else the function."""
    return GeluTanh(form) if ACTIVATIONS[name] is gelu_tanh else ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) on the HF module's Linear layers, with our activation."""

    def __init__(self, hf_mlp: nn.Module, name: str, form: ExportForm = PLAIN):
        super().__init__()
        self.gate_proj, self.up_proj = hf_mlp.gate_proj, hf_mlp.up_proj
        self.down_proj = hf_mlp.down_proj
        self.act = activation(name, form)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class InPlaceCache(nn.Module):
    """A decoder shard whose ``mask:full`` attention runs onnxruntime's GroupQueryAttention on the
    cache in place: the cpu target's prefill (AR-N) and decode (AR-1) graphs.

    Why: the static graph concatenates and attends over all C cache rows every step and masks
    the rows not held yet — at real context lengths most of a token's memory traffic — while
    GroupQueryAttention reads only the rows held, and a prefill chunk only its causal ones
    (docs/notes/measurements.md).
    Its present K/V outputs alias the cache inputs (output bind ``alias:<input>``: the runtime
    binds both to the state buffer), so it writes the new rows in place and copies nothing::

        cache L{i}.k ──past──▶ GroupQueryAttention(q, k_new, v_new, kv_seqlens, kv_total)
              ▲                      │ reads rows [0, total), writes the T new rows at
              └──────present─────────┘ total-T .. total-1 (same memory)

    A chunk's pad rows are written too, past the prompt's last row: the next step writes its own
    rows there before anything reads them. A chunk must end inside the cache (the engine runs a
    prompt's tail that would not through AR-1).

    inputs : the shard's, mask_full replaced by kv_seqlens [1] int32, kv_total [] int32, less
             the rope's cos/sin where the attention reads it as constant tables (1-D positions)
    outputs: the shard's, less the new rows of the caches GQA writes (the write is done: as
             outputs they only cost a Transpose each, two Reshapes ORT could not merge around
             it, and an engine row write per cache — 56 of each per Qwen3-0.6B token), + present.
             <cache input> per cache read, bind alias:<cache input>
    HTP graphs keep the static form: the HTP has no such op and needs static shapes.
    """

    def __init__(self, shard: nn.Module, rope_tables: dict | None = None):
        super().__init__()
        self.shard = shard
        names = [n for n, _ in shard.io.inputs]
        self.at = names.index("mask_full")
        full = [*shard.io.inputs[:self.at], ("kv_seqlens", "kv_seqlens:full"),
                ("kv_total", "kv_total:full"), *shard.io.inputs[self.at + 1:]]
        # a shard's one rope, where the family says positions are cache rows (``rope_tables``:
        # name -> cos, sin [C, R]): the attention reads it as constant tables
        # (``ortops.gqa_rotary``), and the rope inputs leave the graph (``_with_rope_rows``)
        ropes = [b.removeprefix("rope_cos:") for _, b in full if b.startswith("rope_cos:")]
        self.tables = None
        if len(ropes) == 1 and ropes[0] in (rope_tables or {}):
            self.tables = tuple(torch.from_numpy(t) for t in rope_tables[ropes[0]])
        binds = [b for _, b in full]
        self.derived = [binds.index(f"rope_{f}:{ropes[0]}") for f in ("cos", "sin")
                        ] if self.tables is not None else []  # where cos, sin were
        inputs = [x for i, x in enumerate(full) if i not in self.derived]
        self.total_at = [n for n, _ in inputs].index("kv_total")
        # which caches the attention reads, in call order: one eager pass (the op is zeros there)
        example = self._with_rope_rows(self.example_inputs())
        with torch.no_grad():
            presents = self._run(example)[1]
        by_id = {id(t): n for (n, _), t in zip(full, example, strict=True)}
        written = {bind for n, bind in full if n in {by_id[id(past)] for past, _ in presents}}
        self.keep = [bind not in written for _, bind in shard.io.outputs]  # per shard output
        self.io = GraphIO(inputs=inputs, outputs=[
            o for o, keep in zip(shard.io.outputs, self.keep, strict=True) if keep] + [
            (f"present.{by_id[id(past)]}", f"alias:{by_id[id(past)]}") for past, _ in presents])

    @classmethod
    def wrap(cls, shard: nn.Module, rope_tables: dict | None = None) -> nn.Module:
        """The shard in place-cache form, or unchanged when it has no full-cache attention."""
        binds = [b for _, b in shard.io.inputs if b.startswith("mask:")]
        return cls(shard, rope_tables) if binds == ["mask:full"] else shard

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        ex = list(self.shard.example_inputs())
        T = ex[0].shape[1]  # a first chunk: rows 0 .. T-1 held after it
        lengths = [torch.tensor([T - 1], dtype=torch.int32), torch.tensor(T, dtype=torch.int32)]
        full = (*ex[:self.at], *lengths, *ex[self.at + 1:])
        return tuple(t for i, t in enumerate(full) if i not in self.derived)

    def _with_rope_rows(self, args) -> tuple[torch.Tensor, ...]:
        """The graph's inputs -> the shard's, the rope inputs it dropped made again: the step's
        rows of the constant tables at its positions total-T .. total-1. The attention does not
        read them (it reads the tables), so they are dead code in the graph unless a layer
        reads them besides (e.g. k rows for a later layer's shared cache)."""
        if not self.derived:
            return tuple(args)
        T = args[0].shape[1]
        positions = args[self.total_at].long() - T + torch.arange(T)  # [T]
        rows = [t.index_select(0, positions)[None] for t in self.tables]  # cos, sin [1, T, R]
        given = iter(args)
        return tuple(rows[self.derived.index(i)] if i in self.derived else next(given)
                     for i in range(len(args) + len(self.derived)))

    def _run(self, args):
        lengths = CacheLengths(args[self.at], args[self.at + 1], tables=self.tables)
        outs = self.shard(*args[:self.at], lengths, *args[self.at + 2:])
        return outs, lengths.presents

    def forward(self, *args):
        outs, presents = self._run(self._with_rope_rows(args))
        return (*(o for o, keep in zip(outs, self.keep, strict=True) if keep),
                *(present for _, present in presents))


class StaticAttention(nn.Module):
    """GQA attention over a static cache; returns (out, k_new, v_new).

    GQA without repeating K/V: q [1, nH, T, D] is viewed as [1, KVH, g*T, D] (head h = kvh*g + j, so
    row j*T + t), the mask is tiled g times along rows. Rank-4 only.
    """

    def __init__(self, hf_attn: nn.Module, *, n_heads: int, n_kv: int, head_dim: int,
                 scaling: float, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 v_norm: nn.Module | None = None, output_gate: bool = False,
                 form: ExportForm = PLAIN):
        super().__init__()
        # a KV-shared layer (Gemma-4) has only q/o: it attends over its donor's keys/values
        self.q_proj, self.o_proj = hf_attn.q_proj, hf_attn.o_proj
        self.k_proj = getattr(hf_attn, "k_proj", None)
        self.v_proj = getattr(hf_attn, "v_proj", None)
        self.n_heads, self.n_kv, self.head_dim, self.scaling = n_heads, n_kv, head_dim, scaling
        self.q_norm, self.k_norm, self.v_norm = q_norm, k_norm, v_norm
        # Qwen3.5: q_proj emits [query | gate] per head; the output is out * sigmoid(gate)
        self.output_gate = output_gate
        self.cpu_kernel = form.cpu  # onnxruntime's fused rope
        # the cache holds keys transposed, [1, KVH, D, C], as QK^T reads them: no transpose of
        # the whole cache each step (kvcast.py has the measurement)
        self.keys_transposed = form.keys_transposed

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        T = x.shape[1]
        k = self.k_proj(x).view(1, T, self.n_kv, self.head_dim)
        # no v_proj (Gemma-4 attention_k_eq_v full layers): v is the raw k projection
        v = self.v_proj(x).view(1, T, self.n_kv, self.head_dim) if self.v_proj is not None else k
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        k = self._rope(k, cos, sin)  # [1, KVH, T, D]
        return k, v.transpose(1, 2)

    def attend(self, x, cos, sin, mask, keys, values, keys_transposed: bool = False):
        """q from x; keys/values [1, KVH, S+T, D] already concatenated (keys [1, KVH, D, S+T]
        with ``keys_transposed``); mask [1, 1, T, S+T]."""
        T, g, D = x.shape[1], self.n_heads // self.n_kv, self.head_dim
        q, gate = self._query(x, cos, sin)  # [1, nH, T, D]
        q = q.reshape(1, self.n_kv, g * T, self.head_dim)
        kt = keys if keys_transposed else keys.transpose(2, 3)
        scores = torch.matmul(q, kt) * self.scaling  # [1, KVH, g*T, S+T]
        if g > 1:
            mask = mask.repeat(1, 1, g, 1)
        probs = torch.softmax(scores + mask, dim=-1)
        out = torch.matmul(probs, values)  # [1, KVH, g*T, D]
        out = out.reshape(1, self.n_heads, T, D).transpose(1, 2).reshape(1, T, self.n_heads * D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def forward(self, x, cos, sin, mask, past_k, past_v):
        if isinstance(mask, CacheLengths):
            return self.attend_in_place(x, cos, sin, mask, past_k, past_v)
        k, v = self.project_kv(x, cos, sin)
        values = torch.cat((past_v, v), dim=2)
        if self.keys_transposed:  # past_k [1, KVH, D, C]; the new rows go out as [1, KVH, D, T]
            k = k.transpose(2, 3)
            keys = torch.cat((past_k, k), dim=3)
        else:
            keys = torch.cat((past_k, k), dim=2)
        return self.attend(x, cos, sin, mask, keys, values, self.keys_transposed), k, v

    def _query(self, x, cos, sin):
        """q [1, nH, T, D] after the head norm and rope, + the output gate [1, T, nH*D] or None."""
        T, D = x.shape[1], self.head_dim
        gate = None
        if self.output_gate:
            qg = self.q_proj(x).view(1, T, self.n_heads, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(1, T, self.n_heads * D)
        else:
            q = self.q_proj(x).view(1, T, self.n_heads, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return self._rope(q, cos, sin), gate

    def _rope(self, x, cos, sin):
        """x [1, T, n, D] -> rotated [1, n, T, D]."""
        if self.cpu_kernel:
            return rotary_embedding(x, cos, sin).transpose(1, 2)
        return apply_rope(x.transpose(1, 2), cos, sin)

    def attend_in_place(self, x, cos, sin, lengths: CacheLengths, past_k, past_v):
        """cpu graphs: onnxruntime's GroupQueryAttention over the first ``lengths.total`` cache
        rows; it writes k/v at rows total-T .. total-1 of the cache it was given (its present
        outputs, which the runtime binds to the cache inputs' memory). -> (out, k, v new rows
        [1, KVH, T, D]: not graph outputs, the op wrote them).

        q/k/v stay in the op's flat [1, T, n*D] layout throughout: only a head norm views them
        as heads and back (the [1, n, T, D] round trip left 3 more Reshapes a layer that
        onnxruntime did not drop, 84 nodes a Qwen3-0.6B step)."""
        T, H, KV, D = x.shape[1], self.n_heads, self.n_kv, self.head_dim
        gate = None
        if self.output_gate:
            qg = self.q_proj(x).view(1, T, H, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(1, T, H * D)
        else:
            q = self.q_proj(x)  # [1, T, H*D]
        k = self.k_proj(x)  # [1, T, KV*D]
        v = self.v_proj(x) if self.v_proj is not None else k  # k_eq_v: v is the raw k projection
        q, k = self._head_norm(q, H, self.q_norm), self._head_norm(k, KV, self.k_norm)
        v = self._head_norm(v, KV, self.v_norm)
        rotary = gqa_rotary(cos, sin, D, past_k.shape[2], lengths)
        k_rows = rotary_embedding(k, cos, sin, KV)  # the new rows as the cache holds them: in the
        # graph only if a later layer reads them (KV sharing), else dropped as dead code
        if not rotary:
            q, k = rotary_embedding(q, cos, sin, H), k_rows
        out, present_k, present_v = group_query_attention(
            q, k, v, past_k, past_v, lengths.seqlens_k, lengths.total, H, KV, float(self.scaling),
            rotary)
        lengths.presents += [(past_k, present_k), (past_v, present_v)]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        rows = lambda t: t.view(1, T, KV, D).transpose(1, 2)  # noqa: E731  -> [1, KV, T, D]
        return self.o_proj(out), rows(k_rows), rows(v)

    def _head_norm(self, t: torch.Tensor, n: int, norm: nn.Module | None) -> torch.Tensor:
        """t [1, T, n*D] or [1, T, n, D] -> each head's D normed (if ``norm``) -> [1, T, n*D]."""
        T = t.shape[1]
        if norm is not None:
            t = norm(t.reshape(1, T, n, self.head_dim))
        return t if t.dim() == 3 else t.reshape(1, T, n * self.head_dim)


class DenseLayer(nn.Module):
    """Pre-norm llama block: x + attn(norm(x)); x + mlp(norm(x)). HF norm/MLP modules reused."""

    def __init__(self, hf_layer: nn.Module, attn: StaticAttention, form: ExportForm = PLAIN):
        super().__init__()
        # the residual stream at 1/s (``form.stream``): the norms read it so, the branches add
        # into it so (one Mul each; no post-norm to fold the scale into)
        u = form.stream
        self.input_norm = RMSNorm.from_hf(hf_layer.input_layernorm, form=form, input_scale=u)
        self.post_attn_norm = RMSNorm.from_hf(hf_layer.post_attention_layernorm, form=form,
                                              input_scale=u)
        self.attn, self.mlp = attn, hf_layer.mlp
        self.add_scale = u

    def _add(self, x, branch):
        return x + (branch * self.add_scale if self.add_scale != 1.0 else branch)

    def forward(self, x, cos, sin, mask, past_k, past_v):
        a, k, v = self.attn(self.input_norm(x), cos, sin, mask, past_k, past_v)
        x = self._add(x, a)
        return self._add(x, self.mlp(self.post_attn_norm(x))), k, v


class DenseShard(nn.Module):
    """Decoder layers [start, end) of a dense model as one static step graph.

    inputs : hidden [1,T,H], cos/sin [1,T,R], mask_full [1,1,T,C+T], past.L{i}.k/v [1,KVH,C,D] ...
    outputs: hidden_out [1,T,H], new.L{i}.k/v [1,KVH,T,D] ...
    (keys [1,KVH,D,C] in, [1,KVH,D,T] out under ``form.keys_transposed``)
    """

    def __init__(self, fam, hf, args, layers: tuple[int, int], seq_len: int, context: int,
                 form: ExportForm = PLAIN):
        super().__init__()
        ref = fam.reference_layers(hf)
        self.layer_ids = list(range(*layers))
        self.layers = nn.ModuleList([DenseLayer(ref[i], fam.attention(ref[i], args, form), form)
                                     for i in self.layer_ids])
        self.seq_len, self.context, self.args = seq_len, context, args
        self.io = GraphIO(
            inputs=[("hidden", "hidden"), ("cos", "rope_cos:default"), ("sin", "rope_sin:default"),
                    ("mask_full", "mask:full")]
            + [(f"past.L{i}.{kv}", f"state:L{i}.{kv}") for i in self.layer_ids for kv in "kv"],
            outputs=[("hidden_out", "hidden")]
            + [(f"new.L{i}.{kv}", f"state:L{i}.{kv}") for i in self.layer_ids for kv in "kv"],
        )
        # the first shard takes HF's hidden (the embedding) and scales it to 1/s; later shards
        # take the stream already scaled
        self.entry_scale = form.stream if self.layer_ids and self.layer_ids[0] == 0 else 1.0
        self.keys_transposed = form.keys_transposed  # every layer's cache: keys [1, KVH, D, C]
        if form.keys_transposed:
            self.io.keys_transposed = {n for n, _ in self.io.inputs + self.io.outputs
                                       if n.startswith(("past.", "new.")) and n.endswith(".k")}

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * self.entry_scale if self.entry_scale != 1.0 else hidden

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        a, T, C = self.args, self.seq_len, self.context
        rot = a.head_dim
        # distinct tensor objects: the dynamo exporter aliases inputs that are the same object
        k = ((1, a.num_key_value_heads, a.head_dim, C) if self.keys_transposed
             else (1, a.num_key_value_heads, C, a.head_dim))
        past = [torch.zeros(*(k if i % 2 == 0 else (1, a.num_key_value_heads, C, a.head_dim)))
                for i in range(2 * len(self.layer_ids))]
        return (torch.randn(1, T, a.hidden_size), torch.ones(1, T, rot), torch.zeros(1, T, rot),
                torch.zeros(1, 1, T, C + T), *past)

    def forward(self, hidden, cos, sin, mask, *past):
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, T, R]: broadcast over heads
        hidden = self.enter(hidden)
        new = []
        for j, layer in enumerate(self.layers):
            hidden, k, v = layer(hidden, cos, sin, mask, past[2 * j], past[2 * j + 1])
            new += [k, v]
        return (hidden, *new)


class WithHead(nn.Module):
    """The cpu target's last decode shard with the head run inside it: one session per token.

        hidden ─▶ shard ─▶ hidden_out ─▶ norm ─▶ lm_head ─▶ logits [1,1,V]   (one graph)
                    └────▶ state outputs (as the shard's)

    Why: a separate head session is a second run per token, with its own thread pool to wake
    (docs/notes/measurements.md). The head graph stays for prefill's last row
    (its weights shared with this graph's file: one copy on disk).

    outputs: the shard's (hidden_out kept: the oracle judges every shard's hidden) + logits."""

    def __init__(self, shard: nn.Module, head: nn.Module):
        super().__init__()
        if shard.io.outputs[0][1] != "hidden":
            raise ValueError("the shard's first output must be its hidden state")
        self.shard, self.head = shard, head
        self.io = GraphIO(inputs=shard.io.inputs, outputs=[*shard.io.outputs, ("logits", "logits")])

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.shard.example_inputs()

    def forward(self, *args):
        outs = self.shard(*args)
        return (*outs, self.head(outs[0]))


class OverRows(nn.Module):
    """A per-row module (the head) traced over ``rows`` rows: [1,1,H] -> [1,rows,H] in, its
    output per row. Why: an HTP verify step's k rows through one head call (the head's weights
    stream once for all of them) instead of one call per row read."""

    def __init__(self, inner: nn.Module, rows: int):
        super().__init__()
        self.inner, self.rows, self.io = inner, rows, inner.io

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(x.shape[0], self.rows, *x.shape[2:])
                     for x in self.inner.example_inputs())

    def forward(self, *args):
        return self.inner(*args)


class Head(nn.Module):
    """Final norm + lm_head (+ optional logit softcap) on one hidden row: [1,1,H] -> [1,1,V]."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None,
                 hidden_size: int | None = None, unit_offset: bool = False,
                 form: ExportForm = PLAIN):
        super().__init__()
        # the final norm reads the stream at 1/s (``form.stream``)
        self.norm = RMSNorm.from_hf(norm, unit_offset, form, input_scale=form.stream)
        self.lm_head = lm_head
        self.softcap = softcap
        self.hidden_size = hidden_size or lm_head.weight.shape[1]
        self.io = GraphIO(inputs=[("hidden", "hidden")], outputs=[("logits", "logits")])

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return (torch.randn(1, 1, self.hidden_size),)

    def forward(self, hidden):
        logits = self.lm_head(self.norm(hidden))
        if logits.dtype != torch.float32:  # .float() on fp32 traces to a Cast onnxruntime keeps
            logits = logits.float()  # (a graph output): a copy of the logits every token
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
