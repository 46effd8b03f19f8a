"""Build pipeline: verify on/off, failing gates, planner, atomic output, checkpoint checks."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from hexforge.bundle.errors import BuildError, CheckpointError, ParityGateError
from hexforge.bundle.manifest import load_manifest
from hexforge.forge.export.plan import _greedy, plan_shards
from hexforge.forge.pipeline import BuildOptions, build


def test_planner_packs_contiguous_layers_under_ceiling():
    assert plan_shards([10, 10, 10, 10], 25) == [(0, 2), (2, 4)]
    assert plan_shards([10, 10, 10, 10], 40) == [(0, 4)]
    assert plan_shards([10, 20, 10], 20) == [(0, 1), (1, 2), (2, 3)]
    assert plan_shards([], 20) == [(0, 0)]
    with pytest.raises(BuildError, match="layer 1 alone"):
        plan_shards([10, 30], 20)


def test_a_recipes_old_name_is_an_alias_of_its_new_one():
    """--quant w8a16 (the old name of the weight-only int8 recipe, fp16 activations) builds
    w8-fp16 and w8a16-qdq (fixed-point, uint16 activations) w8-u16; a bundle built under an
    old name is still judged by its recipe's gate and read as its recipe; an unknown name is
    one line naming the choices."""
    from hexforge.bundle.errors import BundleError
    from hexforge.bundle.manifest import TargetSpec
    from hexforge.forge.oracle.verify import GATES, gate_of
    from hexforge.forge.quantize.recipes import ALIASES, RECIPES, built_recipe

    assert BuildOptions(quant="w8a16").recipe is RECIPES["w8-fp16"]
    assert BuildOptions(quant="w8a16-qdq").recipe is RECIPES["w8-u16"]
    assert BuildOptions().recipe.name == "w8-fp16"
    assert all(ALIASES[old] in RECIPES and gate_of(old) is GATES[ALIASES[old]] for old in ALIASES)
    assert gate_of("int4") is GATES["int4"]  # the cpu target's weights are no recipe
    old = TargetSpec.model_construct(name="v81", htp_arch=81, quant="w4a16")  # a manifest's
    assert built_recipe(old) is RECIPES["w4-fp16"]
    with pytest.raises(BundleError, match="does not know"):
        built_recipe(old.model_copy(update={"quant": "w3a9"}))
    with pytest.raises(BuildError, match=r"unknown --quant 'w3a9'; choose from fp16, w8-fp16") as e:
        BuildOptions(quant="w3a9").validate()
    assert "\n" not in str(e.value)


def test_regression_the_greedy_planner_filled_every_shard_but_the_last():
    """Greedy packing cut Qwen3.5-4B (w8a16, v81) into [0,14) [14,28) [28,32): two full shards
    and a small one, and the weight-shared compile of a 14-layer shard peaked at 15.4 GiB
    (~9x its binary). The same three contexts hold ~11 layers each when the layers are spread."""
    assert plan_shards([10] * 32, 140) == [(0, 11), (11, 22), (22, 32)]
    # uneven layers: the fewest shards, then the smallest largest one
    assert plan_shards([10, 10, 10, 10, 10], 40) == [(0, 3), (3, 5)]
    assert plan_shards([30, 10, 10, 10, 30], 60) == [(0, 3), (3, 5)]
    layers = [7, 3, 9, 1, 8, 2, 6, 4, 5, 5, 9, 9]
    for cap in range(9, 80):
        got = plan_shards(layers, cap)
        greedy = _greedy(layers, cap)
        assert len(got) == len(greedy)
        assert max(sum(layers[a:b]) for a, b in got) <= max(sum(layers[a:b]) for a, b in greedy)
        assert got[0][0] == 0 and got[-1][1] == len(layers)
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(got))


def test_regression_a_heads_fp32_bytes_over_the_cpu_ceiling_failed_the_build(ckpt, tmp_path,
                                                                               monkeypatch):
    """Qwen3.5-4B's tied 248,320 x 2,560 head is 2.5 GB in fp32, over the cpu target's 2 GB
    shard ceiling: the build stopped there, though a head has no layers to split and the cpu
    target's weights are external files. The ceiling binds the head on HTP targets only."""
    from hexforge.bundle.targets import get_target
    from hexforge.families.llama import FAMILY
    from hexforge.forge.export.graphs import plan_target

    # 750 M weights: 3 GB in fp32 (the build's memory estimate counts them: ~6 GB, it fits)
    monkeypatch.setattr(type(FAMILY), "head_weight_bytes", lambda self, hf, bpw: int(0.75e9 * bpw))
    out = build(ckpt("llama"), tmp_path / "b", BuildOptions(context=64, prefill_len=8),
                log=lambda m: None)
    assert json.loads((out / "report.json").read_text())["cpu"]["greedy"]["exact"]
    hf = FAMILY.load_hf(ckpt("llama"))
    monkeypatch.setattr(type(FAMILY), "head_weight_bytes", lambda self, hf, bpw: 3 * 10**9)
    with pytest.raises(BuildError, match="the head holds 3,000,000,000 weight bytes"):
        plan_target(FAMILY, hf, get_target("v81"), BuildOptions(), lambda m: None)


