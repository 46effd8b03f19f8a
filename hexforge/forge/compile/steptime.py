"""A bundle's HTP targets under Hextimate (hextimate.py): the step arithmetic, the report
section and its one-line summary (``hexforge estimate``, the command: commands/estimate.py).

    decode step  = every shard's AR-1 decode graph + the head        (one token)
    prefill step = every shard's AR-N prefill graph                  (N tokens; the head once,
                                                                      on the last chunk's row)
    TTFT         = ceil(P / N) prefill steps + the head               (a P = 512-token prompt)
    verify step  = every shard's AR-k verify graph + the head on k rows  (--htp-verify: one
                                                                      --prompt-lookup call)

Graph times only: between graphs the host hands the hidden state on and feeds every input (the
KV cache included) — those hand-offs are counted apart (calls and bytes a step), not timed: the
estimator models the HTP, not the host or the shared memory between them.

Estimates are made while the build still has each graph's compile source (``build --estimate``,
kept in report.json as a section per HTP target); a bundle keeps context binaries only, which
the estimator cannot read, so ``hexforge estimate`` re-estimates from ``_work/`` (a
``--keep-work`` build) or shows the build's estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from ...bundle.errors import BundleError
from ...bundle.manifest import GraphSpec, RunPlan, TargetSpec
from ...bundle.targets import TARGETS, Soc
from .hextimate import GraphEstimate, estimate_graph

TTFT_PROMPT = 512  # the prompt length time-to-first-token is stated for (the issue's)
_ITEMSIZE = {"float32": 4, "float16": 2, "int64": 8, "int32": 4, "uint16": 2, "uint8": 1,
             "int8": 1, "bool": 1}


def estimator_of(target: str) -> Soc | None:
    t = TARGETS.get(target)
    return t.estimator if t else None


def label(soc: Soc, arch: int) -> str:
    """How every estimate is labelled: the estimator and its SoC, never a phone."""
    return f"Hextimate, {soc.name} (v{arch})"


def io_bytes(g: GraphSpec) -> int:
    """Bytes of a graph's inputs and outputs: what the host feeds and reads back per call."""
    return sum(math.prod(t.shape) * _ITEMSIZE[t.dtype] for t in (*g.inputs, *g.outputs))


def no_estimator(target: str, arch: int | None) -> dict:
    return {"estimator": None, "note": f"no Hextimate SoC for v{arch} (QNN estimates v73 on "
                                       f"QCS9100 and v81 on SA8797 only): {target} not estimated"}


