"""bf16 checkpoints (real ones are): loaded as stored, fp32 only where exported / run.

The HF model stays bf16 resident; the oracle's forward computes exactly as an fp32 model holding
the same bf16 values (the old fp32 load), and a bf16 tiny Gemma-4 builds greedy-exact on cpu.
"""

from __future__ import annotations

import json
import mmap
import re
import shutil
from pathlib import Path

import pytest
import torch

import hexforge
from tests.conftest import CONTEXT, N, prompt_ids


@pytest.fixture(scope="session")
def bf16_ckpt(ckpt, tmp_path_factory):
    """bf16_ckpt("gemma4") -> the tiny checkpoint with every tensor stored bf16."""
    from safetensors.torch import load_file, save_file

    made = {}

    def get(family: str):
        if family not in made:
            src = ckpt(family)
            dst = tmp_path_factory.mktemp(f"bf16-{family}")
            for f in src.iterdir():
                if f.suffix == ".safetensors":
                    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                               for k, v in load_file(str(f)).items()}, str(dst / f.name),
                              metadata={"format": "pt"})
                elif f.is_file():
                    shutil.copy2(f, dst / f.name)
            made[family] = dst
        return made[family]

    return get


def _family(path):
    from hexforge.families import load_family

    return load_family(json.loads((path / "config.json").read_text())["model_type"]).FAMILY


def _fp32_twin(path):
    """What the old load made: the bf16 values in an fp32 model (with its towers: a VLM)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vlm = "vision_config" in json.loads((path / "config.json").read_text())
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    return auto.from_pretrained(str(path), dtype=torch.float32,
                                attn_implementation="eager").eval()


def _encoders(fam, hf, path):
    """[(encoder family, spec)] of a multimodal checkpoint's towers; [] for text-only ones."""
    from hexforge.families import encoder_families

    config = json.loads((path / "config.json").read_text())
    return [(e, e.spec(hf, config)) for e in encoder_families(config)]


def test_stored_dtype_is_read_from_the_safetensors(ckpt, bf16_ckpt):
    from hexforge.families.lowp import stored_lowp_dtype

    assert stored_lowp_dtype(ckpt("gemma4")) is None  # fp32: loaded as before
    assert stored_lowp_dtype(bf16_ckpt("gemma4")) == "bfloat16"


@pytest.mark.parametrize("family", ["gemma4", "llama", "qwen3_vl", "gemma4_mm"])
@pytest.mark.parametrize("big_table", [None, 1])  # 1: every embedding table takes the gather path
def test_float32_forward_is_bit_identical_to_the_fp32_model(bf16_ckpt, family, big_table,
                                                            monkeypatch):
    from hexforge.families import lowp

    if big_table is not None:
        monkeypatch.setattr(lowp, "BIG_TABLE", big_table)
    path = bf16_ckpt(family)
    fam = _family(path)
    hf, ref = fam.load_hf(path), _fp32_twin(path)
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    bufs, ref_bufs = dict(hf.named_buffers()), dict(ref.named_buffers())
    assert bufs.keys() == ref_bufs.keys()
    for k, b in bufs.items():  # computed ones (rope, embed_scale) recomputed in fp32
        assert b.dtype == ref_bufs[k].dtype and torch.equal(b, ref_bufs[k]), k
    ids = torch.tensor([prompt_ids(2 * N + 3)])
    with torch.no_grad():
        want = ref(ids).logits
        with fam.float32_forward(hf):
            got = hf(ids).logits
        assert got.dtype == torch.float32 and torch.equal(got, want)
    for enc, spec in _encoders(fam, hf, path):  # the towers: fp32 while they run
        from hexforge.forge.export.encoders import example_feeds

        feeds = example_feeds(enc, spec)
        with fam.float32_forward(hf):
            got = enc.reference(hf, feeds)
        want = enc.reference(ref, feeds)
        assert got.keys() == want.keys() and all(
            got[k].dtype == want[k].dtype and (got[k] == want[k]).all() for k in want)
    from hexforge.forge.oracle.verify import hf_greedy_tokens

    with fam.float32_forward(hf):
        assert hf_greedy_tokens(hf, prompt_ids(N + 1), 16) == hf_greedy_tokens(
            ref, prompt_ids(N + 1), 16)
    # everything back as loaded: bf16 parameters, no hooks, no patched forwards
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    assert not any(m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__
                   for m in hf.modules())


