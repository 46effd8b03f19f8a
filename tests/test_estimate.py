"""Hextimate, QNN's on-host estimator (hexforge/forge/compile/hextimate.py, steptime.py): real compiles
for SA8797 (v81) through the QNN EP, on tiny graphs. No timing of this machine is asserted: the
estimator's cycles are a model of the HTP, the same on any host."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hexforge.bundle.manifest import load_manifest
from hexforge.bundle.targets import TARGETS
from hexforge.forge.compile.hextimate import estimate_graph, parse_profile
from hexforge.forge.compile.steptime import estimate_target

pytest.importorskip("onnxruntime_qnn")

V81 = TARGETS["v81"]


def matmul_graph(path: Path, k: int, n: int, seed: int = 0) -> Path:
    """x [1, 1, K] @ W [K, N]: a decode step's projection, its weight the bytes read."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.02
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, n])],
                          [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_estimate_of_one_graph_is_identical_twice_and_in_another_process(tmp_path):
    src = matmul_graph(tmp_path / "mm.onnx", 1024, 1024)
    a = estimate_graph(src, 81, V81.estimator, fp16=True)
    b = estimate_graph(src, 81, V81.estimator, fp16=True)
    code = ("import json, sys; from pathlib import Path; from hexforge.forge.compile.hextimate import "
            "estimate_graph; from hexforge.bundle.targets import TARGETS; "
            f"print(json.dumps(estimate_graph(Path({str(src)!r}), 81, TARGETS['v81'].estimator, "
            "True).to_dict()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout.strip().splitlines()[-1])
    assert a == b and a.to_dict() == c
    assert a.cycles > 0 and a.us_low <= a.us <= a.us_high and a.missing_ops == 0


def test_matmul_estimate_scales_with_its_weight_bytes(tmp_path):
    """A decode-shaped fp16 MatMul is bandwidth-bound: 4x the weight bytes, ~4x the cycles
    (measured 3.88x for 1024^2 -> 2048^2, the rest a fixed cost), and the DDR bytes it reads
    are its fp16 weight plus the input row."""
    small = estimate_graph(matmul_graph(tmp_path / "s.onnx", 1024, 1024), 81, V81.estimator, True)
    big = estimate_graph(matmul_graph(tmp_path / "b.onnx", 2048, 2048), 81, V81.estimator, True)
    assert 3.5 < big.cycles / small.cycles < 4.2
    for e, k in ((small, 1024), (big, 2048)):
        assert k * k * 2 <= e.input_fill_bytes <= k * k * 2 * 1.01
    gbps = (big.fill_bytes - small.fill_bytes) / ((big.us - small.us) * 1e3)
    assert 0.8 * V81.estimator.ddr_gbps < gbps < 1.2 * V81.estimator.ddr_gbps  # the table's figure


def test_regression_estimate_read_an_appended_profile_twice(tmp_path):
    """The EP appends to an existing profile file: a second estimate written into the first's
    file would hold both, and the parser sums several QNN graphs' rows. Each estimate gets its
    own file, so the trace kept in one folder twice reads one graph's estimate."""
    src = matmul_graph(tmp_path / "mm.onnx", 512, 512)
    a = estimate_graph(src, 81, V81.estimator, True, trace_dir=tmp_path / "trace")
    b = estimate_graph(src, 81, V81.estimator, True, trace_dir=tmp_path / "trace")
    assert a == b == parse_profile((tmp_path / "trace" / "profile.csv").read_text())


def test_a_phone_soc_gives_no_estimate_in_one_line(tmp_path):
    from hexforge.bundle.errors import BackendError

    src = matmul_graph(tmp_path / "mm.onnx", 256, 256)
    with pytest.raises(BackendError, match="no performance estimate") as e:
        estimate_graph(src, 81, V81.default_soc, True)  # SM8850: "Performance Estimates unsupported"
    assert "\n" not in str(e.value)


def test_regression_an_optrace_estimate_wrote_its_schematic_into_the_working_folder(
        tmp_path, monkeypatch):
    """QNN writes an optrace profile's <graph>_schematic.bin into the working folder, whatever
    profiling_file_path says: a 19.6 MB one, from bench/npu_estimate.py --optrace run in the
    repository's root, was committed (issue 78). It goes to the trace folder now (to the temp dir
    without one); the other levels, a compile and a simulator run leave nothing there either."""
    import onnxruntime as ort

    from hexforge.forge.compile.contexts import compile_graph
    from hexforge.runtime import qnn

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    src = matmul_graph(Path("..") / "mm.onnx", 256, 256)  # relative: read from the cwd named
    trace = tmp_path / "trace"
    estimate_graph(src, 81, V81.estimator, True, level="optrace", trace_dir=trace)
    assert len(list(trace.glob("*_schematic.bin"))) == 1 and (trace / "profile_qnn.log").is_file()
    for level in ("optrace", "detailed", "basic"):
        estimate_graph(src, 81, V81.estimator, True, level=level)
    ctx = compile_graph(src.absolute(), tmp_path / "mm.ctx.onnx", 81, V81.default_soc.soc_model,
                        True)["ctx"]
    so = qnn.session_options(qnn.provider_options(81, V81.default_soc.soc_model, True), {})
    with qnn.native_stdout_to_stderr():
        sess = ort.InferenceSession(str(ctx), so)
        sess.run(None, {"x": np.ones((1, 1, 256), np.float32)})
    del sess
    assert Path.cwd() == cwd and not list(cwd.iterdir()), sorted(p.name for p in cwd.iterdir())


def hexforge(*args):
    return subprocess.run([sys.executable, "-m", "hexforge", *map(str, args)],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def estimated(ckpt, tmp_path_factory):
    """Two builds of one tiny llama for v81 with --estimate (no oracle: the estimate is the
    subject) and AR-4 verify graphs, the first keeping _work/."""
    root = tmp_path_factory.mktemp("estimate")
    out = []
    for i, extra in enumerate((["--keep-work"], [])):
        b = root / f"b{i}"
        r = hexforge("build", ckpt("llama"), "-o", b, "--target", "v81", "--quant", "fp16",
                     "--context", "128", "--prefill-len", "16", "--verify-len", "4", "--htp-verify",
                     "--no-verify", "--estimate", "--json", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)["targets"]["v81"]["oracle"] == "not run"
        out.append(b)
    return out


def test_two_builds_of_one_bundle_give_the_same_estimate(estimated):
    a, b = (json.loads((x / "report.json").read_text())["v81"]["estimate"] for x in estimated)
    assert a == b


def test_cli_estimate_json_names(estimated):
    """The names scripts read (issue 62), from the build's report and re-estimated from the
    --keep-work graphs alike; the decode step is every shard's decode graph and the head."""
    kept, plain = estimated
    stored = json.loads((plain / "report.json").read_text())["v81"]["estimate"]
    for b in (kept, plain):
        r = hexforge("estimate", b, "--json")
        assert r.returncode == 0, r.stderr
        est = json.loads(r.stdout)
        assert list(est) == ["v81"]
        t = est["v81"]
        assert t["estimator"] == "Hextimate, SA8797 (v81)"
        for key in ("decode_step_us", "decode_tok_s", "prefill_tok_s", "ttft_ms"):
            assert t[key] > 0, key
        m = load_manifest(b).targets["v81"]
        decode = [s.decode for s in m.plan.shards] + [m.plan.head]
        assert t["decode_graphs"] == decode
        assert t["decode_step_us"] == sum(t["graphs"][n]["us"] for n in decode)
        assert t["handoffs"]["calls_per_step"] == len(decode)
        verify = [s.verify for s in m.plan.shards] + [m.plan.verify_head]  # --htp-verify's
        assert t["verify_len"] == 4 and t["verify_graphs"] == verify
        assert t["verify_step_us"] == sum(t["graphs"][n]["us"] for n in verify)
        for g in m.graphs:
            e = t["graphs"][g.name]
            assert {"us", "us_low", "us_high", "missing_ops", "fill_bytes"} <= set(e)
            assert e["us_low"] <= e["us"] <= e["us_high"] and e["fill_bytes"] > 0
        assert t == stored  # re-estimated from _work/ (kept) or read back (plain): the same
    info = json.loads(hexforge("inspect", plain, "--json").stdout)
    assert info["targets"]["v81"]["estimate"] == stored and info["report"] == {}
    shown = hexforge("inspect", plain).stdout
    assert "Hextimate, SA8797 (v81)" in shown and "bandwidth roofline" in shown
    assert "verify AR-4" in shown


def test_estimate_of_a_bundle_without_one_is_one_line_exit_2(estimated, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(estimated[1], b)
    (b / "report.json").unlink()  # as a build without --estimate (or with the oracle alone)
    r = hexforge("estimate", b)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "rebuild with --estimate" in r.stderr


def test_an_arch_without_an_estimator_soc_is_said_not_estimated(estimated):
    spec = load_manifest(estimated[1]).targets["v81"]
    v79 = spec.model_copy(update={"name": "v79", "htp_arch": 79})
    est = estimate_target(v79, {}, True, 128, "2.51.0")
    assert est["estimator"] is None and "v79" in est["note"]


def test_estimate_needs_an_htp_target(ckpt, tmp_path):
    r = hexforge("build", ckpt("llama"), "-o", tmp_path / "out", "--estimate")
    assert r.returncode == 2 and "--estimate needs an HTP --target" in r.stderr
    assert r.stderr.count("\n") == 1 and not any(tmp_path.iterdir())


def test_htp_verify_needs_an_htp_target_and_verify_rows(ckpt, tmp_path):
    for args, target in ((["--htp-verify"], "cpu"), (["--htp-verify", "--verify-len", "0"], "v81")):
        r = hexforge("build", ckpt("llama"), "-o", tmp_path / "out", "--target", target, *args)
        assert r.returncode == 2 and "--htp-verify needs an HTP --target and --verify-len > 0" in r.stderr
        assert r.stderr.count("\n") == 1 and not any(tmp_path.iterdir())