def target_estimate(plan: RunPlan, graphs: list[GraphSpec], per_graph: dict[str, GraphEstimate],
                    soc: Soc, arch: int, sdk: str, context: int) -> dict:
    """The report section of one HTP target from its graphs' estimates (names fixed by issue 62:
    scripts read ``decode_step_us``, ``decode_tok_s``, ``prefill_tok_s``, ``ttft_ms`` and, per
    graph, ``us``, ``us_low``, ``us_high``, ``missing_ops``, ``fill_bytes``)."""
    by_name = {g.name: g for g in graphs}
    decode = [s.decode for s in plan.shards] + [plan.head]
    prefill = [s.prefill for s in plan.shards]
    verify = ([s.verify for s in plan.shards] + [plan.verify_head]  # type: ignore[misc]
              if plan.verify_head else [])
    missing = [n for n in decode + prefill + verify if n not in per_graph]
    if missing:
        raise BundleError(f"no estimate for {', '.join(missing)}")
    step = sum(per_graph[n].us for n in decode)
    prefill_us = sum(per_graph[n].us for n in prefill)
    prompt = min(TTFT_PROMPT, context - 1)
    ttft_us = -(-prompt // plan.prefill_len) * prefill_us + per_graph[plan.head].us
    ddr = sum(per_graph[n].fill_bytes + per_graph[n].spill_bytes for n in decode)
    bound_us = ddr / (soc.ddr_gbps * 1e3)  # bytes / (GB/s) -> us
    return {
        "estimator": label(soc, arch), "soc": soc.name, "soc_model": soc.soc_model, "qnn_sdk": sdk,
        "decode_step_us": step, "decode_tok_s": round(1e6 / step, 1) if step else None,
        "decode_graphs": decode,
        "decode_missing_ops": sum(per_graph[n].missing_ops for n in decode),
        "prefill_len": plan.prefill_len, "prefill_step_us": prefill_us,
        "prefill_tok_s": round(plan.prefill_len * 1e6 / prefill_us, 1) if prefill_us else None,
        "ttft_prompt_tokens": prompt, "ttft_ms": round(ttft_us / 1e3, 2),
        # a --prompt-lookup call: k rows for about a decode step (speculation pays when more
        # than verify_step_us / decode_step_us tokens a call are accepted)
        **({"verify_len": plan.verify_len, "verify_graphs": verify,
            "verify_step_us": sum(per_graph[n].us for n in verify)} if verify else {}),
        # the estimator's own bound: a step's DDR bytes at the bandwidth it implies
        "bound": {"ddr_bytes_per_step": ddr, "gbps": soc.ddr_gbps,
                  "decode_step_us": round(bound_us, 1),
                  "fraction": round(bound_us / step, 3) if step else None},
        "handoffs": {"calls_per_step": len(decode),
                     "io_bytes_per_step": sum(io_bytes(by_name[n]) for n in decode if n in by_name)},
        "graphs": {n: e.to_dict() for n, e in per_graph.items()},
    }


def estimate_target(spec: TargetSpec, sources: dict[str, Path], fp16: bool, context: int,
                    sdk: str, log: Callable[[str], None] = lambda m: None,
                    advance: Callable[[], None] = lambda: None) -> dict:
    """Estimate every graph of ``spec`` that has a source (graph name -> the ONNX the HTP
    compiled) on the estimator SoC of its arch; -> its report section. ``advance`` is called
    after each graph (a progress bar)."""
    from .contexts import compile_options

    soc = estimator_of(spec.name)
    if soc is None or spec.htp_arch is None:
        return no_estimator(spec.name, spec.htp_arch)
    per_graph = {}
    for g in spec.graphs:
        src = sources.get(g.name)
        if src is None:
            continue
        per_graph[g.name] = e = estimate_graph(src, spec.htp_arch, soc, fp16,
                                               options=compile_options(g.role))
        log(f"[{spec.name}] {label(soc, spec.htp_arch)} {g.name}: {e.us:,} us "
            f"({e.us_low:,}-{e.us_high:,}), {e.fill_bytes / 1e6:.2f} MB from DDR, "
            f"{e.missing_ops} op(s) without a cost")
        advance()
    return target_estimate(spec.plan, spec.graphs, per_graph, soc, spec.htp_arch, sdk, context)


def add_to_report(report: dict, estimates: dict[str, dict]) -> dict:
    """report.json with each HTP target's estimate as its section's ``estimate`` (a build
    without the oracle: sections holding the estimate alone)."""
    for name, est in estimates.items():
        report.setdefault(name, {})["estimate"] = est
    return report


def estimate_line(est: dict) -> str:
    """One line: the step, tok/s, prefill, TTFT and the estimator's bound, labelled."""
    if est.get("estimator") is None:
        return est.get("note", "not estimated")
    b = est["bound"]
    return (f"{est['estimator']} (an estimate, not a phone's measurement): decode step "
            f"{est['decode_step_us']:,} us = {est['decode_tok_s']:,} tok/s "
            f"({len(est['decode_graphs'])} graphs; {est['handoffs']['calls_per_step']} host "
            f"hand-offs a step not counted), {est['decode_missing_ops']} op(s) without a cost; "
            f"prefill AR-{est['prefill_len']} {est['prefill_tok_s']:,} tok/s; TTFT "
            f"{est['ttft_ms']:,} ms for {est['ttft_prompt_tokens']} prompt tokens; its own "
            f"bound {b['decode_step_us']:,.0f} us ({b['ddr_bytes_per_step'] / 1e6:.1f} MB at "
            f"{b['gbps']:g} GB/s: {b['fraction']:.0%} of it)"
            + (f"; verify AR-{est['verify_len']} {est['verify_step_us']:,} us "
               f"({est['verify_step_us'] / est['decode_step_us']:.2f}x a decode step)"
               if est.get("verify_step_us") else ""))


