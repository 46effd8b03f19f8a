"""Qwen3.5 text decoder (model_type qwen3_5_text; the language model inside qwen3_5).

Three Gated DeltaNet (linear attention) layers per gated full-attention layer; every norm but the
gated one is (1 + w)::

    x ─ in_norm ─ mixer ─(+)─ post_norm ─ SwiGLU ─(+)─▶

  linear mixer (per step of T tokens; state carried by the runtime):
      qkv = conv_silu([fifo | in_proj_qkv(x)])     depthwise causal conv, kernel K; the fifo holds
                                                   the last K-1 inputs  (state kind conv_fifo)
      q, k = l2norm(.), q *= dk^-0.5;  beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
      out, S = delta_rule(q, k, v, g, beta, S)     S [Hv, dk, dv]       (state kind ssm)
      out_proj(rmsnorm(out) * silu(z))
  full mixer: q_proj -> [query | gate] per head, q/k norms, partial rope (25% of head_dim),
      GQA softmax attention, out * sigmoid(gate), o_proj                (state kind kv_full)

The delta rule has two exported forms (``delta_rule_step`` for AR-1 decode, ``delta_rule_chunk``
for AR-N prefill). The chunk form is matmul-only (no Trilu / Scatter / triangular solve: the HTP
claims none of them): cumsum is a MatMul with a constant triangle, the unit-triangular inverse is
a product of log2(T) squarings. Pad rows of the last prefill chunk get beta = 0 and g = 0, so they
leave the state untouched; the fifo keeps the last K-1 *valid* inputs through a host-made one-hot
selection (bind ``tail:K-1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..bundle.manifest import EmbedSpec, HostRecipe, RopeSpec, StateSpec
from . import blocks
from .base import DecoderFamily
from .form import PLAIN, ExportForm, fp16
from .graphio import GraphIO
from .ortops import (
    linear_attention,
    linear_attention_gate,
    simplified_layer_norm,
)

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    layer_types: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict) -> Args:
        """From config.json (qwen3_5_text, or qwen3_5 with text_config), through the HF config
        class so defaults (layer_types from full_attention_interval) resolve as HF resolves them."""
        from transformers import Qwen3_5TextConfig

        text = config.get("text_config") or config
        cfg = Qwen3_5TextConfig.from_dict({k: v for k, v in text.items() if k != "model_type"})
        kw = {f: getattr(cfg, f) for f in cls.__dataclass_fields__ if f != "model_type"}
        kw["layer_types"] = list(cfg.layer_types)
        kw["tie_word_embeddings"] = bool(config.get("tie_word_embeddings",
                                                    cfg.tie_word_embeddings))
        return cls(model_type=config.get("model_type", "qwen3_5_text"), **kw)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim)


class Qwen35Family(DecoderFamily):
    """Qwen3.5 text: GatedDeltaNet + gated full attention hybrid."""

    residual_scaling = False  # its layers read the stream unscaled (form.residual_scale unread)

    Args = Args

    def check_supported(self, args: Args) -> None:
        from ..bundle.errors import UnsupportedModelError

        if args.hidden_act not in blocks.ACTIVATIONS:
            raise UnsupportedModelError(f"Qwen3.5 activation {args.hidden_act!r} is not supported")
        if set(args.layer_types) - {LINEAR, FULL}:
            raise UnsupportedModelError(f"Qwen3.5 layer types {set(args.layer_types)} are not "
                                        f"all of {LINEAR!r} / {FULL!r}")
        if args.linear_num_value_heads % args.linear_num_key_heads:
            raise UnsupportedModelError("Qwen3.5 value heads must be a multiple of key heads")

    def state_spec(self, args: Args, context: int) -> list[StateSpec]:
        out = []
        for i, t in enumerate(args.layer_types):
            if t == FULL:
                shape = [args.num_key_value_heads, context, args.head_dim]
                out += [StateSpec(name=f"L{i}.{kv}", layer=i, kind="kv_full", shape=shape,
                                  group="full") for kv in "kv"]
            else:
                out.append(StateSpec(name=f"L{i}.conv", layer=i, kind="conv_fifo",
                                     shape=[args.linear_conv_kernel_dim - 1, args.conv_dim]))
                out.append(StateSpec(name=f"L{i}.ssm", layer=i, kind="ssm", shape=[
                    args.linear_num_value_heads, args.linear_key_head_dim,
                    args.linear_value_head_dim]))
        return out

    def host_recipe(self, hf, args: Args) -> HostRecipe:
        """Text positions: M-RoPE with t = h = w is plain rope over the rotary part of head_dim.
        With the vision tower (qwen3_5, as the hub ships it) image tokens take their (t, row, col)
        grid: interleaved M-RoPE on the host as Qwen3-VL's (``families/qwen3_vl.py``); the
        tower itself is Qwen3-VL's without deepstack (``qwen3_vl_vision.py``)."""
        rot = self.text_model(hf).rotary_emb
        scaling = float(getattr(rot, "attention_scaling", 1.0))
        if getattr(hf.model, "visual", None) is None:
            return HostRecipe(
                embed=EmbedSpec(table="embed_tokens", scale=1.0),
                ropes=[RopeSpec(name="default", inv_freq="rope.default.inv_freq",
                                attention_scaling=scaling)],
            )
        return HostRecipe(
            embed=EmbedSpec(table="embed_tokens", scale=1.0), positions="mrope",
            ropes=[RopeSpec(name="default", inv_freq="rope.default.inv_freq",
                            attention_scaling=scaling,
                            # HF Qwen3_5TextRotaryEmbedding: Qwen3-VL's, always interleaved
                            mrope_section=[int(x) for x in rot.mrope_section],
                            mrope_interleaved=True)],
        )

    def decoder_module(self, hf, args: Args, layers: tuple[int, int], seq_len: int, context: int,
                       form: ExportForm = PLAIN):
        return Qwen35Shard(self, hf, args, layers, seq_len, context, form)

    def cpu_step_module(self, hf, args: Args, layers: tuple[int, int], seq_len: int, context: int):
        """The cpu form (fused GatedDeltaNet decode ops, in-place KV caches), and in the decode
        graph each linear layer's states are written in place: LinearAttention's ssm state and
        the conv's fifo are outputs bound to their own inputs (``alias:past.L<i>.*``) instead of
        being copied into the state buffers after the step, a copy that cost ~6 % of a token
        (docs/notes/measurements.md). In place is safe where every node reading the old state runs
        before the node writing the new one, in any order onnxruntime picks: LinearAttention
        reads and writes its state itself (same bits in place, measured over 50 steps), and the
        fifo's one reader, the Concat, is an input of the Slice that writes it (the tests check
        both). Not the prefill's chunk form: there a read of the old state may be scheduled
        after the node that writes the new one."""
        module = super().cpu_step_module(hf, args, layers, seq_len, context)
        if seq_len > 1:
            return module
        outputs = [(name, f"alias:past.{bind[6:]}" if bind.startswith("state:")
                    and bind.endswith((".ssm", ".conv")) else bind)
                   for name, bind in module.io.outputs]
        module.io = GraphIO(inputs=module.io.inputs, outputs=outputs)
        return module

    def head_module(self, hf, args: Args, form: ExportForm = PLAIN):
        return blocks.Head(self.text_model(hf).norm, hf.lm_head, softcap=None, unit_offset=True,
                           hidden_size=args.hidden_size, form=form)

    # ---- Genie --------------------------------------------------------------------------------
    def genie_spec(self, hf, args: Args):
        """The default spec (the full layers' cache and rope), plus Genie's linear-attention
        state for the GatedDeltaNet layers and the token embedding as Genie's LUT (16-bit rows,
        once in the folder: gathered in the graph, Qwen3.5-4B's 248,320 x 2,560 table sat in
        every context in fp32, 2.5 GB each)."""
        import dataclasses

        return dataclasses.replace(super().genie_spec(hf, args), linear_attention=True,
                                   lut=(("embed_tokens", 1.0),))

    def genie_step(self, hf, args: Args, host, layers: tuple[int, int], seq_len: int,
                   context: int, residual_scale: float):
        return Qwen35GenieStep(self, hf, args, host, layers, seq_len, context, residual_scale)

    def check_genie(self, args: Args) -> None:
        """Text-only Qwen3.5 (the vision tower's M-RoPE positions are not Genie's text rope)."""


