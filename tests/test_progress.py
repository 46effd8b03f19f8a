"""The build's progress display: a bar with its ETA for each stage that takes minutes at real
size, run to its total; none where nobody watches (--json, stderr not a terminal, the library);
``build --json`` prints one summary object."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO

import pytest

from tests.conftest import CONTEXT, HTP_CONTEXT, HTP_N, N


def _stages_of(build_call) -> tuple[dict[str, tuple[float, float]], str]:
    """Run build_call(log) inside a BuildProgress on a recorded terminal console -> ({stage
    description: (completed, total) when it closed}, the console's text)."""
    from rich.console import Console

    from hexforge.forge.progress import BuildProgress

    console = Console(file=StringIO(), force_terminal=True, width=160)
    closed: dict[str, tuple[float, float]] = {}
    with BuildProgress(console) as shown:
        remove = shown.bars.remove_task

        def record(task_id):
            task = next(t for t in shown.bars.tasks if t.id == task_id)
            closed[task.description] = (task.completed, task.total)
            remove(task_id)

        shown.bars.remove_task = record
        build_call(shown.log)
    return closed, console.file.getvalue()


def test_cpu_build_stages_each_run_a_bar_to_its_total(ckpt, tmp_path):
    from hexforge.forge.pipeline import BuildOptions, build

    opts = BuildOptions(context=CONTEXT, prefill_len=N, cpu_weights="int8", verify_tokens=8)
    closed, text = _stages_of(lambda log: build(ckpt("llama"), tmp_path / "b", opts, log=log))
    assert set(closed) == {"export cpu", "quantize cpu weights int8", "oracle: HF references",
                           "oracle cpu"}
    assert all(done == total > 0 for done, total in closed.values()), closed
    assert "wrote " in text  # the log lines print through the display's console
    assert "eta" in text


def test_htp_build_stages_each_run_a_bar_to_its_total(ckpt, tmp_path):
    from hexforge.forge.pipeline import BuildOptions, build

    opts = BuildOptions(targets="v81", quant="w8-u16", context=HTP_CONTEXT, prefill_len=HTP_N,
                        verify=False)
    closed, _ = _stages_of(lambda log: build(ckpt("llama"), tmp_path / "b", opts, log=log))
    assert {"export _work/w8-u16-0", "calibrate", "quantize w8-u16", "compile v81"} <= set(
        closed)
    assert all(done == total > 0 for done, total in closed.values()), closed


@pytest.mark.parametrize("json_flag, terminal, shown", [
    (False, True, True), (True, True, False), (False, False, False)])
def test_the_cli_shows_bars_only_on_a_terminal_without_json(bundle, monkeypatch, capsys,
                                                            json_flag, terminal, shown):
    from hexforge.commands import cli
    from hexforge.forge import pipeline, progress

    made = []
    real = progress.BuildProgress
    monkeypatch.setattr(progress, "BuildProgress", lambda *a: made.append(1) or real(*a))
    built = bundle("llama")  # before build_bundle is swapped: the fixture builds through it
    monkeypatch.setattr(pipeline, "build_bundle",
                        lambda ckpt, out, opts, log: pipeline.BuildResult(built, {}))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert cli.main(["build", "ckpt", "-o", "out", *(["--json"] if json_flag else [])]) == 0
    assert bool(made) == shown
    if json_flag:
        summary = json.loads(capsys.readouterr().out)
        assert summary["bundle"] == str(bundle("llama"))
        assert summary["targets"]["cpu"]["oracle"] == "passed"


def test_build_json_prints_one_summary_and_no_bars(ckpt, tmp_path):
    r = subprocess.run([sys.executable, "-m", "hexforge", "build", ckpt("llama"), "-o",
                        tmp_path / "b", "--context", "64", "--prefill-len", "8", "--no-verify",
                        "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["bundle"] == str(tmp_path / "b")
    assert summary["targets"]["cpu"]["oracle"] == "not run"
    assert summary["targets"]["cpu"]["graphs"] > 0 and summary["timings_s"]["total_s"] > 0
    assert "wrote " in r.stderr and "\x1b[" not in r.stderr  # the log, no terminal control