def test_regression_the_planner_filled_a_context_to_its_ceiling_with_weights_alone(monkeypatch):
    """Qwen3.5-4B v81: 15 layers of int8 weights, 1.780 GB under the 1.8 GB per-context ceiling,
    compiled to a 1.847 GB binary, and the context is what must load on the device. The
    target's ceiling now leaves room for the binary's overhead; --max-shard-bytes stays a budget
    for the weights themselves."""
    from hexforge.bundle.targets import get_target
    from hexforge.families.llama import FAMILY
    from hexforge.forge.export.graphs import plan_target

    layer = 118_666_667  # a Qwen3.5-4B layer's int8 weights with a scale per 32
    # 30 layers: two shards of 15 fill the ceiling with weights alone; the context needs three
    monkeypatch.setattr(type(FAMILY), "layer_weight_bytes", lambda self, hf, bpw: [layer] * 30)
    monkeypatch.setattr(type(FAMILY), "head_weight_bytes", lambda self, hf, bpw: 10**6)
    v81 = get_target("v81")
    assert plan_target(FAMILY, None, v81, BuildOptions(), lambda m: None) == [
        (0, 10), (10, 20), (20, 30)]
    assert plan_target(FAMILY, None, v81, BuildOptions(max_shard_bytes=1_800_000_000),
                       lambda m: None) == [(0, 15), (15, 30)]


def test_the_disk_estimate_covers_the_peak_measured_on_gemma_4_e4b(monkeypatch):
    """Gemma-4-E4B's 42-layer decoder for v81 (--share-weights) took 43.7 GB of disk beyond its
    host tensors at its peak at w4a16 (the end of the HTP float export), 41.4 GB at w8a16 (its
    weights quantized beside the float graphs), and its cpu target 18.6 GB (docs/notes/realsize.md):
    the estimate a build says in its first minutes covers each without crying wolf. The
    layers' parameter counts are the real checkpoint's."""
    from hexforge.bundle.targets import parse_targets
    from hexforge.families.llama import FAMILY
    from hexforge.forge.export.graphs import disk_need

    sliding, full = 93_729_792, 106_837_504  # the 18 KV-shared layers have no k/v projections
    layers = ([sliding] * 5 + [full]) * 4 + ([91_108_096] * 5 + [101_594_112]) * 3
    monkeypatch.setattr(type(FAMILY), "layer_weight_bytes",
                        lambda self, hf, bpw: [int(n * bpw) for n in layers])
    monkeypatch.setattr(type(FAMILY), "head_weight_bytes", lambda self, hf, bpw: int(671_088_640 * bpw))
    for quant, peak in (("w4-fp16", 43.7e9), ("w8-fp16", 41.4e9)):
        need = disk_need(FAMILY, None, parse_targets("v81"), BuildOptions(quant=quant,
                                                                          share_weights=True))
        assert peak <= need <= 1.2 * peak, quant
    cpu = disk_need(FAMILY, None, parse_targets("cpu"), BuildOptions())
    assert 18.6e9 <= cpu <= 1.2 * 18.6e9
    # its towers (vision 169.3 M parameters, audio 308.8 M, the projections in): fp32 cpu graphs
    # and v81 binaries of 597,880,832 and 884,285,440 B (the 6-layer cut with both towers)
    towers = 169_330_688 + 308_756_768
    opts = BuildOptions(share_weights=True)
    added = (disk_need(FAMILY, None, parse_targets("v81"), opts, towers)
             - disk_need(FAMILY, None, parse_targets("v81"), opts))
    measured = 4 * towers + 597_880_832 + 884_285_440
    assert measured <= added <= 1.3 * measured
    # --device-only builds no cpu decoder graphs: the estimate is less their 18.6 GB (and 10 %)
    full = disk_need(FAMILY, None, parse_targets("v81"), opts, towers)
    slim = disk_need(FAMILY, None, parse_targets("v81"), BuildOptions(share_weights=True,
                                                                      device_only=True), towers)
    assert abs(full - slim - 1.1 * (sum(layers) + 671_088_640) * 4) < 1e3