def test_a_decoder_shards_export_leaves_the_encoder_towers_as_stored(bf16_ckpt):
    """towers=False (every decoder shard and head export): the shard's layers and the text
    model's small tensors fp32, the vision / audio towers (0.4-0.9 B parameters at real size)
    left bf16; towers=True (the encoders' own export) upcasts them."""
    path = bf16_ckpt("gemma4_mm")
    fam = _family(path)
    hf = fam.load_hf(path)
    text = {id(p) for p in fam.text_model(hf).parameters()}
    towers = [p for p in hf.parameters() if id(p) not in text and p is not hf.lm_head.weight]
    layers = fam.reference_layers(hf)
    assert towers
    with fam.float32(hf, layers=(0, 1), towers=False):
        assert {p.dtype for p in layers[0].parameters()} == {torch.float32}
        assert {p.dtype for p in layers[1].parameters()} == {torch.bfloat16}
        assert fam.text_model(hf).norm.weight.dtype == torch.float32
        assert {p.dtype for p in towers} == {torch.bfloat16}
    with fam.float32(hf):
        assert {p.dtype for p in towers} == {torch.float32}
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}


def test_bf16_checkpoint_builds_greedy_exact_with_bf16_resident_weights(bf16_ckpt, tmp_path,
                                                                        monkeypatch):
    """Three shards; at every export only that shard's decoder layers are fp32 (the old fp32 load
    had all of them fp32 all the time), and the bundle matches HF fp32 greedy exactly."""
    from hexforge.forge.export import graphs
    from hexforge.forge.oracle.verify import hf_greedy_tokens
    from hexforge.forge.pipeline import BuildOptions, build

    path = bf16_ckpt("gemma4")
    fam = _family(path)
    loaded, seen = [], []
    load = fam.load_hf
    monkeypatch.setattr(fam, "load_hf", lambda d: loaded.append(load(d)) or loaded[-1])
    export = graphs.export_modules

    def spy(jobs, *a, **kw):
        layers = fam.reference_layers(loaded[0])
        fp32 = [i for i, layer in enumerate(layers)
                if any(p.dtype == torch.float32 for p in layer.parameters())]
        seen.extend((out.name, fp32, {p.dtype for layer in layers for p in layer.parameters()
                                      if fp32 and layer is not layers[fp32[0]]})
                    for _, out in jobs)
        return export(jobs, *a, **kw)

    monkeypatch.setattr(graphs, "export_modules", spy)
    out = build(path, tmp_path / "b", BuildOptions(context=CONTEXT, prefill_len=N,
                                                   max_shard_bytes=900_000), log=lambda m: None)
    report = json.loads((out / "report.json").read_text())["cpu"]
    assert report["passed"] and report["greedy"]["exact"]
    from hexforge.bundle.hostfile import check_safetensors_header

    tables = {k: t["dtype"] for k, t in check_safetensors_header(out / "host.safetensors").items()
              if k != "__metadata__" and len(t["shape"]) == 2}
    assert len(tables) == 2 and set(tables.values()) == {"BF16"}  # embed + per-layer, as stored
    by_graph = {name: fp32 for name, fp32, _ in seen}
    assert by_graph["s0.prefill.onnx"] == by_graph["s0.decode.onnx"] == [0, 1, 2, 3]
    assert by_graph["s1.prefill.onnx"] == [4, 5, 6] and by_graph["s2.decode.onnx"] == [7, 8, 9]
    assert by_graph["head.onnx"] == []
    assert {p.dtype for p in loaded[0].parameters()} == {torch.bfloat16}  # restored after
    ref = _fp32_twin(path)
    model = hexforge.load(out)
    for length in (1, N + 1, 3 * N + 5):
        ids = prompt_ids(length)
        assert model.generate(ids, max_new_tokens=32, ignore_eos=True).token_ids == \
            hf_greedy_tokens(ref, ids, 32)