# ---- export modules (torch) ----------------------------------------------------------------------


def delta_rule_step(q, k, v, g, beta, S):
    """One token. q, k [1,Hv,1,dk], v [1,Hv,1,dv], g/beta [1,Hv,1], S [1,Hv,dk,dv].

        S <- S * exp(g);  S <- S + k^T (beta (v - k S));  out = q S
    """
    S = S * blocks.safe_exp(g)[..., None]
    delta = (v - torch.matmul(k, S)) * beta[..., None]  # [1,Hv,1,dv]
    S = S + torch.matmul(k.transpose(2, 3), delta)
    return torch.matmul(q, S), S


def delta_rule_chunk(q, k, v, g, beta, S, upper, strict_lower, lower):
    """T tokens as one chunk (HF torch_chunk_gated_delta_rule with chunk_size = T), matmul-only.

    q, k [1,Hv,T,dk], v [1,Hv,T,dv], g/beta [1,Hv,T], S [1,Hv,dk,dv]; constants [T,T]:
    ``upper`` (incl. diagonal: cumsum as g @ upper), ``strict_lower``, ``lower`` (incl. diagonal).

        decay[i,j] = exp(cum_i - cum_j) for j <= i, else 0
        A = I + strict_lower((beta k) k^T * decay)         unit lower-triangular
        A^-1 = (I + M)(I + M^2)(I + M^4) ...,  M = -strict_lower(...)   (M nilpotent: M^T = 0)
    """
    T = q.shape[2]
    cum = torch.matmul(g, upper)  # [1,Hv,T]: inclusive cumsum of the log decays
    diff = torch.clamp(cum[..., :, None] - cum[..., None, :], max=0.0)  # j > i: masked below
    decay = blocks.safe_exp(diff)
    kb, vb = k * beta[..., None], v * beta[..., None]
    M = -(torch.matmul(kb, k.transpose(2, 3)) * decay * strict_lower)
    inv, P = M + torch.eye(T, dtype=q.dtype), M
    for _ in range(max(0, math.ceil(math.log2(T)) - 1)):
        P = torch.matmul(P, P)
        inv = inv + torch.matmul(inv, P)
    cum_exp = blocks.safe_exp(cum)[..., None]  # [1,Hv,T,1]
    new_values = torch.matmul(inv, vb)
    k_cumdecay = torch.matmul(inv, kb * cum_exp)
    v_new = new_values - torch.matmul(k_cumdecay, S)
    intra = torch.matmul(q, k.transpose(2, 3)) * decay * lower
    out = torch.matmul(q * cum_exp, S) + torch.matmul(intra, v_new)
    last = cum[..., T - 1:T]  # [1,Hv,1]
    k_dec = k * blocks.safe_exp(last - cum)[..., None]
    S = S * blocks.safe_exp(last)[..., None] + torch.matmul(k_dec.transpose(2, 3), v_new)
    return out, S