def test_regression_genie_builds_filled_the_disk_their_estimate_had_no_genie_stage(monkeypatch):
    """Two --genie builds at real size stopped with a full disk in the Genie export, where the
    build had said its graphs fit: Gemma-4-E2B at w8-fp16 with 25.0 GB free (said 14.3 GB; it
    built with 51.1), Qwen3.5-4B at w4-fp16 with about 31.6 GB (said 26.4). The estimate now
    counts the Genie stage (its graphs, binaries and LUT, after the target's compiles); the
    layers' parameter counts are the real-shape checkpoints'."""
    from hexforge.bundle.targets import parse_targets
    from hexforge.families.llama import FAMILY
    from hexforge.forge.export.graphs import disk_need

    linear, full = 112_923_840, 107_484_672  # Qwen3.5-4B: 3 GatedDeltaNet layers, 1 attention
    e2b = ([36_577_280] * 4 + [43_655_680]) * 3 + ([64_102_144] * 4 + [70_393_856]) * 4
    for layers, head, quant, host, filled, said in (
            (([linear] * 3 + [full]) * 8, 635_699_200, "w4-fp16", 1.27e9, 31.6e9, 26.4e9),
            (e2b, 402_653_184, "w8-fp16", 5.50e9, 25.0e9, 14.3e9)):
        monkeypatch.setattr(type(FAMILY), "layer_weight_bytes",
                            lambda self, hf, bpw, n=layers: [int(x * bpw) for x in n])
        monkeypatch.setattr(type(FAMILY), "head_weight_bytes",
                            lambda self, hf, bpw, h=head: int(h * bpw))
        opts = dict(quant=quant, device_only=True, context=256, prefill_len=32, verify=False)
        plain = disk_need(FAMILY, None, parse_targets("v81"), BuildOptions(**opts))
        genie = disk_need(FAMILY, None, parse_targets("v81"), BuildOptions(genie=True, **opts),
                          lut_bytes=int(host))
        assert abs(plain - said) < 0.1e9, quant  # what the build said, the target alone
        assert genie > filled, quant
    assert genie < 51.1e9  # E2B built with that much free: no wolf cried


def test_the_towers_are_counted_as_stored_in_a_bf16_checkpoint(ckpt):
    """The disk estimate counts the towers' parameters without building their modules: the
    audio tower's computes its position table, which a bf16 tower cannot do outside the
    build's fp32 context (found on Gemma-4-E4B's real-shape checkpoint, before a build ran it)."""
    import torch

    from hexforge.families import load_family

    fam = load_family("gemma4").FAMILY
    hf = fam.load_hf(ckpt("gemma4_mm")).to(torch.bfloat16)
    m = hf.model
    towers = sum(p.numel() for t in (m.vision_tower, m.embed_vision, m.audio_tower, m.embed_audio)
                 for p in t.parameters())
    assert fam.tower_parameters(hf) == towers > 0
    llama = load_family("llama").FAMILY
    assert llama.tower_parameters(llama.load_hf(ckpt("llama"))) == 0


