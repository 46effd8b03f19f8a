"""Runtime pieces: torch-free import, sampling, streaming UTF-8, request checks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hexforge
from hexforge.bundle.errors import ContextOverflowError, RequestError
from hexforge.runtime import sampling
from tests.conftest import prompt_ids


def test_runtime_runs_with_torch_and_transformers_absent(bundle):
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'transformers'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        import hexforge
        r = hexforge.load({str(bundle('llama'))!r}).generate('Hello', max_new_tokens=4)
        assert 'torch' not in sys.modules and 'transformers' not in sys.modules
        print('ok', len(r.token_ids))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_streamed_chunks_are_valid_utf8_and_join_to_the_full_text(bundle):
    model = hexforge.load(bundle("llama"))
    tok = model.tokenizer
    text = "東京は日本の首都です。🚀🔥 Ünïcödé 서울"
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer()
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    for p in pieces:
        p.encode("utf-8")  # every chunk is valid UTF-8
        assert "\ufffd" not in p
    # and through the model: stream == generate
    kw = dict(max_new_tokens=48, ignore_eos=True, temperature=0.9, seed=3)
    assert "".join(model.stream("東京", **kw)) == model.generate("東京", **kw).text


def test_same_seed_same_output_and_top_k_1_is_greedy(bundle):
    model = hexforge.load(bundle("qwen3"))
    ids = prompt_ids(5)
    a = model.generate(ids, max_new_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    b = model.generate(ids, max_new_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    c = model.generate(ids, max_new_tokens=24, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True)
    assert a.token_ids == b.token_ids != c.token_ids
    g = model.generate(ids, max_new_tokens=24, ignore_eos=True)
    k1 = model.generate(ids, max_new_tokens=24, temperature=0.7, top_k=1, seed=1, ignore_eos=True)
    assert g.token_ids == k1.token_ids


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    out = sampling.top_p(0.8)(logits)
    assert np.isfinite(out[:2]).all() and np.isinf(out[2:]).all()
    out = sampling.top_k(3)(logits)
    assert np.isinf(out[3]) and np.isfinite(out[:3]).all()


def test_eos_stops_with_finish_reason_stop(bundle):
    model = hexforge.load(bundle("llama"))
    ids = prompt_ids(4)
    free = model.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids
    model.generation.eos_token_ids = [free[5]]
    r = model.generate(ids, max_new_tokens=16)
    assert r.finish_reason == "stop" and r.token_ids == free[:free.index(free[5])]


def test_bad_requests_are_typed_errors(bundle):
    model = hexforge.load(bundle("llama"))
    with pytest.raises(ContextOverflowError, match=r"250 tokens.*256"):
        model.generate(prompt_ids(250), max_new_tokens=16)
    for bad in ([], [-1, 5], [10**6]):
        with pytest.raises(RequestError):
            model.generate(bad, max_new_tokens=4)
    with pytest.raises(RequestError):
        model.generate("hi", max_new_tokens=0)
    with pytest.raises(RequestError):
        model.generate("", max_new_tokens=4)
    with pytest.raises(RequestError):
        model.generate("hi", temperature=-1.0)
    assert model.generate("hi", max_new_tokens=2).token_ids  # still works afterwards


def test_qnns_native_stdout_goes_to_stderr_less_the_simulators_harmless_line(capfd):
    """QNN's libraries print on fd 1: relayed to fd 2 so --json and pipes stay clean, all but
    the x86 simulator's libnative line saying it found no optional thread-local-storage config
    (printed on every qnn-sim run, nothing to act on)."""
    import os

    from hexforge.runtime import qnn

    with qnn.native_stdout_to_stderr():
        os.write(1, b" # LIBNATIVE: No alternate configuration present in libnative_tls.conf or "
                    b"from LIBNATIVE_CONFIG environment variable - using default thread-local "
                    b"behavior.\nQnnDsp <W> a warning that matters\n")
        with qnn.native_stdout_to_stderr():  # nested (sessions made in threads)
            os.write(1, b"no newline at the end")
    os.write(1, b"after\n")
    out, err = capfd.readouterr()
    assert out == "after\n"
    assert err == "QnnDsp <W> a warning that matters\nno newline at the end"


def test_a_qnn_sim_run_prints_no_libnative_line(htp_bundle):
    r = subprocess.run([sys.executable, "-m", "hexforge", "run", str(htp_bundle("llama", "fp16")),
                        "Hello", "-n", "2", "--backend", "qnn-sim", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) <= 2
    assert "LIBNATIVE" not in r.stderr + r.stdout