class GatedDeltaNet(nn.Module):
    """HF Qwen3_5GatedDeltaNet as a static step on the HF module's weights. ``cpu_kernel``
    (``form.cpu``): onnxruntime's fused ops instead (``_forward_cpu``)."""

    def __init__(self, hf_lin: nn.Module, args: Args, seq_len: int, form: ExportForm = PLAIN):
        super().__init__()
        self.in_proj_qkv, self.in_proj_z = hf_lin.in_proj_qkv, hf_lin.in_proj_z
        self.in_proj_b, self.in_proj_a, self.out_proj = hf_lin.in_proj_b, hf_lin.in_proj_a, hf_lin.out_proj
        w = hf_lin.conv1d.weight.detach()[:, 0, :]  # [C, K]
        self.conv_w = nn.Parameter(w.t().contiguous(), requires_grad=False)  # [K, C] time-major
        self.cpu_kernel = form.cpu
        self.neg_A = nn.Parameter(-hf_lin.A_log.detach().float().exp(), requires_grad=False)
        self.dt_bias = hf_lin.dt_bias
        self.norm = blocks.RMSNorm.from_hf(hf_lin.norm, form=form)
        self.act = blocks.ACTIVATIONS[args.hidden_act]
        self.K, self.T = args.linear_conv_kernel_dim, seq_len
        self.hk, self.hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        # l2norm as an RMSNorm: x rsqrt(sum x^2 + e) = x rsqrt(mean x^2 + e/dk) / sqrt(dk)
        self.register_buffer("l2_gain", torch.full((self.dk,), self.dk ** -0.5))
        if seq_len > 1:
            ones = torch.ones(seq_len, seq_len)
            self.register_buffer("upper", torch.triu(ones))
            self.register_buffer("lower", torch.tril(ones))
            self.register_buffer("strict_lower", torch.tril(ones, -1))

    def _heads(self, x: torch.Tensor, n: int, d: int) -> torch.Tensor:
        """[1,T,n*d] -> [1,Hv,T,d], key heads repeated (interleaved) up to the value heads."""
        T = x.shape[1]
        x = x.reshape(1, T, n, d)
        if n != self.hv:
            x = x[:, :, :, None].expand(1, T, n, self.hv // n, d).reshape(1, T, self.hv, d)
        return x.transpose(1, 2)

    def forward(self, x, fifo, S, valid=None, tail=None):
        """x [1,T,H], fifo [1,K-1,C], S [1,Hv,dk,dv]; prefill also valid [1,T], tail [1,K-1,K-1+T].
        -> (out [1,T,H], fifo', S')"""
        if self.cpu_kernel and x.shape[1] == 1:
            return self._forward_cpu(x, fifo, S)
        T, K = x.shape[1], self.K
        ext = torch.cat((fifo, self.in_proj_qkv(x)), dim=1)  # [1, K-1+T, C]
        conv = ext[:, 0:T] * self.conv_w[0]
        for j in range(1, K):
            conv = conv + ext[:, j:j + T] * self.conv_w[j]
        qkv = torch.nn.functional.silu(conv)
        fifo = ext[:, T:] if tail is None else torch.matmul(tail, ext)  # the last K-1 valid inputs
        kd = self.hk * self.dk
        q = blocks.l2norm(self._heads(qkv[..., :kd], self.hk, self.dk)) * (self.dk ** -0.5)
        k = blocks.l2norm(self._heads(qkv[..., kd:2 * kd], self.hk, self.dk))
        v = self._heads(qkv[..., 2 * kd:], self.hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x)).transpose(1, 2)  # [1,Hv,T]
        g = (self.neg_A * torch.nn.functional.softplus(self.in_proj_a(x) + self.dt_bias)).transpose(1, 2)
        if valid is not None:  # pad rows: no decay, no write
            beta, g = beta * valid[:, None], g * valid[:, None]
        if T == 1:
            out, S = delta_rule_step(q, k, v, g, beta, S)
        else:
            out, S = delta_rule_chunk(q, k, v, g, beta, S, self.upper, self.strict_lower,
                                      self.lower)
        out = out.transpose(1, 2).reshape(1, T * self.hv, self.dv)  # rank 3 for the norm
        z = self.in_proj_z(x).reshape(1, T * self.hv, self.dv)
        out = (self.norm(out) * self.act(z)).reshape(1, T, self.hv * self.dv)
        return self.out_proj(out), fifo, S

    def _forward_cpu(self, x, fifo, S):
        """A decode step on onnxruntime's delta-rule ops, ~20 nodes instead of ~95 (the key heads
        stay unexpanded: LinearAttention repeats them interleaved, as HF)::

            [fifo | in_proj_qkv] x conv_w, sum over the K rows, SiLU ─ split ─ q|k: l2norm ─┐
            in_proj_a, in_proj_b ─ LinearAttentionGate (decay, beta) ──────────────────────┤
                          v ─ LinearAttention(gated_delta) ─ RMSNorm x SiLU(z) ─ out_proj

        The conv as Concat / Mul / ReduceSum / SiLU / Slice and the gated norm as plain nodes,
        not onnxruntime's CausalConvWithState and GatedRMSNorm (which genai's graph runs): those
        took 3x and ~8x these nodes' time.

        Prefill chunks keep the matmul-only chunk form: onnxruntime's LinearAttention over T
        tokens made the prefill slower (docs/notes/measurements.md, both)."""
        kd = self.hk * self.dk
        ext = torch.cat((fifo, self.in_proj_qkv(x)), dim=1)  # [1, K, C]
        qkv = torch.nn.functional.silu((ext * self.conv_w).sum(1, keepdim=True))  # [1, 1, C]
        fifo = ext[:, 1:]  # [1, K-1, C]
        qk, v = qkv.split([2 * kd, qkv.shape[-1] - 2 * kd], dim=-1)  # [1,1,2kd], [1,1,Hv dv]
        qk = simplified_layer_norm(qk.reshape(1, 1, 2 * self.hk, self.dk), self.l2_gain,
                                   1e-6 / self.dk).reshape(1, 1, 2 * kd)
        q, k = qk.split([kd, kd], dim=-1)
        g, beta = linear_attention_gate(self.in_proj_a(x), self.dt_bias, self.neg_A,
                                        self.in_proj_b(x))  # [1,1,Hv] each
        out, S = linear_attention(q, k, v, S, g, beta, self.hk, self.hv, self.dk ** -0.5)
        # per-head RMSNorm (one fused node: self.norm is a cpu-kernel RMSNorm) x SiLU(z)
        out = self.norm(out.reshape(1, self.hv, self.dv)).reshape(1, 1, self.hv * self.dv)
        out = out * self.act(self.in_proj_z(x))
        return self.out_proj(out), fifo, S