def test_regression_a_full_disk_was_found_at_the_sixth_compile_46_minutes_in(ckpt, tmp_path,
                                                                             monkeypatch):
    """Gemma-4-E4B's first full build stopped on a full disk 46 minutes in. A build says what its
    graphs will need beside the free space before its first export, as a warning when short."""
    import shutil

    logs = []
    build(ckpt("llama"), tmp_path / "a", BuildOptions(context=64, prefill_len=8, verify=False),
          log=logs.append)
    line = next(m for m in logs if m.startswith("disk: "))
    assert "GB at the build's peak" in line and f"{tmp_path} has " in line
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=0))
    logs.clear()
    out = build(ckpt("llama"), tmp_path / "b", BuildOptions(context=64, prefill_len=8, verify=False),
                log=logs.append)
    warned = next(i for i, m in enumerate(logs) if m.startswith("warning: disk: "))
    assert "0.0 GB free: the build may stop with a full disk" in logs[warned]
    assert warned < next(i for i, m in enumerate(logs) if "exported cpu/" in m)
    assert load_manifest(out).targets["cpu"].graphs  # a warning, not a refusal


def test_no_verify_skips_the_oracle(ckpt, tmp_path):
    out = build(ckpt("llama"), tmp_path / "b", BuildOptions(context=64, prefill_len=8, verify=False),
                log=lambda m: None)
    assert not (out / "report.json").exists()
    assert load_manifest(out).report is None


def test_failing_gate_writes_no_bundle_but_keeps_its_report_beside_it(ckpt, tmp_path, monkeypatch):
    from hexforge.families import blocks

    real_init = blocks.DenseShard.__init__

    def corrupted(self, *a, **kw):  # a broken export: layer 0's o_proj scaled in the graph
        real_init(self, *a, **kw)
        import torch

        self.layers[0].attn.o_proj = torch.nn.Linear(
            self.layers[0].attn.o_proj.in_features, self.layers[0].attn.o_proj.out_features)

    monkeypatch.setattr(blocks.DenseShard, "__init__", corrupted)
    out = tmp_path / "bad"
    with pytest.raises(ParityGateError, match=r"parity gate failed.*bad\.report\.json"):
        build(ckpt("llama"), out, BuildOptions(context=64, prefill_len=8), log=lambda m: None)
    assert not out.exists()
    assert not list(tmp_path.glob(".bad.partial-*"))
    # the failing report is kept beside the output: which graph lost the accuracy
    report = json.loads((tmp_path / "bad.report.json").read_text())
    assert not report["cpu"]["passed"] and report["cpu"]["failures"]


