"""The bundle's ``README.md``: a model card, as bundles shared on the Hugging Face Hub carry one.

    manifest.json + report.json + the files on disk ─render()─▶ README.md
      front matter (library_name, base_model, tags) │ what it is │ modalities │ targets and their
      arch pinning (SoC, QNN / QAIRT version) │ the oracle's quality table │ run / deploy commands
      per backend │ the files

Everything on it is read from the bundle itself, so ``write()`` can make it again at any time
(the build writes it before it records the file digests, so the card is one of the files checked).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..bundle.manifest import MANIFEST_NAME, Manifest
from ..bundle.targets import TARGETS

CARD = "README.md"
GENIE_PREFIX = "genie-"


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _soc(arch: int | None, soc_model: int | None = None) -> str:
    """The SoC names targets.py gives ``soc_model`` (every SoC of the arch when None)."""
    names = [s.name for t in TARGETS.values() if t.htp_arch == arch for s in t.socs
             if soc_model is None or s.soc_model == soc_model]
    return ", ".join(names) or "?"


def _front_matter(m: Manifest, base_model: str | None, genie: list[str]) -> list[str]:
    tags = ["hexforge", "onnx", m.model_type]
    if any(t.htp_arch for t in m.targets.values()):
        tags += ["qualcomm", "hexagon", "htp", "qnn"]
    if genie:
        tags.append("genie")
    pipeline = "image-text-to-text" if m.encoder("image") else "text-generation"
    lines = ["---", "library_name: hexforge", f"pipeline_tag: {pipeline}"]
    if base_model:
        lines.append(f"base_model: {base_model}")
    return lines + ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]


def _targets(m: Manifest, genie: list[str]) -> list[str]:
    out = ["## Targets and arch pinning", "",
           "| target | runs on | precision | compiled for | needs QNN / QAIRT |", "|---|---|---|---|---|"]
    for name, t in m.targets.items():
        if t.htp_arch is None:
            out.append(f"| {name} | onnxruntime's CPU EP, any machine | {t.quant} | - | - |")
        else:
            out.append(f"| {name} | Hexagon v{t.htp_arch} (`--backend qnn`; `qnn-sim` on x86) "
                       f"| {t.quant} | v{t.htp_arch}, soc_model {t.soc_model} "
                       f"({_soc(t.htp_arch, t.soc_model)}) | {t.qnn_sdk or '?'} or newer |")
    for g in genie:
        arch = g.removeprefix(GENIE_PREFIX)
        t = m.targets.get(arch)
        sdk = t.qnn_sdk if t is not None else None
        out.append(f"| {g} | Qualcomm's Genie (libGenie, `genie-t2t-run`) on Hexagon {arch} "
                   f"| {t.quant if t else '?'} | {arch} ({_soc(t.htp_arch, t.soc_model) if t else '?'}) "
                   f"| QAIRT {sdk or '?'} or newer |")
    if any(t.htp_arch for t in m.targets.values()):
        out += ["", "Each HTP context binary is finalized for one Hexagon arch and SoC and loads "
                "only there; a QNN runtime older than the one that compiled it refuses it. "
                "`hexforge run` and `hexforge deploy` check both before anything is loaded or "
                "pushed."]
    return [*out, ""]


def _geniex(root: Path, m: Manifest, genie: list[str]) -> list[str]:
    """Per Genie folder, whether GenieX's QAIRT plugin can load it (forge/genie/geniex.py)."""
    from .genie.geniex import card_line

    folders = [root / g for g in genie if (root / g / "genie_config.json").is_file()]
    return [*(f"`{f.name}/`: {card_line(f, m.model_type)}" for f in folders), ""] if folders else []


