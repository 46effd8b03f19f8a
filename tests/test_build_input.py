"""The build's bad inputs, each refused before any work in one line with exit code 2, leaving
nothing behind: a truncated or damaged GGUF, a --context past the model's positions or past this
machine's memory; and the temp dirs of killed builds, removed by the next one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def hexforge(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hexforge", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def one_line(r: subprocess.CompletedProcess) -> str:
    """The CLI's refusal: exit code 2, exactly one line on stderr, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return r.stderr.strip()


def nothing_left(folder: Path) -> None:
    """No bundle and no hidden temp dir in ``folder`` (the output's and the GGUF cache's)."""
    left = [p.name for p in folder.rglob("*") if ".partial-" in p.name or p.name == "out"]
    assert not left, left


@pytest.fixture()
def gguf_cache() -> Path:
    """The run's GGUF conversion cache (conftest sets HEXFORGE_CACHE for the session)."""
    from hexforge.forge.source.gguf import cache_root

    return cache_root()


def test_truncated_or_damaged_gguf_is_one_line_exit_2(real_gguf, gguf_cache, tmp_path):
    """A GGUF cut short (a partial download: in its header, in its tensor data) or with a
    damaged header used to end in transformers' reader as a 41-line ``struct.error`` traceback
    (or a numpy reshape error): now one line naming the file as truncated or damaged, before any
    conversion is cached."""
    data = real_gguf("smollm2").read_bytes()
    cases = {"header.gguf": (data[:1_000_000], "is truncated: its header runs past the file's end"),
             "data.gguf": (data[:-4096], f"is truncated: {len(data) - 4096:,} bytes, its 272 "
                                         f"tensors end at {len(data):,}"),
             # the tensor count (bytes 8..16) set to 2^40: no file of this size holds that many
             "count.gguf": (data[:8] + (1 << 40).to_bytes(8, "little") + data[16:],
                            "is damaged or cut short: the tensor count 1,099,511,627,776")}
    before = sorted(p.name for p in gguf_cache.iterdir()) if gguf_cache.is_dir() else []
    for name, (blob, says) in cases.items():
        (tmp_path / name).write_bytes(blob)
        line = one_line(hexforge("build", tmp_path / name, "-o", tmp_path / "out"))
        assert says in line and name in line, line
    nothing_left(tmp_path)
    after = sorted(p.name for p in gguf_cache.iterdir()) if gguf_cache.is_dir() else []
    assert after == before  # no conversion of a broken file, whole or partial


def test_context_past_the_models_positions_is_one_line_exit_2(ckpt, tmp_path):
    """--context 1000000 on a model of 2,048 positions was not checked: the build ran until the
    OOM killer ended it. Refused now from the config alone, naming the model's positions."""
    line = one_line(hexforge("build", ckpt("llama"), "-o", tmp_path / "out",
                             "--context", "1000000"))
    assert "--context 1,000,000 is past this model's max_position_embeddings 2,048" in line
    assert "give --context 2048 or less" in line
    nothing_left(tmp_path)


@pytest.mark.parametrize("flags, says", [
    (["--eval-tokens", "1"], "--eval-tokens must be >= 2"),
    (["--eval-text", "no-such-file.txt"], "no-such-file.txt"),
])
def test_a_bad_held_out_text_is_one_line_exit_2_before_any_work(ckpt, tmp_path, flags, says):
    """The oracle's held-out text (``EvalText.of``, shared by build and verify) is read before
    any weight: a bad one is refused in one line and nothing is written."""
    line = one_line(hexforge("build", ckpt("llama"), "-o", tmp_path / "out", *flags,
                             cwd=tmp_path))
    assert says in line, line
    nothing_left(tmp_path)


def test_the_default_context_fits_a_model_trained_on_fewer_positions(tmp_path, monkeypatch,
                                                                      capsys):
    """A model of 512 positions built with no --context was refused: "give --context 512 or
    less", for a flag the user never typed. The default is lowered to the model's positions with
    a note in the log (the build stopped here at its memory check, before any export); a
    --context the user gives past them, 2048 as well, is refused as before."""
    from hexforge.commands import cli
    from hexforge.forge import pipeline
    from hexforge.forge.options import DEFAULT_CONTEXT, BuildOptions
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    short = make_tiny_checkpoint("llama", tmp_path / "ckpt", max_position_embeddings=512)
    assert BuildOptions().context is DEFAULT_CONTEXT == 2048

    class Stop(Exception):
        pass

    seen: list = []

    def stop(fam, hf, args, targets, opts):
        seen.append(opts)
        raise Stop

    monkeypatch.setattr(pipeline, "check_memory", stop)
    with pytest.raises(Stop):
        cli.main(["build", str(short), "-o", str(tmp_path / "out")])
    assert seen[0].context == 512
    notes = [line for line in capsys.readouterr().err.splitlines() if "--context" in line]
    assert notes == ["note: --context 512: this model's max_position_embeddings (the positions "
                     "it was trained on), below the default 2,048"], notes

    line = one_line(hexforge("build", short, "-o", tmp_path / "out", "--context", "2048"))
    assert "--context 2,048 is past this model's max_position_embeddings 512" in line
    assert "give --context 512 or less" in line
    nothing_left(tmp_path)