def test_pickle_only_checkpoint_is_refused(ckpt, tmp_path):
    import shutil

    src = ckpt("llama")
    dst = tmp_path / "pickled"
    shutil.copytree(src, dst)
    (dst / "model.safetensors").rename(dst / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only pickle weights"):
        build(dst, tmp_path / "out", BuildOptions(), log=lambda m: None)


def test_rebuild_replaces_an_existing_bundle(ckpt, tmp_path):
    opts = BuildOptions(context=64, prefill_len=8, verify=False)
    out = build(ckpt("llama"), tmp_path / "b", opts, log=lambda m: None)
    (out / "marker").write_text("old")
    build(ckpt("llama"), out, opts, log=lambda m: None)
    assert not (out / "marker").exists() and load_manifest(out)


def test_output_dir_that_is_not_a_bundle_is_not_replaced(ckpt, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.txt").write_text("do not delete")
    with pytest.raises(BuildError, match="not a hexforge bundle"):
        build(ckpt("llama"), out, BuildOptions(context=64, prefill_len=8, verify=False),
              log=lambda m: None)
    assert (out / "thesis.txt").read_text() == "do not delete"


def test_prefill_and_decode_share_one_weight_file(bundle):
    b = bundle("llama")
    import onnx

    locs = set()
    for g in ("s0.prefill", "s0.decode"):
        m = onnx.load(str(b / "cpu" / f"{g}.onnx"), load_external_data=False)
        locs |= {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    assert locs == {"s0.weights"}
    manifest = json.loads((b / "manifest.json").read_text())
    assert manifest["state"][0]["kind"] == "kv_full"


def test_regression_exporter_side_files_were_left_in_the_bundle(tmp_path):
    """A graph over protobuf's 2 GB (Qwen3-0.6B fp32's last decode graph with the head) comes out
    of the exporter with one file per tensor beside it; they stayed in the bundle (2.3 GB of
    orphans) and could be overwritten by the next export's tensors of the same name."""
    import onnx
    from onnx import helper, numpy_helper

    from hexforge.forge.export.onnxexport import gather_side_files

    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(2))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True,
              all_tensors_to_one_file=False, size_threshold=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx", "w1", "w2"]
    assert gather_side_files(path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx", "g.onnx.data"]
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    np.testing.assert_array_equal(got["w1"], w1)
    np.testing.assert_array_equal(got["w2"], w2)
    assert gather_side_files(path) == 0  # already gathered: nothing to do


def test_share_weights_streams_the_exporters_external_weights_into_one_deduplicated_file(tmp_path):
    """Without a transform, share_weights reads each externally stored weight by itself (a
    real-size HTP shard's fp32 graph loaded whole was the build's peak memory); the prefill and
    decode graphs' equal weights are stored once and both graphs compute as before."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from hexforge.forge.export.onnxexport import share_weights

    rng = np.random.default_rng(1)
    w, b = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    graphs = [tmp_path / "s0.prefill.onnx", tmp_path / "s0.decode.onnx"]
    for path, rows in zip(graphs, (4, 1), strict=True):
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
            "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [rows, 64])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [rows, 64])],
            [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
        onnx.save(helper.make_model(graph), str(path), save_as_external_data=True,
                  location=path.name + ".data", size_threshold=0)  # as export_module leaves it
    written = share_weights(graphs, "s0.weights")
    assert written == w.nbytes  # once; b (256 B) back inline in each graph
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "s0.decode.onnx", "s0.prefill.onnx", "s0.weights"]
    for g, rows in zip(graphs, (4, 1), strict=True):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        y = ort.InferenceSession(str(g), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(y, x @ w + b, rtol=1e-5, atol=1e-5)


def test_regression_a_genie_splits_weights_were_on_disk_three_times(tmp_path):
    """A Genie split's AR-N and AR-1 graphs hold the same weights (a Qwen3.5-4B split, ~10 GB in
    fp32): both graphs' exported weights and the file gathering them were on disk at once, three
    times the split, and the build stopped with a full disk. ``extend`` adds each graph to the
    split's file as it comes: the weights it holds already are pointed at, not written again,
    and the graph's own export goes."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from hexforge.forge.export.onnxexport import share_weights

    rng = np.random.default_rng(2)
    w, v = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(2))

    def export(name: str, rows: int, weights: dict) -> Path:
        path = tmp_path / name
        nodes, x = [], "x"
        for i, k in enumerate(weights):
            nodes.append(helper.make_node("MatMul", [x, k], [f"h{i}"]))
            x = f"h{i}"
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [rows, 64])],
            [helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, [rows, 64])],
            [numpy_helper.from_array(a, k) for k, a in weights.items()])
        onnx.save(helper.make_model(graph), str(path), save_as_external_data=True,
                  location=path.name + ".data", size_threshold=0)
        return path

    graphs = [export("prompt.onnx", 4, {"w": w})]
    assert share_weights(graphs, "split.weights", extend=True) == w.nbytes
    graphs.append(export("token.onnx", 1, {"w": w}))
    assert share_weights(graphs, "split.weights", extend=True) == 0  # held already
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompt.onnx", "split.weights",
                                                          "token.onnx"]
    graphs.append(export("other.onnx", 2, {"w": w, "v": v}))  # one weight new: it alone added
    assert share_weights(graphs, "split.weights", extend=True) >= v.nbytes
    assert (tmp_path / "split.weights").stat().st_size < 2 * w.nbytes + 4096
    for g, rows, want in zip(graphs, (4, 1, 2), (lambda x: x @ w, lambda x: x @ w,
                                                  lambda x: x @ w @ v), strict=True):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        y = ort.InferenceSession(str(g), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(y, want(x), rtol=1e-4, atol=1e-4)


def test_regression_gathered_weights_were_inlined_past_protobufs_2_gb(tmp_path):
    """Gathering the exporter's side files told initializers from attribute values by the id()
    of protobuf's Python wrappers, which are made anew on each access: every weight was taken
    for an attribute and put inline, and a real-size shard (6.8 GB fp32) failed to save
    ("Failed to serialize proto"). Each weight must stay outside the graph, in <graph>.data."""
    import onnx
    from onnx import helper, numpy_helper

    from hexforge.forge.export.onnxexport import gather_side_files

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(64):
        inits.append(numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]))
        x = f"h{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, 16])],
                              [helper.make_tensor_value_info(x, 1, [1, 16])], inits)
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True,
              all_tensors_to_one_file=False, size_threshold=0)
    assert gather_side_files(path) == 64
    m = onnx.load(str(path), load_external_data=False)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx", "g.onnx.data"]