class Qwen35Layer(nn.Module):
    def __init__(self, hf_layer: nn.Module, args: Args, i: int, seq_len: int,
                 form: ExportForm = PLAIN):
        super().__init__()
        self.kind = args.layer_types[i]

        def norm(m: nn.Module) -> blocks.RMSNorm:
            return blocks.RMSNorm.from_hf(m, unit_offset=True, form=form)

        self.in_norm, self.post_norm = norm(hf_layer.input_layernorm), norm(
            hf_layer.post_attention_layernorm)
        self.mlp = blocks.GatedMLP(hf_layer.mlp, args.hidden_act, form)
        if self.kind == FULL:
            a = hf_layer.self_attn
            self.mixer = blocks.StaticAttention(
                a, n_heads=args.num_attention_heads, n_kv=args.num_key_value_heads,
                head_dim=args.head_dim, scaling=args.head_dim ** -0.5, output_gate=True,
                q_norm=norm(a.q_norm), k_norm=norm(a.k_norm), form=form)
        else:
            self.mixer = GatedDeltaNet(hf_layer.linear_attn, args, seq_len, form)

    def forward(self, x, step: dict, s0, s1):
        """s0, s1: past k, v (full) or fifo, ssm (linear) -> (x, new s0, new s1)."""
        h = self.in_norm(x)
        if self.kind == FULL:
            out, n0, n1 = self.mixer(h, step["cos"], step["sin"], step["mask"], s0, s1)
        else:
            out, n0, n1 = self.mixer(h, s0, s1, step.get("valid"), step.get("tail"))
        x = x + out
        return x + self.mlp(self.post_norm(x)), n0, n1