def test_a_bundle_given_to_build_is_named_as_a_bundle(tmp_path):
    """``hexforge build BUNDLE`` said "has no config.json; is it a HF checkpoint directory?": it
    says the folder is a hexforge bundle (it has manifest.json) and what to do with one."""
    b = tmp_path / "smol.bundle"
    b.mkdir()
    (b / "manifest.json").write_text("{}")
    line = one_line(hexforge("build", b, "-o", tmp_path / "out"))
    assert f"{b} is a hexforge bundle (it has manifest.json), not a checkpoint" in line, line
    assert f"hexforge run {b} PROMPT" in line and f"hexforge inspect {b}" in line
    assert "config.json" not in line
    nothing_left(tmp_path)


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory) -> Path:
    """A tiny llama that claims 2^30 positions: its caches at that context (1.6 TB in fp32) fit
    no machine."""
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("long") / "ckpt",
                                max_position_embeddings=2**30)


def test_context_that_does_not_fit_in_memory_is_one_line_exit_2(long_ckpt, tmp_path):
    """A context within the model's positions whose caches do not fit in this machine's memory:
    refused from the estimate (forge/budget.py) with the largest context that fits, before a
    temp dir or a graph is written (the 1M-token SmolLM2 build was OOM-killed after 66 s at
    22 GB and left a hidden 112 MB temp dir)."""
    import re

    from hexforge.forge.heap import available_bytes

    line = one_line(hexforge("build", long_ckpt, "-o", tmp_path / "out",
                             "--context", str(2**30)))
    m = re.search(r"--context 1,073,741,824 needs about ([\d.]+) GB of memory at the build's "
                  r"peak and this machine has ([\d.]+) GB available: the largest context that "
                  r"fits is about ([\d,]+)", line)
    assert m, line
    need, avail, fits = float(m[1]), float(m[2]), int(m[3].replace(",", ""))
    assert need > 1000 > avail  # TBs of caches, not a near miss
    assert 2 <= fits < 2**30
    # the largest context it names really fits, and twice it would not (the caches grow
    # linearly, the weights of a tiny model are nothing)
    fam, _, args, jobs = _budget_of(long_ckpt)
    from hexforge.forge.budget import memory_need

    assert memory_need(fam, args, jobs, fits) <= available_bytes() * 1.2
    assert memory_need(fam, args, jobs, 2 * fits) > available_bytes() * 0.8
    nothing_left(tmp_path)


def _budget_of(ckpt_dir: Path):
    from hexforge.bundle.targets import parse_targets
    from hexforge.families import load_family
    from hexforge.forge.budget import graph_jobs
    from hexforge.forge.options import BuildOptions
    from hexforge.forge.source.checkpoint import read_checkpoint

    ck = read_checkpoint(ckpt_dir)
    fam = load_family(ck.model_type).FAMILY
    args = fam.Args.from_config(ck.config)
    hf = fam.load_hf(ck.dir)
    return fam, hf, args, graph_jobs(fam, hf, parse_targets("cpu"), BuildOptions())


def test_largest_context_that_fits_is_the_boundary_of_the_estimate(long_ckpt):
    """The context named is the last one whose estimate fits what is available, for a dense
    model and for one whose sliding layers' caches stop growing at their window."""
    from hexforge.forge.budget import largest_context, memory_need

    fam, _, args, jobs = _budget_of(long_ckpt)
    available = 3 * 10**9
    fits = largest_context(fam, args, jobs, available, 2**30)
    assert memory_need(fam, args, jobs, fits) <= available < memory_need(fam, args, jobs, fits + 1)