def test_regression_constant_value_side_files_were_left_in_the_bundle(tmp_path):
    """The exporter also writes a large Constant node's value as a file of its own
    (``_shard_shard_layers.3_mixer_Constant_18_attr__value``, 128 KiB, two per real-size Qwen3.5
    cpu bundle, one pair per Qwen3 one). Only the initializers' files were gathered, so these
    were left in the bundle, read by no graph once the weights were shared."""
    import onnx
    from onnx import helper, numpy_helper

    from hexforge.forge.export.onnxexport import gather_side_files

    rng = np.random.default_rng(0)
    w, c = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c, "c_value")),
         helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "c"], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
        [numpy_helper.from_array(w, "w")])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True,
              all_tensors_to_one_file=False, size_threshold=0, convert_attribute=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c_value", "g.onnx", "w"]
    assert gather_side_files(path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx", "g.onnx.data"]
    x = rng.standard_normal((1, 64)).astype(np.float32)
    import onnxruntime as ort

    y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ w + c, rtol=1e-5, atol=1e-5)


def test_exports_side_by_side_write_what_one_at_a_time_writes(ckpt, tmp_path):
    """export_modules forks a child per graph (a shard's prefill / decode / verify at once): the
    same files and IO specs as exporting them in turn in this process."""
    from hexforge.families import load_family
    from hexforge.forge.export.onnxexport import export_modules
    from hexforge.forge.source.checkpoint import read_checkpoint

    c = read_checkpoint(ckpt("qwen3"), lambda m: None)
    fam = load_family(c.model_type).FAMILY
    args = fam.Args.from_config(c.config)
    hf = fam.load_hf(c.dir)
    mods = [fam.cpu_step_module(hf, args, (0, 2), n, 32) for n in (4, 1, 3)]
    got = {}
    for workers in (1, 3):
        (tmp_path / str(workers)).mkdir()
        paths = [tmp_path / str(workers) / f"g{i}.onnx" for i in range(3)]
        order: list[int] = []
        specs = export_modules(list(zip(mods, paths, strict=True)), "torchscript", fold=True,
                               done=lambda i, s, order=order: order.append(i), workers=workers)
        assert sorted(order) == [0, 1, 2]
        got[workers] = specs, [p.read_bytes() for p in paths]
        assert sorted(f.name for f in paths[0].parent.iterdir()) == ["g0.onnx", "g1.onnx",
                                                                      "g2.onnx"]
    assert got[1] == got[3]
    assert [ins[0].shape[1] for ins, _ in got[3][0]] == [4, 1, 3]


class _Fails:
    """A module whose export fails in the child: by raising, or by the child being killed."""

    def __init__(self, kill: bool):
        import torch

        from hexforge.families.graphio import GraphIO

        self.kill, self.io, self.torch = kill, GraphIO(inputs=[("x", "x")], outputs=[("y", "y")]), torch

    def example_inputs(self):
        return (self.torch.ones(2),)

    def __call__(self, x):
        import os
        import signal

        if self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("no such op")


@pytest.mark.parametrize("kill", [False, True])
def test_a_failed_or_killed_export_child_is_a_one_line_build_error(tmp_path, kill):
    """The child's error reaches the build as a BuildError (a child killed for memory says so);
    its sibling is stopped, not waited for, and no result file is left behind."""
    import os
    import time

    import torch

    from hexforge.forge.export.onnxexport import export_modules

    started, finished = tmp_path / "started", tmp_path / "finished"

    class Slow(torch.nn.Module):
        io = _Fails(False).io

        def example_inputs(self):
            return (torch.ones(2),)

        def forward(self, x):
            started.write_text(str(os.getpid()))
            time.sleep(120)
            finished.touch()
            return x

    class Bad(_Fails):
        def __call__(self, x):
            while not started.is_file():  # fail once the sibling is under way
                time.sleep(0.01)
            return super().__call__(x)

    with pytest.raises(BuildError, match="killed by signal 9 .out of memory" if kill
                       else "ValueError: no such op"):
        export_modules([(Slow(), tmp_path / "slow.onnx"), (Bad(kill), tmp_path / "bad.onnx")],
                       "torchscript", workers=2)
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(int(started.read_text()), 0)
    assert not finished.exists() and not list(tmp_path.glob("*.json"))
    assert sorted(f.name for f in tmp_path.iterdir()) == ["started"]  # no child's folder left