class Qwen35Shard(nn.Module):
    """Layers [a, b) as one static step graph.

    inputs : hidden [1,T,H]; if the shard has full layers: cos/sin [1,T,R], mask_full
             [1,1,T,C+T]; prefill with linear layers: valid [1,T], tail [1,K-1,K-1+T];
             per full layer past.L{i}.k/v [1,KVH,C,D], per linear layer past.L{i}.conv
             [1,K-1,Cc] and past.L{i}.ssm [1,Hv,dk,dv]
    outputs: hidden_out, new.L{i}.k/v (new rows) or new.L{i}.conv/ssm (whole state)
    """

    def __init__(self, fam: Qwen35Family, hf, args: Args, layers: tuple[int, int], seq_len: int,
                 context: int, form: ExportForm = PLAIN):
        super().__init__()
        tm = fam.text_model(hf)
        # its caches keep keys as rows; its layers read the stream unscaled (residual_scaling)
        form = form.with_plain_keys()
        self.args, self.seq_len, self.context = args, seq_len, context
        self.ids = list(range(*layers))
        self.rot_dim = 2 * tm.rotary_emb.inv_freq.numel()  # partial rotary: R < head_dim
        self.layers = nn.ModuleList([Qwen35Layer(tm.layers[i], args, i, seq_len, form)
                                     for i in self.ids])
        kinds = {args.layer_types[i] for i in self.ids}
        self.has_full, self.has_linear = FULL in kinds, LINEAR in kinds
        self.padded = self.has_linear and seq_len > 1
        K1 = args.linear_conv_kernel_dim - 1
        states = [(i, s) for i in self.ids for s in self._state_names(i)]
        self.io = GraphIO(
            inputs=[("hidden", "hidden")]
            + ([("cos", "rope_cos:default"), ("sin", "rope_sin:default"),
                ("mask_full", "mask:full")] if self.has_full else [])
            + ([("valid", "valid"), ("tail", f"tail:{K1}")] if self.padded else [])
            + [(f"past.L{i}.{s}", f"state:L{i}.{s}") for i, s in states],
            outputs=[("hidden_out", "hidden")]
            + [(f"new.L{i}.{s}", f"state:L{i}.{s}") for i, s in states],
        )

    def _state_names(self, i: int) -> tuple[str, str]:
        return ("k", "v") if self.args.layer_types[i] == FULL else ("conv", "ssm")

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        a, T, C = self.args, self.seq_len, self.context
        K1 = a.linear_conv_kernel_dim - 1
        out = [torch.randn(1, T, a.hidden_size)]
        if self.has_full:
            R = self.rot_dim
            out += [torch.ones(1, T, R), torch.zeros(1, T, R), torch.zeros(1, 1, T, C + T)]
        if self.padded:
            tail = torch.zeros(1, K1, K1 + T)
            tail[0, torch.arange(K1), T + torch.arange(K1)] = 1.0
            out += [torch.ones(1, T), tail]
        for i in self.ids:  # distinct tensors: the dynamo exporter aliases equal ones
            if a.layer_types[i] == FULL:
                out += [torch.zeros(1, a.num_key_value_heads, C, a.head_dim) for _ in "kv"]
            else:
                out += [torch.zeros(1, K1, a.conv_dim),
                        torch.zeros(1, a.linear_num_value_heads, a.linear_key_head_dim,
                                    a.linear_value_head_dim)]
        return tuple(out)

    def forward(self, hidden, *rest):
        rest = list(rest)
        step: dict[str, torch.Tensor] = {}
        if self.has_full:
            step["cos"], step["sin"] = rest.pop(0)[:, None], rest.pop(0)[:, None]
            step["mask"] = rest.pop(0)
        if self.padded:
            step["valid"], step["tail"] = rest.pop(0), rest.pop(0)
        new = []
        for layer in self.layers:
            hidden, s0, s1 = layer(hidden, step, rest.pop(0), rest.pop(0))
            new += [s0, s1]
        return (hidden, *new)