def test_host_tensors_are_written_in_chunks_and_read_as_maps(tmp_path):
    """bf16 / fp16 tables stay in their precision (they were written as F32: twice the bytes) and
    the runtime's rows are their exact fp32 upcast; fp32 ones stay fp32."""
    import numpy as np

    from hexforge.bundle.hostfile import check_safetensors_header, load_host_tensors
    from hexforge.forge.export.hostwrite import write_host_tensors

    table = torch.randn(1000, 24).to(torch.bfloat16)
    half, full = torch.randn(300, 8).half(), torch.randn(7, 3)
    path = tmp_path / "host.safetensors"
    write_host_tensors(path, {"t": table, "h": half, "f": full,
                              "inv": np.arange(5, dtype=np.float32),
                              "i": np.arange(3, dtype=np.int64), "s": torch.tensor(2.5)})
    header = check_safetensors_header(path)
    assert {k: header[k]["dtype"] for k in ("t", "h", "f", "s")} == {
        "t": "BF16", "h": "F16", "f": "F32", "s": "F32"}
    assert path.stat().st_size < 1000 * 24 * 2 + 300 * 8 * 2 + 1000  # 2 bytes an element
    got = load_host_tensors(path)
    for name, ref in (("t", table), ("h", half), ("f", full)):
        assert np.array_equal(got[name].astype(np.float32), ref.float().numpy()), name
        assert got[name].astype(np.float32).dtype == np.float32
    base = got["t"]  # a plain view of a read-only map (not read into memory)
    while isinstance(base, np.ndarray):
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base  # np.frombuffer's view of the map
    assert isinstance(base, mmap.mmap) and not got["t"].flags.writeable
    assert np.array_equal(got["inv"], np.arange(5)) and got["i"].tolist() == [0, 1, 2]
    assert got["s"].shape == () and float(got["s"]) == 2.5
    from safetensors.torch import load_file

    std = load_file(str(path))  # a standard safetensors file
    assert std["t"].dtype == torch.bfloat16 and torch.equal(std["t"], table)
    assert torch.equal(std["h"], half) and torch.equal(std["f"], full)


@pytest.mark.skipif(not hasattr(mmap, "MADV_RANDOM") or not Path("/proc/self/smaps").exists(),
                    reason="madvise advice is read back from Linux's /proc/self/smaps")
def test_regression_host_table_gathers_faulted_in_the_kernels_read_around(tmp_path):
    """A row gather from a map under the default advice read the kernel's whole read-around
    window on each page fault (a cold E2B per-layer row: 2.3-5.3 ms vs 0.28 ms advised). The
    kernel reports MADV_RANDOM on a mapping as VmFlags "rr": every map the host tables are read
    through must carry it."""
    import numpy as np

    from hexforge.bundle.hostfile import load_host_tensors
    from hexforge.forge.export.hostwrite import write_host_tensors

    path = tmp_path / "host.safetensors"
    write_host_tensors(path, {"t": np.ones((4096, 64), np.float32)})  # 1 MB: many pages
    got = load_host_tensors(path)
    assert float(got["t"][4000, 0]) == 1.0
    flags, in_map = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line: its address range
            in_map = line.endswith(str(path))
        elif in_map and line.startswith("VmFlags:"):
            flags.append(line.split()[1:])
    assert flags, "the host table file is not mapped"
    assert all("rr" in f for f in flags), flags