def test_regression_an_export_child_killed_writing_its_result_was_a_json_error(tmp_path):
    """A child killed with half its result written: the build said JSONDecodeError (and left the
    file); it is the kill, as a one-line BuildError, and nothing is left."""
    import os
    import signal

    from hexforge.forge.export.onnxexport import export_modules

    class KilledWriting(_Fails):
        def __init__(self, name: str):
            super().__init__(True)
            self.name = name

        def __call__(self, x):
            (tmp_path / f"{self.name}.export.json").write_text('{"inputs": [{"na')
            os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(BuildError, match="killed by signal 9"):
        export_modules([(KilledWriting(n), tmp_path / n) for n in ("g.onnx", "h.onnx")],
                       "torchscript", workers=2)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("available", [1, 1 << 50])
def test_exports_side_by_side_only_while_memory_holds_them(tmp_path, monkeypatch, available):
    """A second export child starts only if the machine's available memory holds its need and
    the running one's (twice each module's fp32 weights); else they run one after another."""
    import time

    import torch

    from hexforge.forge import heap as memory
    from hexforge.forge.export.onnxexport import export_modules, export_need

    class Marks(torch.nn.Module):
        io = _Fails(False).io

        def __init__(self, i):
            super().__init__()
            self.i, self.w = i, torch.nn.Parameter(torch.ones(256, 2))

        def example_inputs(self):
            return (torch.ones(2),)

        def forward(self, x):
            (tmp_path / f"{self.i}.start").touch()
            time.sleep(1.0)
            if any(not (tmp_path / f"{j}.end").exists()
                   for j in range(2) if j != self.i and (tmp_path / f"{j}.start").exists()):
                (tmp_path / "overlap").touch()
            (tmp_path / f"{self.i}.end").touch()
            return x * self.w.sum()

    monkeypatch.setattr(memory, "available_bytes", lambda: available)
    mods = [Marks(0), Marks(1)]
    assert 8 * 512 <= export_need(mods[0]) < 8 * 512 + 64  # the weights, and an 8-byte input
    export_modules([(m, tmp_path / f"m{m.i}.onnx") for m in mods], "torchscript", workers=2)
    assert (tmp_path / "overlap").exists() == (available > 1)
    assert all((tmp_path / f"m{i}.onnx").is_file() for i in range(2))


def test_regression_side_by_side_exports_overwrote_each_others_tensor_files(tmp_path, monkeypatch):
    """A graph over 2 GB leaves the exporter as one file per tensor, named by the exporter
    (``onnx__MatMul_5298``); two children exporting into one folder overwrote each other's, and
    Qwen3.5-4B's 16-layer prefill read a decode weight of another size. Each child now exports
    in a folder of its own and moves its graph and ``.data`` in when done."""
    import time

    import torch

    from hexforge.forge.export import onnxexport as export

    def exporter_like(module, path, exporter, fold=False):
        side = path.parent / "onnx__MatMul_5298"  # the same name in both graphs
        side.write_bytes(bytes([module.i]) * (1000 + module.i))
        time.sleep(1.0)  # the sibling writes its own meanwhile
        raw = side.read_bytes()
        if raw != bytes([module.i]) * (1000 + module.i):
            raise BuildError(f"{path.name}: a weight of {len(raw)} bytes")
        side.rename(path.with_name(path.name + ".data"))  # gathered
        path.write_bytes(b"graph")
        return [], []

    class M(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i

    monkeypatch.setattr(export, "export_module", exporter_like)
    export.export_modules([(M(i), tmp_path / f"g{i}.onnx") for i in (1, 2)], "torchscript",
                          workers=2)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["g1.onnx", "g1.onnx.data", "g2.onnx",
                                                          "g2.onnx.data"]
    assert (tmp_path / "g2.onnx.data").read_bytes() == bytes([2]) * 1002