# ---- Genie (forge/genie/decoder.py; docs/genie.md) ---------------------------------------------------------


def conv_state_names(layer: int, direction: str) -> tuple[str, str]:
    """Genie's linear-attention state of a layer (its ``linear-attention`` model flag): the conv
    fifo and the recurrent (delta-rule) state, each ``_in`` -> ``_out``, copied back by Genie."""
    return f"conv_state_{layer}_{direction}", f"recurrent_state_{layer}_{direction}"


class Qwen35GenieStep(nn.Module):
    """Layers [a, b) of Qwen3.5 text in Genie's I/O contract (``genieio``) around the family's
    static shard::

        inputs_embeds | residual_a ─▶ Qwen35Shard ─▶ logits | residual_b
        attention_mask ──┬─▶ full layers (past_key/value_<L>, Genie's default cache group)
                         └─▶ valid rows, tail one-hot ─▶ linear layers' pad handling
        position_ids_*       the full layers' partial rope (the rotated dims' frequencies)
        conv_state_<L>_in/out [1, K-1, C], recurrent_state_<L>_in/out [1, Hv, dk, dv]

    Genie right-pads a prompt's last AR-N chunk and masks the pad rows whole, so a row is real
    iff its mask row attends anything: the pad rows then leave the recurrent state untouched
    (beta = g = 0, the shard's ``valid``) and the fifo keeps the last K-1 real inputs (the
    shard's ``tail``, a one-hot made here from the count of real rows)."""

    def __init__(self, fam: Qwen35Family, hf, args: Args, host, layers: tuple[int, int],
                 seq_len: int, context: int, residual_scale: float):
        super().__init__()
        from .genieio import INPUTS_EMBEDS, LOGITS, MASK, kv_names, residual_name, rope_names

        a, b = layers
        self.args, self.T, self.S = args, seq_len, context - seq_len
        self.first, self.last = a == 0, b == args.num_hidden_layers
        form = fp16(residual_scale)
        self.shard = Qwen35Shard(fam, hf, args, layers, seq_len, self.S, form)
        self.head = fam.head_module(hf, args, form) if self.last else None
        sh = self.shard
        # the mask: the full layers' and, in a prompt chunk, the pad rows' (a decode step of
        # linear layers alone reads none: the exporter drops an input no node reads)
        self.masked = sh.has_full or sh.padded
        ins = [(INPUTS_EMBEDS if self.first else residual_name(a), "tokens")]  # LUT rows
        ins += [(MASK, "mask")] if self.masked else []
        if sh.has_full:
            ins += [(n, "rope") for n in rope_names()]
        outs = [(LOGITS if self.last else residual_name(b), "out")]
        for i in sh.ids:
            names = kv_names if args.layer_types[i] == FULL else conv_state_names
            ins += [(n, f"state:L{i}") for n in names(i, "in")]
            outs += [(n, f"state:L{i}") for n in names(i, "out")]
        self.io = GraphIO(inputs=ins, outputs=outs)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        from .genieio import genie_kv_shapes

        a, T, S = self.args, self.T, self.S
        out = [torch.randn(1, T, a.hidden_size)]
        out += [torch.zeros(1, 1, T, S + T)] if self.masked else []
        if self.shard.has_full:
            R = self.shard.rot_dim // 2
            out += [torch.ones(1, 1, T, R), torch.zeros(1, 1, T, R)]
        for i in self.shard.ids:
            if a.layer_types[i] == FULL:
                ks, vs = genie_kv_shapes(a.num_key_value_heads, a.head_dim, a.head_dim, S)
                out += [torch.zeros(ks), torch.zeros(vs)]
            else:
                out += [torch.zeros(1, a.linear_conv_kernel_dim - 1, a.conv_dim),
                        torch.zeros(1, a.linear_num_value_heads, a.linear_key_head_dim,
                                    a.linear_value_head_dim)]
        return tuple(out)

    def forward(self, tokens, *rest):
        from .genieio import clean_past, full_rope, kv_from_genie, kv_to_genie

        a, sh, T, S = self.args, self.shard, self.T, self.S
        rest = list(rest)
        mask = rest.pop(0) if self.masked else None
        shard_in = [tokens]  # split 1: the LUT's rows (Genie gathers them); later: residual_a
        if sh.has_full:
            shard_in += [full_rope(rest.pop(0)), full_rope(rest.pop(0)), mask]
        if sh.padded:
            K1 = a.linear_conv_kernel_dim - 1
            valid = (mask > -1.0).any(-1).float()[:, 0]  # [1, T]: a pad row attends nothing
            n = valid.sum(-1, keepdim=True)  # [1, 1] real rows (the first n)
            # the fifo after the step: rows n .. n+K-2 of [fifo | the T inputs]
            rows = torch.arange(K1 + T, dtype=torch.float32)[None, None, :]  # [1, 1, K1+T]
            want = n[:, :, None] + torch.arange(K1, dtype=torch.float32)[None, :, None]
            shard_in += [valid, (rows == want).float()]  # tail [1, K1, K1+T]
        states = []
        for i in sh.ids:
            s0, s1 = rest.pop(0), rest.pop(0)
            if a.layer_types[i] == FULL:
                s0, s1 = clean_past(mask, list(kv_from_genie(s0, s1, 1)), S)
            states += [s0, s1]
        out, *new = sh(*shard_in, *states)
        result = [self.head(out) if self.last else out]
        for j, i in enumerate(sh.ids):
            n0, n1 = new[2 * j], new[2 * j + 1]
            result += list(kv_to_genie(n0, n1, 1)) if a.layer_types[i] == FULL else [n0, n1]
        return tuple(result)


FAMILY = Qwen35Family()