def test_int8_host_tables_dequantize_their_rows_within_one_step(tmp_path):
    """--cpu-weights int8 bundles (and the per-layer tables of int4 ones) keep their tables as
    8-bit rows with a scale per 32 columns in onnxruntime's 8-bit MatMulNBits layout (uint8, zero
    point 128, scale absmax / 128: a positive absmax clips to 127, one step off; its RMS error is
    int8's); a width 32 does not divide: int8 rows, one scale a row (absmax / 127, half a step)."""
    import numpy as np

    from hexforge.bundle.errors import BundleError
    from hexforge.bundle.hostfile import check_safetensors_header, load_host_tensors
    from hexforge.bundle.qtables import Int8Table
    from hexforge.forge.export.hostwrite import write_host_tensors

    wide, odd = torch.randn(300, 96).to(torch.bfloat16), torch.randn(40, 20) * 5
    path = tmp_path / "host.safetensors"
    write_host_tensors(path, {"wide": wide, "odd": odd, "kept": torch.randn(4, 8)},
                       {"wide": (8, 32), "odd": (8, 32)})
    header = check_safetensors_header(path)
    assert header["wide"]["dtype"] == "U8" and header["wide.int8_scales"]["shape"] == [300, 3]
    assert header["odd"]["dtype"] == "I8" and header["odd.int8_scales"]["shape"] == [40, 1]
    assert header["kept"]["dtype"] == "F32"
    got = load_host_tensors(path)
    assert "wide.int8_scales" not in got and isinstance(got["wide"], Int8Table)
    for name, ref, block, bound in (("wide", wide.float().numpy(), 32, 1 / 128),
                                    ("odd", odd.numpy(), 20, 0.5 / 127)):
        table = got[name]
        assert table.shape == ref.shape and table.ndim == 2
        ids = np.array([0, 7, 7, len(ref) - 1])
        rows = table[ids]
        assert rows.dtype == np.float32 and rows.shape == (4, ref.shape[1])
        err = np.abs(rows - ref[ids]).reshape(4, -1, block)
        assert (err <= np.abs(ref[ids].reshape(4, -1, block)).max(-1, keepdims=True) * bound
                * 1.0001).all()
        rel = np.linalg.norm(rows - ref[ids], axis=-1) / np.linalg.norm(ref[ids], axis=-1)
        assert (rel < 0.01).all()  # ~0.005 for Gaussian rows either way
        np.testing.assert_array_equal(table[7], rows[1])  # one id: one row
    # a table written before the U8 layout (int8 rows, zero point 0, per-32 scales) still loads
    from safetensors.numpy import save_file

    q = np.arange(-64, 64, dtype=np.int8).reshape(2, 64)
    save_file({"t": q, "t.int8_scales": np.array([[1, 2], [3, 4]], np.float32)},
              str(tmp_path / "old.safetensors"))
    old = load_host_tensors(tmp_path / "old.safetensors")["t"]
    np.testing.assert_array_equal(old[1], q[1] * np.repeat([3, 4], 32).astype(np.float32))
    # scales without their rows: the bundle is broken, said so
    save_file({"t.int8_scales": np.ones((3, 1), np.float32)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(BundleError, match="int8 rows"):
        load_host_tensors(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_host_tables_are_matmulnbits_rows(tmp_path, bits):
    """--cpu-weights int4 / int8 bundles keep the embedding in MatMulNBits' layout: a row
    dequantizes to what a MatMulNBits over the table (rows as N) computes for a one-hot input,
    exactly, and within one step of the float row (absmax / 8 or / 128: onnxruntime maps a
    block's largest magnitude to -8 / -128, so a value near it of the other sign clips at +7 /
    +127). That is what lets a tied head's weight serve as the table (forge/quantize/tiedembed.py)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from hexforge.bundle.errors import BundleError
    from hexforge.bundle.hostfile import check_safetensors_header, load_host_tensors
    from hexforge.bundle.qtables import INT4_SCALES, INT8_SCALES, Int4Table, Int8Table
    from hexforge.forge.export.hostwrite import write_host_tensors

    V, D, block = 50, 64, 32
    suffix, cls, levels = {4: (INT4_SCALES, Int4Table, 8), 8: (INT8_SCALES, Int8Table, 128)}[bits]
    table = torch.randn(V, D).to(torch.bfloat16)
    path = tmp_path / "host.safetensors"
    write_host_tensors(path, {"t": table}, {"t": (bits, block)})
    header = check_safetensors_header(path)
    assert header["t"] == {**header["t"], "dtype": "U8", "shape": [V, D * bits // 8]}
    assert header["t" + suffix]["shape"] == [V, D // block]
    got = load_host_tensors(path)["t"]
    assert isinstance(got, cls) and got.shape == (V, D) and got.block == block
    rows = got[np.arange(V)]
    ref = table.float().numpy()
    step = np.abs(ref.reshape(V, -1, block)).max(-1, keepdims=True) / levels
    assert (np.abs(rows - ref).reshape(V, -1, block) <= step * 1.0001).all()
    np.testing.assert_array_equal(got[7], rows[7])
    np.testing.assert_array_equal(got[np.array([[3, 9]])][0], rows[[3, 9]])
    # the same bytes as MatMulNBits B [N, K / block, block x bits / 8] and scales: identity in,
    # W^T out
    node = helper.make_node("MatMulNBits", ["x", "B", "s"], ["y"], domain="com.microsoft",
                            K=D, N=V, bits=bits, block_size=block, accuracy_level=0)
    B = got.q.reshape(V, D // block, block * bits // 8)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [D, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [D, V])],
                          [numpy_helper.from_array(B, "B"),
                           numpy_helper.from_array(got.scales.reshape(-1), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    onnx.checker.check_model(m)
    np.testing.assert_array_equal(sess.run(None, {"x": np.eye(D, dtype=np.float32)})[0].T, rows)
    from safetensors.numpy import save_file

    save_file({"t" + suffix: np.ones((3, 1), np.float32)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(BundleError, match=f"int{bits} rows"):
        load_host_tensors(tmp_path / "bad.safetensors")
    if bits == 4:  # a width the block does not split is refused at build time, not written wrong
        with pytest.raises(ValueError, match="blocks of 128"):
            write_host_tensors(tmp_path / "x.safetensors", {"t": table}, {"t": (4, 128)})


def test_shared_int4_rows_outside_their_file_are_a_bundle_error(tmp_path):
    """A manifest's SharedRows (a tied head's int4 rows) that do not fit the weight file, the
    table's shape or its bits fail with the table and the file named, before any gather reads
    past them."""
    import numpy as np

    from hexforge.bundle.errors import BundleError
    from hexforge.bundle.hostfile import load_host_tensors, shared_table
    from hexforge.bundle.manifest import SharedRows
    from hexforge.forge.export.hostwrite import write_host_tensors
    from hexforge.forge.quantize.tiedembed import drop_host_tensors

    V, D, block = 12, 64, 32
    path = tmp_path / "host.safetensors"
    inv = np.arange(4, dtype=np.float64)
    write_host_tensors(path, {"t": torch.randn(V, D), "inv": inv, "b": np.ones(3, np.uint8)},
                       {"t": (4, block)})
    host = load_host_tensors(path)
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"\0" * 16 + host["t"].q.tobytes() + host["t"].scales.tobytes())
    good = SharedRows(file="w.bin", rows=(16, V * D // 2), scales=(16 + V * D // 2, V * 2 * 4),
                      shape=(V, D), block=block)
    shared = shared_table(weights, "t", good)
    np.testing.assert_array_equal(shared[np.arange(V)], host["t"][np.arange(V)])
    for bad, why in ((dict(rows=(17 + V * D, V * D // 2)), "rows"),
                     (dict(scales=(16 + V * D // 2, V * 2 * 4 + 4)), "scales"),
                     (dict(block=48), "blocks of 48"), (dict(shape=(V, D + 2)), "blocks of 32"),
                     (dict(block=0), "blocks of 0"), (dict(shape=(0, D)), "blocks of 32"),
                     (dict(bits=8), "rows"), (dict(bits=3), "int3 blocks")):  # int8: twice the rows
        with pytest.raises(BundleError, match=f"host table 't'.*{why}"):
            shared_table(weights, "t", good.model_copy(update=bad))
    with pytest.raises(BundleError, match="cannot be read"):
        shared_table(tmp_path / "gone.bin", "t", good)
    # the table leaves host.safetensors; the rest reads back as it was, aligned
    drop_host_tensors(path, {"t", "t.int4_scales"})
    rest = load_host_tensors(path)
    assert sorted(rest) == ["b", "inv"] and rest["inv"].tolist() == inv.tolist()
    assert rest["b"].tolist() == [1, 1, 1]


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of ``path`` (smaps)."""
    total, cur = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0] and not line.endswith(":\n"):
            cur = line.rstrip("\n").endswith(str(path))
        elif cur and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_regression_build_kept_every_checkpoint_page_it_had_read_resident(bf16_ckpt, tmp_path):
    """E2B v81: the mapped checkpoint stayed in RSS after the host tensors (8.7 of a 17 GB peak)
    though every later stage reads one shard of it. The build gives those pages back; the model
    reads the same values after, and a mapping with copy-on-write pages keeps them."""
    import numpy as np

    from hexforge.forge.heap import release_mapped_pages

    path = bf16_ckpt("gemma4")
    hf = _family(path).load_hf(path)
    before = [p.detach().float().sum().item() for p in hf.parameters()]  # reads every page
    st = next(path.glob("*.safetensors")).resolve()
    resident = _mapped_rss(st)
    assert resident > 1 << 20, "transformers no longer maps the checkpoint?"
    assert release_mapped_pages(hf.name_or_path) >= resident
    assert _mapped_rss(st) == 0
    assert [p.detach().float().sum().item() for p in hf.parameters()] == before

    (tmp_path / "w.bin").write_bytes(np.arange(1 << 18, dtype=np.float32).tobytes())
    cow = np.memmap(tmp_path / "w.bin", dtype=np.float32, mode="c")
    cow[0] = -1.0  # this process's own page now, not the file's
    release_mapped_pages(tmp_path)
    assert cow[0] == -1.0 and cow[-1] == (1 << 18) - 1


def test_regression_each_compile_left_its_working_memory_in_the_c_heap():
    """At real size each QNN compile (and simulator session) freed ~2 GB into glibc's arenas,
    which kept it resident for the rest of the build: the build now hands the heap's free pages
    back after each one. Here: 64 MiB freed in small blocks under a live one (free() alone keeps
    them) and given back."""
    import ctypes

    from hexforge.forge.heap import _anon_bytes, release_heap

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    blocks = []
    for _ in range(16384):  # 4 KiB each: under glibc's mmap threshold, from the arena
        p = libc.malloc(4096)
        libc.memset(p, 1, 4096)
        blocks.append(p)
    pin = libc.malloc(64)  # above them: free() cannot shrink the heap past a live block
    for p in blocks:
        libc.free(p)
    held = _anon_bytes()
    given = release_heap()
    libc.free(pin)
    assert given >= 48 << 20, (given, held)
    assert _anon_bytes() <= held - (48 << 20)
