"""Compile ONNX graphs (float or QDQ) into QNN context binaries with onnxruntime-qnn.

    X.onnx ──QNN EP, CPU fallback disabled, ep.context_enable──▶ X.ctx.onnx (EPContext node)
                                                                 + X.ctx_qnn.bin (the binary)

The EP accepts any arch on x86 and finalizes real binaries for it. Each graph gets its own context:
weight-shared contexts (ep.share_ep_contexts) compile, but the x86 simulator cannot load them
(segfault in libQnnHtp; ORT tests them on ARM only), and every binary we ship is one we have run.
"""

from __future__ import annotations

import time
from pathlib import Path

from ...bundle.errors import BuildError
from ...runtime import qnn
from ...runtime.backends import explain_qnn_error
from ..heap import release_heap

# QNN's graph finalization effort per graph role (``htp_graph_finalization_optimization_mode``;
# unset = the compiler's default, which read as mode 2). Under Hextimate mode 3 makes the shards'
# weight-only decode and every prefill faster (fp16 decode is bound by its bytes: unchanged) for
# about twice the prefill graph's compile time; the int8 head is slower at 3 and at 1, so it
# keeps the default (docs/notes/htp-speed.md, "Graph finalization mode 3").
FINALIZE_MODE = {"prefill": "3", "decode": "3", "verify": "3"}


def compile_options(role: str) -> dict[str, str]:
    """The QNN EP options a graph of ``role`` is compiled with beyond the arch's (the build's
    compile and Hextimate's estimate of it alike)."""
    mode = FINALIZE_MODE.get(role)
    return {"htp_graph_finalization_optimization_mode": mode} if mode else {}


def compile_graph(src: Path, ctx: Path, htp_arch: int, soc_model: int, fp16: bool,
                  options: dict[str, str] | None = None) -> dict:
    """-> {"ctx": path, "bin": path, "seconds": float, "bin_bytes": int}; cleans up on failure.

    Builds call it one graph at a time, though a compile keeps one core of two busy: two in
    threads (onnxruntime lets go of the GIL while it builds a session) were slower than one after
    the other, at about twice the memory (docs/notes/realsize.md#where-the-time-goes). It stays
    thread-safe (the EP's registration lock, the stdout guard's nesting count)."""
    import onnxruntime as ort

    bin_path = ctx.with_name(ctx.stem + "_qnn.bin")
    for stale in (ctx, bin_path):
        stale.unlink(missing_ok=True)  # the EP refuses to overwrite an existing context model
    so = qnn.session_options(
        qnn.provider_options(htp_arch, soc_model, fp16) | (options or {}),
        {"ep.context_enable": "1", "ep.context_file_path": str(ctx), "ep.context_embed_mode": "0"},
    )
    t = time.perf_counter()
    try:
        with qnn.native_stdout_to_stderr():
            sess = ort.InferenceSession(str(src), so)
        del sess
    except Exception as e:
        for partial in (ctx, bin_path):  # a failed session may still have written them
            partial.unlink(missing_ok=True)
        raise BuildError(str(explain_qnn_error(e, f"compiling {src.name} for v{htp_arch}",
                                                out_dir=ctx.parent))) from None
    finally:
        release_heap()  # the compiler's working memory (GBs at real size), freed into the C heap
    if not ctx.is_file() or not bin_path.is_file():
        raise BuildError(f"compiling {src.name} wrote no context binary")
    return {"ctx": ctx, "bin": bin_path, "seconds": time.perf_counter() - t,
            "bin_bytes": bin_path.stat().st_size}


def compile_shared(group: list[tuple[Path, Path]], htp_arch: int, soc_model: int,
                   fp16: bool, options: dict[str, str] | None = None) -> dict:
    """Compile graphs that hold the same weights (a shard's prefill + decode) into ONE context
    binary (ep.share_ep_contexts): sessions made in order, the last one stops sharing and writes
    the binary, named after the first graph. -> {"bin": path, "bin_bytes": int}."""
    import onnxruntime as ort

    first_bin = group[0][1].with_name(group[0][1].stem + "_qnn.bin")
    for _, ctx in group:
        ctx.unlink(missing_ok=True)
        ctx.with_name(ctx.stem + "_qnn.bin").unlink(missing_ok=True)
    for i, (src, ctx) in enumerate(group):
        config = {"ep.context_enable": "1", "ep.context_file_path": str(ctx),
                  "ep.context_embed_mode": "0", "ep.share_ep_contexts": "1"}
        if i == len(group) - 1:
            config["ep.stop_share_ep_contexts"] = "1"
        so = qnn.session_options(qnn.provider_options(htp_arch, soc_model, fp16) | (options or {}),
                                 config)
        try:
            with qnn.native_stdout_to_stderr():
                sess = ort.InferenceSession(str(src), so)
            del sess
        except Exception as e:
            raise BuildError(str(explain_qnn_error(e, f"compiling {src.name} (shared)",
                                                    out_dir=ctx.parent))) from None
        finally:
            release_heap()
    if not first_bin.is_file():
        raise BuildError(f"weight-shared compile of {group[0][0].name} wrote no context binary")
    return {"bin": first_bin, "bin_bytes": first_bin.stat().st_size}
