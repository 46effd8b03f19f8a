"""``hexforge inspect``: what is in a bundle (graphs, shards, state, sizes). Runtime-side: no torch."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ..bundle.describe import encoder_input, layer_span
from ..bundle.manifest import confine, load_manifest
from ..runtime.state import NP_DTYPES


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def decode_bytes_per_token(bundle: Path, t) -> int:
    """Weight bytes one decode step reads: every shard's decode graph (+ the head where the last
    one does not run it). For HTP targets that is the context binaries' size (weights dominate);
    for cpu the external weight ranges those graphs name, each once (a shard's prefill and decode
    share one weight file, but a range only one of them reads is not read per token: Qwen3.5's
    int4 file holds prefill-only in-projections)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    names = {s.decode for s in t.plan.shards}
    if not t.decode_runs_head:  # HTP targets, cpu ones with the head apart
        names.add(t.plan.head)
    graphs = [g for g in t.graphs if g.name in names]
    if t.htp_arch is not None:
        return sum(g.bytes for g in graphs)
    spans = set()
    for g in graphs:
        path = confine(bundle, g.file)
        for init in onnx.load(str(path), load_external_data=False).graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                info = ExternalDataInfo(init)
                file = path.parent / info.location
                length = info.length if info.length is not None else file.stat().st_size
                spans.add((file, info.offset or 0, length))
    return sum(length for _, _, length in spans)


def roofline(target: str, bytes_per_token: int) -> dict:
    """Bandwidth-bound decode tok/s per SoC of the target (an ESTIMATE: DDR peak / bytes)."""
    from ..bundle.targets import TARGETS

    tg = TARGETS.get(target)
    if not tg or not bytes_per_token:
        return {}
    return {s.name: round(s.ddr_gbps * 1e9 / bytes_per_token, 1) for s in tg.socs}


def embedding_format(bundle: Path, m) -> str:
    """How the host embedding is stored: the checkpoint's float type, int8 rows, int4 rows, or
    int4 / int8 rows read from the tied head's weight (``host.embed.shared``)."""
    from ..bundle.hostfile import check_safetensors_header
    from ..bundle.qtables import INT4_SCALES

    e = m.host.embed
    if e.shared is not None:
        return (f"int{e.shared.bits}, blocks of {e.shared.block}: the tied head's rows in "
                f"{e.shared.file}")
    header = check_safetensors_header(confine(bundle, m.host_tensors))
    t = header.get(e.table)
    if t is None:
        return "missing"
    if t["dtype"] == "U8" and e.table + INT4_SCALES in header:
        blocks = header[e.table + INT4_SCALES]["shape"][1]
        return f"int4, blocks of {2 * t['shape'][1] // blocks}"
    return {"I8": "int8", "U8": "int8"}.get(t["dtype"], t["dtype"].lower())


def inspect_bundle(bundle: Path) -> dict:
    m = load_manifest(bundle)
    state_bytes = 0
    for s in m.state:
        if s.kind != "kv_shared":
            n = 1
            for d in s.shape:
                n *= d
            state_bytes += n * NP_DTYPES[s.dtype]().itemsize
    targets = {}
    for name, t in m.targets.items():
        folder = confine(bundle, name)
        per_token = decode_bytes_per_token(bundle, t)
        targets[name] = {
            "decode_weight_bytes_per_token": per_token,
            "roofline_tok_s": roofline(name, per_token),
            "htp_arch": t.htp_arch, "soc_model": t.soc_model, "qnn_sdk": t.qnn_sdk,
            "quant": t.quant, "prefill_len": t.plan.prefill_len, "bytes": _dir_bytes(folder),
            "shards": [{"layers": list(s.layers), "prefill": s.prefill, "decode": s.decode}
                       for s in t.plan.shards],
            "graphs": [{"name": g.name, "role": g.role, "seq_len": g.seq_len,
                        "layers": list(g.layers) if g.layers else None, "file": g.file,
                        "bytes": g.bytes, "inputs": len(g.inputs), "outputs": len(g.outputs),
                        "htp_check": g.htp_check}
                       for g in t.graphs],
        }
    report = None
    if m.report and confine(bundle, m.report).is_file():
        raw = json.loads(confine(bundle, m.report).read_text())
        report = {n: {"passed": r["passed"], "teacher_forced": r["teacher_forced"],
                      "text": r.get("text"),
                      "greedy": {k: r["greedy"][k] for k in ("matching_prefix", "new_tokens")},
                      "encoders": r.get("encoders")}
                  for n, r in raw.items() if "passed" in r}  # not a build --estimate's alone
        for n, r in raw.items():  # Hextimate's, beside the roofline (hexforge/forge/compile/steptime.py)
            if n in targets and "estimate" in r:
                targets[n]["estimate"] = r["estimate"]
    return {
        "bundle": str(bundle), "family": m.family, "model_type": m.model_type,
        "layers": m.num_layers, "hidden_size": m.hidden_size, "vocab_size": m.vocab_size,
        "context": m.context, "state": dict(Counter(s.kind for s in m.state)),
        "state_bytes": state_bytes, "host_tensors_bytes": confine(bundle, m.host_tensors).stat().st_size,
        "embedding": embedding_format(bundle, m),
        "targets": targets, "report": report,
        "encoders": [e.model_dump(include={"name", "modality", "max_soft_tokens", "placeholder_text",
                                           "preprocessor"}) | {"input": encoder_input(e)}
                     for e in m.encoders],
    }


