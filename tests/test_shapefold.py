"""The decoder graphs are exported without torch's shape inference and their shapes folded
afterwards (forge/shapefold.py): node for node the graphs torch's own shape inference gives."""

from __future__ import annotations

from collections import Counter

import pytest

FAMILIES = ["llama", "qwen3", "gemma4", "qwen3_5", "qwen3_vl"]
GENIE = {"llama", "qwen3"}  # the families Genie bundles are built for: their Genie graphs too


def _ops(path) -> list[str]:
    """The graph's ops once its constants are folded (torch folds some constant chains the
    other export leaves, and the other way round: the same values)."""
    import onnx

    from hexforge.forge.shapefold import fold_shapes

    m = onnx.load(str(path), load_external_data=False)
    fold_shapes(m)
    return [n.op_type for n in m.graph.node if n.op_type != "Constant"]


@pytest.mark.parametrize("family", FAMILIES)
def test_folded_export_is_node_for_node_torchs_shape_inference(ckpt, tmp_path, monkeypatch,
                                                               family):
    import hexforge.forge.export as export
    from hexforge.forge.pipeline import BuildOptions, build

    # verify_len=0: the cpu AR-k verify graph is the prefill module at another length
    opts = dict(targets="v81", quant="fp16", context=64, prefill_len=8, verify_len=0,
                verify=False, keep_work=True, genie=family in GENIE)
    folded = build(ckpt(family), tmp_path / "folded", BuildOptions(**opts), log=lambda m: None)
    real = export.export_module
    monkeypatch.setattr(export, "export_module",
                        lambda module, path, exporter="dynamo", fold=False: real(
                            module, path, exporter))
    for mod in ("hexforge.forge.graphs", "hexforge.forge.genie"):
        monkeypatch.setattr(f"{mod}.export_module", export.export_module, raising=False)
    plain = build(ckpt(family), tmp_path / "plain", BuildOptions(**opts), log=lambda m: None)

    graphs = sorted(p.relative_to(plain) for p in plain.rglob("*.onnx")
                    if not p.name.endswith(".ctx.onnx"))
    assert len(graphs) >= 5  # cpu prefill / decode / head, the HTP's float graphs
    assert (family in GENIE) == any("genie" in g.parts for g in graphs)
    for g in graphs:
        a, b = _ops(plain / g), _ops(folded / g)
        assert a == b, (g, Counter(a) - Counter(b), Counter(b) - Counter(a))
