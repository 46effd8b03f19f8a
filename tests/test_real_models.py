"""Real trained models, built from their GGUF files, judged on real text against the HF oracle.

SmolLM2-135M-Instruct (llama) and Gemma-3-270M (gemma3_text), each converted once per run. The
held-out text is forge/oracle/quality.py's (no build calibrates on it). Numbers: docs/quality.md. The
HTP targets: tests/test_real_models_htp.py.
"""

from __future__ import annotations

import json

import pytest

MODELS = ["smollm2", "gemma3"]
# a held-out text longer than Gemma-3's 512-row sliding window: its fp32 bundle is judged past
# the point where the ring wraps
LONG_CONTEXT, LONG_EVAL = 768, 600


def _long_eval_file(tmp_path_factory):
    from hexforge.forge.oracle.quality import EVAL_TEXT

    p = tmp_path_factory.mktemp("eval") / "long.txt"
    p.write_text(EVAL_TEXT + "\n\n" + EVAL_TEXT.replace("lighthouse", "harbour"))
    return p


@pytest.fixture(scope="session")
def fp32_bundle(real_bundle, tmp_path_factory):
    """fp32 cpu bundles; Gemma-3's at a context past its 512-row window, scored over 600 tokens."""
    def get(name):
        if name == "gemma3":
            return real_bundle(name, context=LONG_CONTEXT, eval_tokens=LONG_EVAL,
                               eval_text=str(_long_eval_file(tmp_path_factory)))
        return real_bundle(name)
    return get


# the tests that share SmolLM2's fp32 bundle first and together (conftest keeps one real bundle)
def test_smollm2_chat_answers_from_its_gguf_chat_template(fp32_bundle):
    import hexforge

    bundle, _ = fp32_bundle("smollm2")
    model = hexforge.load(bundle)
    out = model.chat([{"role": "user", "content": "What is the capital of France?"}],
                     max_new_tokens=16)
    assert "Paris" in out.text


def test_gguf_converts_once_and_verify_reports_kl_perplexity_and_top1(fp32_bundle, real_gguf,
                                                                      capsys):
    """`hexforge verify B --reference MODEL.gguf --json`: the cached conversion, the oracle's
    real-text numbers; `hexforge inspect --json` carries them from report.json."""
    from hexforge.commands.cli import main
    from hexforge.forge.source.gguf import cache_root

    bundle, _ = fp32_bundle("smollm2")
    converted = list(cache_root().iterdir())
    assert main(["verify", str(bundle), "--reference", str(real_gguf("smollm2")), "--json",
                 "-n", "8", "--eval-tokens", "64"]) == 0
    assert list(cache_root().iterdir()) == converted  # no second conversion
    r = json.loads(capsys.readouterr().out)["cpu"]
    assert r["passed"] and r["text"]["tokens"] == 63
    for k in ("kl_mean", "kl_p99", "top1", "ppl", "ppl_hf"):
        assert k in r["text"]
    assert r["text"]["kl_mean"] < 1e-6
    assert main(["inspect", str(bundle), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["report"]["cpu"]["text"]["tokens"] == 255


@pytest.mark.parametrize("name", MODELS)
def test_fp32_cpu_is_greedy_exact_with_kl_below_1e_6(fp32_bundle, name):
    _, report = fp32_bundle(name)
    r = report["cpu"]
    assert r["passed"], r["failures"]
    assert r["greedy"]["exact"] and r["greedy"]["new_tokens"] == 64
    assert r["text"]["kl_mean"] < 1e-6 and r["text"]["top1"] == 1.0
    assert r["text"]["ppl"] == pytest.approx(r["text"]["ppl_hf"], rel=1e-5)
    if name == "gemma3":  # positions past the 512-row window: the sliding ring wrapped
        assert r["text"]["tokens"] == LONG_EVAL - 1 > 512


# Gemma-3's int8 / int4 rows (and the rest of the table) are bench/quality_table.py's, in
# docs/quality.md: the suite builds each real model's fp32 bundle and SmolLM2's quantized ones.
@pytest.mark.parametrize("name", ["smollm2"])
def test_int8_cpu_kl_at_most_0_01(real_bundle, name):
    _, report = real_bundle(name, cpu_weights="int8")
    r = report["cpu"]
    assert r["passed"], r["failures"]
    assert r["text"]["kl_mean"] <= 0.01 and r["text"]["top1"] >= 0.9, r["text"]


@pytest.mark.parametrize("name,weights", [("smollm2", "int4")])
def test_int4_cpu_at_or_below_hfs_round_to_nearest_floor(real_bundle, real_hf, name, weights):
    """KL <= 1.2x the KL HF itself reaches with its decoder's Linear weights rounded to nearest
    at the same block (the embedding and head left in fp32)."""
    from hexforge.forge.oracle.quality import EVAL_TEXT, eval_ids, fake_quant_floor, hf_logits
    from hexforge.forge.quantize.nbits import CPU_WEIGHTS
    from hexforge.runtime.text import TextTokenizer

    _, report = real_bundle(name, cpu_weights=weights)
    r = report["cpu"]
    assert r["passed"], r["failures"]
    fam, hf, ck = real_hf(name)
    ids = eval_ids(TextTokenizer(ck), EVAL_TEXT, 256)
    assert len(ids) - 1 == r["text"]["tokens"]  # the same tokens the build was judged on
    floor = fake_quant_floor(hf, 4, CPU_WEIGHTS[weights][1], ids, hf_logits(hf, ids),
                             fam.reference_layers(hf))
    assert r["text"]["kl_mean"] <= 1.2 * floor["kl_mean"], (r["text"], floor)


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path, capsys):
    from hexforge.commands.cli import main

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert main(["build", str(bad), "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a GGUF file" in err
    assert not (tmp_path / "b").exists()