def _modalities(m: Manifest, report: dict) -> list[str]:
    out = ["## Modalities", "", "| modality | how | status |", "|---|---|---|",
           "| text | tokens in, text out | every target" + (" (judged by the oracle)" if report
                                                           else " (no oracle run: --no-verify)")
           + " |"]
    for e in m.encoders:
        verdicts = [f"{n}: {'PASS' if r['encoders'][e.name]['passed'] else 'FAIL'} (soft-token "
                    f"cos min {r['encoders'][e.name]['outputs']['soft']['cos_min']:.5f})"
                    for n, r in report.items() if (r.get("encoders") or {}).get(e.name)]
        out.append(f"| {e.modality} | encoder graph `{e.name}`, up to {e.max_soft_tokens} soft "
                   f"tokens at `{e.placeholder_text}` | "
                   + ("; ".join(verdicts) or "built, not judged") + " |")
    if any(n.startswith(GENIE_PREFIX) for n in report) and m.encoders:
        out.append("| | | the Genie folders take text only |")
    return [*out, ""]


def _quality(report: dict) -> list[str]:
    if not report:
        return ["## Quality", "", "Built with `--no-verify`: no oracle ran, so no quality is "
                "claimed.", ""]
    out = ["## Quality (the build's oracle: this bundle against the HF model)", "",
           "Held-out English text no build calibrates on; KL(HF ‖ bundle) per token, top-1 "
           "agreement, perplexity; teacher-forced logits on the oracle prompt; greedy tokens "
           "against HF's.", "",
           "| target | verdict | text KL mean / p99 | top-1 | ppl (HF) | teacher-forced KL | "
           "greedy = HF |", "|---|---|---|---|---|---|---|"]
    for name, r in report.items():
        t, tf, g = r.get("text") or {}, r.get("teacher_forced") or {}, r.get("greedy") or {}
        text = (f"{t['kl_mean']:.3g} / {t['kl_p99']:.3g} | {t['top1']:.3f} | {t['ppl']:.3f} "
                f"({t['ppl_hf']:.3f})") if "kl_mean" in t else "- | - | -"
        tfkl = f"{tf['kl_mean']:.3g}" if "kl_mean" in tf else "-"
        out.append(f"| {name} | {'PASS' if r.get('passed') else 'FAIL'} | {text} | {tfkl} | "
                   f"{g.get('matching_prefix', '-')}/{g.get('new_tokens', '-')} |")
    return [*out, "", "The whole report: `report.json` (`hexforge inspect` prints it).", ""]


def _commands(m: Manifest, name: str, genie: list[str]) -> list[str]:
    chat = m.tokenizer.chat_template
    prompt = '"What is the capital of France?"'
    lines = []
    if "cpu" in m.targets:
        lines.append(f"hexforge run {name} {prompt}{' --chat' if chat else ''}   # cpu")
    for t in m.targets.values():
        if t.htp_arch is not None:
            lines += [f"hexforge run {name} {prompt} --backend qnn --arch v{t.htp_arch}   "
                      "# a Snapdragon's HTP (Windows on Snapdragon, Linux)",
                      f"hexforge run {name} {prompt} --backend qnn-sim --arch v{t.htp_arch}   "
                      "# the x86 HTP simulator"]
    for g in genie:
        arch = g.removeprefix(GENIE_PREFIX)
        lines += [f"hexforge run {name} {prompt} --backend genie --arch {arch}   # libGenie "
                  "(on x86: the simulator)",
                  f"hexforge deploy {name} --qairt $QAIRT_HOME --prompt {prompt}   # an Android "
                  f"phone with Hexagon {arch}, over adb"]
    for e in m.encoders:
        flag = "--image photo.jpg" if e.modality == "image" else "--audio clip.wav"
        first = next(iter(m.targets), "cpu")
        backend = "" if first == "cpu" else f" --backend qnn --arch {first}"
        lines.append(f"hexforge run {name} \"{e.placeholder_text} Describe it.\" {flag}{backend}")
    lines += [f"hexforge inspect {name}   # graphs, shards, sizes, the oracle report",
              f"hexforge verify {name} --files   # every file's size and SHA-256"]
    return ["## Run", "", "```", *lines, "```", "",
            "The runtime needs no torch: numpy, onnxruntime, tokenizers (and onnxruntime-qnn "
            "for the HTP backends and Genie on x86).",
            ""]


