"""bench/alternate.py, the one-model-a-process decode protocol: it runs real workers on tiny
bundles and its ratios point the right way (speed is never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "alternate.py"


def test_alternate_runs_each_contender_in_its_own_process_and_reports_per_round_ratios(
        bundle, tmp_path, bench_script):
    fp32, int8 = bundle("qwen3"), bundle("qwen3", cpu_weights="int8")
    out = tmp_path / "alt.json"
    r = subprocess.run([sys.executable, str(SCRIPT), f"hexforge:{fp32}", f"hexforge:{int8}",
                        f"hexforge:{fp32}", "--rounds", "2", "--reps", "1", "--prompt", "8",
                        "--tokens", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    a, b, a2 = bench_script("alternate").labels([("hexforge", fp32), ("hexforge", int8), ("hexforge", fp32)])
    assert [sorted(row) for row in result["rounds"]] == [sorted([a, b, a2])] * 2
    assert all(ms > 0 for row in result["rounds"] for ms in row.values())
    ratio = result["speed_ratio"][f"{a} vs {b}"]
    per_round = [row[b] / row[a] for row in result["rounds"]]  # > 1: a is faster
    assert ratio["n"] == 2
    assert ratio["min"] == pytest.approx(min(per_round), abs=1e-4)
    assert ratio["max"] == pytest.approx(max(per_round), abs=1e-4)
    assert set(result["speed_ratio"]) == {f"{a} vs {b}", f"{a} vs {a2}", f"{b} vs {a2}"}
    assert json.loads(r.stdout)["speed_ratio"] == result["speed_ratio"]


def test_alternate_pair_ratio_reads_as_the_first_contenders_speed(bench_script):
    alt = bench_script("alternate")
    # A takes 10 ms a token, B 12: A is 1.2x as fast, in both rounds
    r = alt.pair_ratio([10.0, 10.0], [12.0, 12.0])
    assert r["geomean"] == pytest.approx(1.2) and r["median"] == pytest.approx(1.2)
    assert alt.rotation(3, 0) == [0, 1, 2] and alt.rotation(3, 1) == [1, 2, 0]


def test_alternate_labels_tell_apart_folders_of_one_name_and_repeats(tmp_path, bench_script):
    alt = bench_script("alternate")
    x, y = tmp_path / "x" / "b", tmp_path / "y" / "b"
    got = alt.labels([("hexforge", x), ("hexforge", y), ("hexforge", x), ("genai", y)])
    assert got == ["hexforge:x/b", "hexforge:y/b", "hexforge:x/b#2", "genai:b"]


@pytest.mark.parametrize("spec, why", [("onnx:/tmp", "expected KIND:PATH"),
                                       ("hexforge:/no/such/bundle", "is not a folder"),
                                       ("hexforge", "expected KIND:PATH")])
def test_alternate_names_a_bad_contender_before_running_anything(spec, why):
    r = subprocess.run([sys.executable, str(SCRIPT), spec], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and why in r.stderr
