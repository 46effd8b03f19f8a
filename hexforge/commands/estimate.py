"""``hexforge estimate BUNDLE``: a bundle's HTP targets under Hextimate, re-estimated from the
graphs a --keep-work build left under ``_work/``, else the estimates the build kept in report.json;
printed as a table per target (the arithmetic and the one-line summary: forge/compile/steptime.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..bundle.errors import BundleError
from ..bundle.manifest import Manifest, TargetSpec, confine, load_manifest
from ..forge.compile.steptime import estimate_line, estimate_target


def stored_estimates(bundle: Path, m: Manifest) -> dict[str, dict]:
    """The estimates the build kept in report.json, per target."""
    if not m.report or not confine(bundle, m.report).is_file():
        return {}
    raw = json.loads(confine(bundle, m.report).read_text())
    return {n: r["estimate"] for n, r in raw.items() if isinstance(r, dict) and "estimate" in r}


def work_sources(bundle: Path, spec: TargetSpec) -> dict[str, Path] | None:
    """Graph name -> the ONNX it was compiled from under ``_work/`` (a --keep-work build), or
    None where the bundle keeps no such graphs for every decoder graph and the head."""
    from ..forge.quantize.recipes import built_recipe

    suffix = built_recipe(spec).compiled_suffix
    names = [g.name for g in spec.graphs if g.role not in ("vision", "audio")]
    for folder in sorted((bundle / "_work").glob(f"{spec.quant}-*")):
        files = {n: folder / f"{n}{suffix}" for n in names}
        if all(f.is_file() for f in files.values()):
            return files
    return None


def bundle_estimates(bundle: Path, log: Callable[[str], None] = lambda m: None
                     ) -> tuple[dict[str, dict], str]:
    """``hexforge estimate``: -> (per HTP target its estimate, where they come from). Re-estimated
    from ``_work/`` where a --keep-work build left the graphs; else the build's (--estimate);
    a bundle with neither is refused in one line. Nothing in the bundle is written."""
    from ..forge.quantize.recipes import built_recipe
    from ..runtime import qnn

    m = load_manifest(bundle)
    htp = {n: t for n, t in m.targets.items() if t.htp_arch is not None}
    if not htp:
        raise BundleError(f"{bundle} has no HTP target to estimate (built with --target cpu)")
    stored = stored_estimates(bundle, m)
    out: dict[str, dict] = {}
    fresh = []
    for name, spec in htp.items():
        sources = work_sources(bundle, spec)
        if sources is not None:
            fp16 = built_recipe(spec).fp16_activations
            out[name] = estimate_target(spec, sources, fp16, m.context, qnn.sdk_version(), log)
            fresh.append(name)
        elif name in stored:
            out[name] = stored[name]
        else:
            raise BundleError(
                f"{bundle}: target {name} has no estimate and no graphs to make one (a bundle "
                "holds context binaries, which Hextimate cannot read: it estimates at compile "
                "time); rebuild with --estimate (or --keep-work)")
    where = ("re-estimated from _work/" if len(fresh) == len(out) else
             "from the build (report.json)" if not fresh else
             f"re-estimated from _work/: {', '.join(fresh)}; the rest from the build")
    return out, where


def print_estimates(estimates: dict[str, dict], where: str) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    for name, est in estimates.items():
        if est.get("estimator") is None:
            c.print(f"target {name}: {estimate_line(est)}")
            continue
        tab = Table(title=f"target {name}: {est['estimator']}, QNN {est['qnn_sdk']} ({where})")
        for col in ("graph", "us", "low-high", "missing ops", "DDR read MB", "GB/s read"):
            tab.add_column(col)
        for g, e in est["graphs"].items():
            gbps = e["fill_bytes"] / (e["us"] * 1e3) if e["us"] else 0.0
            tab.add_row(g, f"{e['us']:,}", f"{e['us_low']:,}-{e['us_high']:,}",
                        str(e["missing_ops"]), f"{e['fill_bytes'] / 1e6:.2f}", f"{gbps:.1f}")
        c.print(tab)
        c.print("  " + estimate_line(est))