def _folder_role(top: str, m: Manifest) -> str:
    t = m.targets.get(top)
    if t is not None:
        return ("graphs for onnxruntime's CPU EP" if t.htp_arch is None else
                f"QNN context binaries for Hexagon v{t.htp_arch} (EPContext ONNX + .bin)")
    if top.startswith(GENIE_PREFIX):
        return (f"Genie bundle for Hexagon {top.removeprefix(GENIE_PREFIX)}: context binaries, "
                "genie_config.json, tokenizer.json (what `hexforge deploy` pushes)")
    return {"tokenizer": "the checkpoint's tokenizer and chat template",
            "_work": "the build's float and QDQ graphs (--keep-work)",
            m.host_tensors: "host tensors: embedding table, rope frequencies, ...",
            "report.json": "the oracle's report", CARD: "this card",
            MANIFEST_NAME: "the bundle contract: graphs, state, every file's size and SHA-256"
            }.get(top, "")


def _files(root: Path, m: Manifest) -> list[str]:
    sizes: dict[str, list[int]] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            top = rel.split("/")[0] + ("/" if "/" in rel else "")
            sizes.setdefault(top, []).append(p.stat().st_size)
    sizes.setdefault(CARD, [0])
    out = ["## Files", "", "| path | files | bytes | what |", "|---|---|---|---|"]
    for top, s in sizes.items():
        size = "-" if top in (CARD, MANIFEST_NAME) else _bytes(sum(s))  # both written after
        out.append(f"| `{top}` | {len(s)} | {size} | {_folder_role(top.rstrip('/'), m)} |")
    total = sum(sum(s) for s in sizes.values())
    return [*out, "", f"{_bytes(total)} in all. `manifest.json` records each file's size and "
                  "SHA-256: every load checks the sizes, and the digests the first time a machine loads "
                  "the bundle (or a file changed since).", ""]


def _what_it_holds(m: Manifest, genie: list[str]) -> str:
    htp = sorted(f"v{t.htp_arch}" for t in m.targets.values() if t.htp_arch)
    parts = (["static-shape ONNX graphs for onnxruntime's CPU EP"] if "cpu" in m.targets else [])
    if htp:
        parts.append(f"QNN context binaries for the Qualcomm Hexagon NPU ({', '.join(htp)})")
    if genie:
        parts.append(f"Genie bundles ({', '.join(genie)}) that run on a phone without Python")
    return " and ".join(parts) + "."


def render(root: Path, m: Manifest, name: str, source: str | None = None,
           base_model: str | None = None) -> str:
    """The card of the bundle in ``root`` (``name``: what its commands call it)."""
    report = {}
    if m.report and (root / m.report).is_file():
        report = json.loads((root / m.report).read_text())
    genie = sorted(p.name for p in root.glob(f"{GENIE_PREFIX}*") if p.is_dir())
    what = (f"`{m.model_type}` (hexforge's `families/{m.family}.py`), {m.num_layers} layers, "
            f"hidden {m.hidden_size}, vocab {m.vocab_size:,}, context {m.context:,} tokens")
    lines = [
        *_front_matter(m, base_model, genie), f"# {name}", "",
        f"A hexforge {m.hexforge_version} bundle of {what}"
        + (f", built from `{source}`" if source else "") + ": " + _what_it_holds(m, genie), ""]
    lines += _modalities(m, report) + _targets(m, genie) + _geniex(root, m, genie)
    lines += _quality(report)
    lines += _commands(m, name, genie) + _files(root, m)
    return "\n".join(lines)


def write(root: Path, m: Manifest, name: str, source: str | None = None,
          base_model: str | None = None) -> Path:
    path = root / CARD
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(render(root, m, name, source, base_model))
    tmp.replace(path)
    return path