def test_regression_a_killed_builds_temp_dir_was_kept_when_its_pid_was_reused(ckpt, tmp_path):
    """A build the kernel kills (the OOM killer, kill -9) runs no ``except``: its hidden
    ``.NAME.partial-PID`` stays. The next build beside it removed it only if no process had that
    pid — and pids come back, so a dead build's 112 MB could stay for good. Now a running build
    holds a lock on its temp dir that dies with it: the next build (even one refused for a bad
    flag) removes every unlocked one, and a live build's stays."""
    from hexforge.forge.partial import TempDir

    dead = tmp_path / f".old-build.partial-{os.getppid()}"  # a live pid, not a running build
    (dead / "cpu").mkdir(parents=True)
    (dead / "cpu" / "s0.weights").write_bytes(b"\0" * 1024)
    old_swap = tmp_path / f".b.old-{os.getpid()}"
    old_swap.mkdir()
    live = TempDir(tmp_path / "building")  # a build running now, in this process
    (live.path / "host.safetensors").write_bytes(b"x")
    try:
        one_line(hexforge("build", ckpt("llama"), "-o", tmp_path / "b", "--context", "1"))
        assert not dead.exists() and not old_swap.exists()
        assert live.path.is_dir() and (live.path / "host.safetensors").is_file()
    finally:
        live.discard()
    assert not live.path.exists()


def test_regression_side_by_side_exports_ignored_their_caches(tmp_path, monkeypatch):
    """The export scheduler counted a graph's weights alone: at a long context a shard's
    caches (the example inputs) are most of its export, and three exports side by side took a
    1M-token build past the machine's memory. Their inputs count now (sized on the meta
    device): two exports that fit by their weights but not with their caches run one at a
    time."""
    import time

    import torch

    from hexforge.families.graphio import GraphIO
    from hexforge.forge import heap as memory
    from hexforge.forge.export.onnxexport import export_modules, export_need

    class Cached(torch.nn.Module):
        io = GraphIO(inputs=[("past", "state:x")], outputs=[("y", "hidden")])

        def __init__(self, i):
            super().__init__()
            self.i, self.w = i, torch.nn.Parameter(torch.ones(8))

        def example_inputs(self):
            return (torch.zeros(1 << 20),)  # a 4 MB "cache"

        def forward(self, past):
            (tmp_path / f"{self.i}.start").touch()
            time.sleep(1.0)
            if any((tmp_path / f"{j}.start").exists() and not (tmp_path / f"{j}.end").exists()
                   for j in range(2) if j != self.i):
                (tmp_path / "overlap").touch()
            (tmp_path / f"{self.i}.end").touch()
            return past[:8] * self.w

    mods = [Cached(0), Cached(1)]
    need = export_need(mods[0])
    assert need >= 3 * 4 * (1 << 20)  # the cache counts, not the 8 weights alone
    monkeypatch.setattr(memory, "available_bytes", lambda: int(1.5 * need))
    export_modules([(m, tmp_path / f"m{m.i}.onnx") for m in mods], "torchscript", workers=2)
    assert not (tmp_path / "overlap").exists()
    assert all((tmp_path / f"m{i}.onnx").is_file() for i in range(2))


def test_a_build_says_its_memory_need_beside_what_is_available(ckpt, tmp_path):
    """The build log's memory line, as it says the disk: the estimate and what the machine has."""
    r = hexforge("build", ckpt("llama"), "-o", tmp_path / "b", "--context", "64",
                 "--prefill-len", "8", "--no-verify", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stderr.splitlines() if x.startswith("memory: "))
    assert "at the build's peak" in line and "--context 64" in line and "GB available" in line
    assert json.loads(r.stdout)["timings_s"]["total_s"] > 0


def test_regression_a_gguf_conversion_printed_transformers_per_tensor_bar(real_gguf, tmp_path):
    """Converting a GGUF printed transformers' "Converting and de-quantizing GGUF tensors" bar,
    272 redraws of it, under the build's own line (TQDM_DISABLE was set after tqdm had read it)."""
    code = ("import sys; from hexforge.forge.source.gguf import gguf_checkpoint; "
            "print(gguf_checkpoint(sys.argv[1], log=print))")
    r = subprocess.run([sys.executable, "-c", code, str(real_gguf("smollm2"))],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "HEXFORGE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "converting SmolLM2-135M-Instruct.Q4_1.gguf" in r.stdout
    assert (Path(r.stdout.splitlines()[-1]) / "config.json").is_file()
    assert "Converting and de-quantizing" not in r.stderr and "it/s" not in r.stderr, r.stderr[-500:]
