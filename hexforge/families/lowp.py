"""Low-precision checkpoints: loaded as stored (bf16 / fp16), computed in fp32 on use.

A bf16 checkpoint loaded in fp32 holds twice its bytes in memory; held in bf16, the parts being
exported or run are upcast for the duration (``float32_parts``, ``float32_forward``), which is
exact: an fp32 model holding the same values computes the same.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

LOWP_ST = {"BF16": "bfloat16", "F16": "float16"}
FLOAT_ST = {"BF16", "F16", "F32", "F64", "F8_E5M2", "F8_E4M3"}
BIG_TABLE = 1 << 24  # embedding tables with more elements are gathered, never upcast whole


def stored_lowp_dtype(ckpt_dir: Path) -> str | None:
    """"bfloat16" / "float16" when every floating tensor of the checkpoint's safetensors is
    stored so (real checkpoints: bf16), else None (fp32 or mixed: load in fp32 as before)."""
    dtypes = set()
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        dtypes |= {t["dtype"] for k, t in header.items() if k != "__metadata__"} & FLOAT_ST
    return LOWP_ST[next(iter(dtypes))] if len(dtypes) == 1 and dtypes <= set(LOWP_ST) else None


def is_lowp(hf) -> bool:
    return bool(getattr(hf, "_hexforge_lowp", False))


def float32_buffers(model) -> None:
    """Every floating buffer of a low-precision-loaded model in fp32, as an fp32 load makes it:
    loaded ones (Gemma-4's layer_scalar) upcast; computed ones (rope inv_freq, embed_scale), which
    the init made in the low-precision default dtype, recomputed by the model's own
    ``_init_weights`` in fp32 (its init functions skip tensors flagged ``_is_hf_initialized``)."""
    import torch

    with torch.no_grad():
        for mod in model.modules():
            computed = []
            for name, buf in list(mod._buffers.items()):
                if buf is None or not buf.is_floating_point() or buf.dtype == torch.float32:
                    continue
                if name in mod._non_persistent_buffers_set:
                    mod._buffers[name] = torch.empty(buf.shape, dtype=torch.float32)
                    computed.append(name)
                else:
                    mod._buffers[name] = buf.float()
            if not computed:
                continue
            keep = [t for t in (*mod.parameters(recurse=False), *(
                b for n, b in mod._buffers.items() if b is not None and n not in computed))]
            saved = [getattr(t, "_is_hf_initialized", None) for t in keep]
            for t in keep:
                t._is_hf_initialized = True
            try:
                model._init_weights(mod)
            finally:
                for t, flag in zip(keep, saved, strict=True):
                    if flag is None:
                        del t._is_hf_initialized
                    else:
                        t._is_hf_initialized = flag


def _layer_param_ids(layers) -> set[int]:
    return {id(p) for layer in layers for p in layer.parameters()}


def _big_tables(hf, layers) -> list:
    """Embedding modules outside the decoder layers too large to upcast whole."""
    from torch import nn

    inside = {id(m) for layer in layers for m in layer.modules()}
    return [m for m in hf.modules() if isinstance(m, nn.Embedding) and id(m) not in inside
            and m.weight.numel() >= BIG_TABLE]


def _small_params(hf, layers) -> list:
    """Parameters outside the decoder layers, the large embedding tables and the lm_head."""
    skip = _layer_param_ids(layers) | {id(m.weight) for m in _big_tables(hf, layers)}
    head = getattr(hf, "lm_head", None)
    if head is not None:
        skip |= {id(p) for p in head.parameters()}
    return [p for p in hf.parameters() if id(p) not in skip]


class _Upcast:
    """Parameters set to fp32 copies of their low-precision values (tied ones once); on exit they
    get their original tensors back (no rounding round trip, the fp32 copies are freed)."""

    def __init__(self, params=()):
        self.saved: dict[int, tuple] = {}
        self.params = list(params)

    def up(self, params) -> None:
        import torch

        for p in params:
            if id(p) not in self.saved and p.is_floating_point() and p.dtype != torch.float32:
                self.saved[id(p)] = (p, p.data)
                p.data = p.data.float()

    def down(self, params) -> None:
        for p in params:
            if id(p) in self.saved:
                p.data = self.saved.pop(id(p))[1]

    def __enter__(self):
        self.up(self.params)
        return self

    def __exit__(self, *exc):
        for p, data in self.saved.values():
            p.data = data
        self.saved.clear()
        return False


class _Float32Forward(_Upcast):
    def __init__(self, hf, layers):
        head = getattr(hf, "lm_head", None)
        super().__init__(_small_params(hf, layers) + (list(head.parameters()) if head else []))
        self.layers, self.tables, self.hooks = list(layers), _big_tables(hf, layers), []

    def __enter__(self):
        super().__enter__()
        for layer in self.layers:
            ps = list(layer.parameters())
            self.hooks.append(layer.register_forward_pre_hook(lambda *_, ps=ps: self.up(ps)))
            self.hooks.append(layer.register_forward_hook(lambda *_, ps=ps: self.down(ps)))
        for table in self.tables:
            if id(table.weight) not in self.saved:  # not tied to the (upcast) lm_head
                table.forward = _gather_fp32(table)
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        for table in self.tables:
            table.__dict__.pop("forward", None)
        return super().__exit__(*exc)


def _gather_fp32(table):
    """The table's own forward on an fp32 table of just the rows asked for (ids remapped): equal
    to gathering from the whole table upcast, without making it."""
    import torch

    forward = type(table).forward

    def gather(ids, *args, **kwargs):
        uniq, inv = torch.unique(ids, return_inverse=True)
        weight, pad = table._parameters["weight"], table.padding_idx
        table._parameters["weight"] = torch.nn.Parameter(weight.detach()[uniq].float(),
                                                         requires_grad=False)
        table.padding_idx = None  # affects gradients only; its index means nothing in the subset
        try:
            return forward(table, inv.reshape(ids.shape), *args, **kwargs)
        finally:
            table._parameters["weight"], table.padding_idx = weight, pad

    return gather


def float32_parts(hf, reference_layers, layers: tuple[int, int] | None = None, head: bool = False,
                  scope=None):
    """Context: decoder layers [a, b) of ``reference_layers``, the small tensors outside them (of
    module ``scope`` only, if given) and with ``head`` the lm_head in fp32; a no-op on an
    fp32-loaded model (``DecoderFamily.float32``)."""
    if not is_lowp(hf):
        return nullcontext()
    params = _small_params(hf, reference_layers)
    if scope is not None:
        inside = {id(p) for p in scope.parameters()}
        params = [p for p in params if id(p) in inside]
    if layers is not None:
        for layer in reference_layers[layers[0]:layers[1]]:
            params += list(layer.parameters())
    if head and getattr(hf, "lm_head", None) is not None:
        params += list(hf.lm_head.parameters())
    return _Upcast(params)


def float32_forward(hf, reference_layers):
    """Context: HF forward passes compute as an fp32 model holding the same values; a no-op on an
    fp32-loaded model (``DecoderFamily.float32_forward``)."""
    if not is_lowp(hf):
        return nullcontext()
    return _Float32Forward(hf, reference_layers)