def print_inspection(info: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..forge.oracle.quality import oracle_line

    c = Console()
    c.print(f"[bold]{info['bundle']}[/]  {info['model_type']} (families/{info['family']}.py)  "
            f"{info['layers']} layers, hidden {info['hidden_size']}, vocab {info['vocab_size']}, "
            f"context {info['context']}")
    c.print(f"state: {info['state']}  {info['state_bytes'] / 1e6:.2f} MB   host tensors "
            f"{info['host_tensors_bytes'] / 1e6:.2f} MB (embedding: {info['embedding']})")
    for e in info.get("encoders", []):
        c.print(f"encoder {e['name']}: {e['modality']} -> up to {e['max_soft_tokens']} soft tokens "
                f"at {escape(repr(e['placeholder_text']))} (preprocessor {e['preprocessor']}); "
                f"{e['input']['text']}")
    for name, t in info["targets"].items():
        arch = f"v{t['htp_arch']} soc {t['soc_model']} QNN {t['qnn_sdk']}" if t["htp_arch"] else "CPU EP"
        tab = Table(title=f"target {name}: {arch}, {t['quant']}, AR-{t['prefill_len']} prefill, "
                          f"{len(t['shards'])} shard(s), {t['bytes'] / 1e6:.2f} MB")
        checked = any(g["htp_check"] for g in t["graphs"])
        for col in ("graph", "role", "T", "layers", "bytes", "file") + (
                ("HTP vs float (rel. error)",) if checked else ()):
            tab.add_column(col)
        for g in t["graphs"]:
            row = [g["name"], g["role"], str(g["seq_len"]),
                   layer_span(g["layers"]) if g["layers"] else "-", f"{g['bytes']:,}", g["file"]]
            if checked:
                row.append(f"{g['htp_check']['rel_err']:.2e}" if g["htp_check"] else "-")
            tab.add_row(*row)
        c.print(tab)
        line = f"  decode reads {t['decode_weight_bytes_per_token']:,} weight B/token"
        if t["roofline_tok_s"]:  # HTP targets: per SoC (a cpu's bandwidth: bench/compare.py)
            est = ", ".join(f"{soc} {v:,.0f} tok/s" for soc, v in t["roofline_tok_s"].items())
            line += f"; bandwidth roofline (ESTIMATE, DDR peak / bytes): {est}"
        c.print(line)
        if t.get("estimate"):
            from ..forge.compile.steptime import estimate_line

            c.print(f"  {escape(estimate_line(t['estimate']))}")
    for name, r in (info["report"] or {}).items():
        c.print(f"oracle \\[{name}]: {escape(oracle_line(r))}")
        for enc, e in (r.get("encoders") or {}).items():
            c.print(f"  encoder {enc}: {'PASS' if e['passed'] else 'FAIL'}  soft cos min "
                    f"{e['outputs']['soft']['cos_min']:.6f} (gate {e['gate']})")


def build_summary(bundle: Path, timings: dict[str, float]) -> dict:
    """``hexforge build --json``: the bundle, each target's precision, graphs, bytes and oracle
    verdict ("passed", or "not run" under --no-verify: a failed gate writes no bundle), and the
    build's stage timings in seconds."""
    m = load_manifest(bundle)
    report = {}
    if m.report and confine(bundle, m.report).is_file():
        report = json.loads(confine(bundle, m.report).read_text())
    return {"bundle": str(bundle),
            "targets": {n: {"quant": t.quant, "graphs": len(t.graphs),
                            "bytes": sum(g.bytes for g in t.graphs),
                            "oracle": ("passed" if report[n]["passed"] else "failed")
                            if "passed" in report.get(n, {}) else "not run"}
                        for n, t in m.targets.items()},
            "timings_s": {k: round(v, 2) for k, v in timings.items()}}
