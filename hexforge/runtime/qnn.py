"""The QNN HTP execution provider (onnxruntime-qnn plugin EP): sessions, pre-load checks.

    qnn      a real Snapdragon (Windows-on-ARM / Linux ARM) — the HTP itself
    qnn-sim  x86: the same context binaries run on the HTP simulator inside libQnnHtp.so

What we check before a context binary is handed to QNN (a raw "err 5000" helps nobody):
  * the .bin's own header says which SoC/arch it was finalized for (``soc_type=SM8850;arch=81``);
    it must be the bundle target's, and the device's;
  * the QNN SDK that built it must not be newer than the one installed;
  * CPU fallback is disabled, so a graph that would put any node on the CPU fails to load and the
    error names the split (``--allow-cpu-fallback`` turns that into a warning).
Measured facts behind this (x86, onnxruntime-qnn 2.7.0 / QNN 2.51): the simulator loads older-arch
binaries under newer options without complaint, so these checks are ours, not QNN's.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import sys
import threading
from pathlib import Path

from ..bundle.errors import BackendError, BundleError

EP = "QNNExecutionProvider"
HEADER_BYTES = 1 << 20  # the soc/arch text sits near the start of the binary
_SOC_RE = re.compile(rb"soc_type=(\w+);arch=(\d+)")
_SDK_RE = re.compile(rb"v(\d+\.\d+\.\d+)\.\d{6,}")


def available() -> bool:
    try:
        import onnxruntime_qnn  # noqa: F401
    except ImportError:
        return False
    return True


def is_arm_host() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


def sdk_version() -> str:
    try:
        import onnxruntime_qnn
    except ImportError:
        raise BackendError("onnxruntime-qnn is not installed (pip install onnxruntime-qnn)") from None
    return str(onnxruntime_qnn.build_and_package_info.qnn_version)


_redirect_lock = threading.Lock()
# fd 1's copy and the relay's thread while any thread is redirected (fds are the process's)
_redirect: dict = {"depth": 0, "saved": None, "relay": None}

# What the x86 simulator's HVX/HMX emulation (libnative, inside libQnnHtp.so and libHtpPrepare.so)
# prints once a process, on fd 1, when it loads: it found no optional libnative_tls.conf (nor a
# LIBNATIVE_CONFIG path) and uses the default thread-local storage. Nothing to act on — a config
# file only swaps it for a "config file detected" line — so the relay drops it; it is not printed
# on a device, where the HTP itself runs.
HARMLESS_NATIVE_LINES = (b"# LIBNATIVE: No alternate configuration present in libnative_tls.conf",)


def _relay(read_fd: int) -> None:
    """Copy what QNN's libraries print (fd 1, redirected into a pipe) to fd 2, line by line, but
    the HARMLESS_NATIVE_LINES; until the pipe's last writer closes it."""
    pending = b""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.strip().startswith(HARMLESS_NATIVE_LINES):
                    os.write(2, line + b"\n")
    if pending and not pending.strip().startswith(HARMLESS_NATIVE_LINES):
        os.write(2, pending)


@contextlib.contextmanager
def native_stdout_to_stderr():
    """QNN's native libraries print banners on fd 1; keep stdout clean for --json and pipes: fd 1
    goes into a pipe relayed to fd 2 (less the simulator's one harmless line). Threads may nest
    it (sessions made in threads): the first in redirects, the last out restores."""
    with _redirect_lock:
        if _redirect["depth"] == 0:
            try:
                sys.stdout.flush()
                _redirect["saved"] = os.dup(1)
            except (OSError, ValueError):  # no real fd 1 (e.g. captured): nothing to protect
                _redirect["saved"] = None
            else:
                read_fd, write_fd = os.pipe()
                os.dup2(write_fd, 1)
                os.close(write_fd)
                _redirect["relay"] = threading.Thread(target=_relay, args=(read_fd,), daemon=True,
                                                      name="hexforge-qnn-stdout")
                _redirect["relay"].start()
        _redirect["depth"] += 1
    try:
        yield
    finally:
        with _redirect_lock:
            _redirect["depth"] -= 1
            if _redirect["depth"] == 0 and _redirect["saved"] is not None:
                os.dup2(_redirect["saved"], 1)  # the pipe's last writer closed: the relay ends
                os.close(_redirect["saved"])
                _redirect["saved"] = None
                _redirect["relay"].join(timeout=10)
                _redirect["relay"] = None


_register_lock = threading.Lock()


def _register() -> None:
    """The plugin EP registered once per process; under a lock, since the build's first two
    compiles ask at once from two threads (the second registration fails: "already registered")."""
    import onnxruntime as ort
    import onnxruntime_qnn

    with _register_lock:
        if not any(d.ep_name == EP for d in ort.get_ep_devices()):
            _bind_cffi_closures()
            ort.register_execution_provider_library(EP, onnxruntime_qnn.get_library_path())


def _bind_cffi_closures() -> None:
    """cffi's closure entry bound to its own libffi before the QNN libraries load. libQnnHtp.so
    and libHtpPrepare.so export a libffi of their own (ffi_prep_closure, nm -D), loaded into the
    global scope; a cffi callback made after that (soundfile reads an audio file through them)
    binds the QNN copy and fails: "ffi_prep_closure(): bad user_data" (measured: every
    ``--backend qnn-sim --audio x.wav`` was refused as "not an audio file"). A first callback
    here binds cffi's lazy symbol to the right library for the process."""
    try:
        import cffi
    except ImportError:  # nothing in this process makes cffi callbacks
        return
    cffi.FFI().callback("void(void)", lambda: None)


def provider_options(htp_arch: int, soc_model: int, fp16: bool) -> dict[str, str]:
    import onnxruntime_qnn

    opts = {"backend_path": onnxruntime_qnn.get_qnn_htp_path(), "htp_arch": str(htp_arch),
            "soc_model": str(soc_model)}
    if fp16:
        opts["enable_htp_fp16_precision"] = "1"
    return opts


def session_options(opts: dict[str, str], config: dict[str, str], allow_cpu_fallback: bool = False):
    import onnxruntime as ort

    _register()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not allow_cpu_fallback:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP]
    if not devices:
        raise BackendError("onnxruntime-qnn is installed but registered no QNN device")
    so.add_provider_for_devices(devices, opts)
    return so


def binary_info(bin_path: Path) -> dict:
    """{'soc': 'SM8850', 'arch': 81, 'sdk': '2.51.0'} read from a context binary's header text."""
    with open(bin_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    m = _SOC_RE.search(head)
    if not m:
        raise BundleError(f"{bin_path.name} is not a QNN HTP context binary (no soc/arch header)")
    sdk = _SDK_RE.search(head)
    return {"soc": m.group(1).decode(), "arch": int(m.group(2)),
            "sdk": sdk.group(1).decode() if sdk else None}


def context_binary_of(ctx_onnx: Path) -> Path:
    import onnx

    model = onnx.load(str(ctx_onnx), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "EPContext":
            for a in node.attribute:
                if a.name == "ep_cache_context":
                    return ctx_onnx.parent / a.s.decode()
    raise BundleError(f"{ctx_onnx.name} has no EPContext node; not a compiled HTP graph")


def version_tuple(v: str) -> tuple[int, ...]:
    """'2.51.0' / 'v2.51.0.260929' -> (2, 51, 0)."""
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


_ver = version_tuple


def check_binary(bin_path: Path, want_arch: int, want_soc_name: str | None,
                 device_arch: int | None) -> dict:
    """Name any arch / SoC / SDK mismatch in plain words before QNN sees the binary."""
    info = binary_info(bin_path)
    if info["arch"] != want_arch or (want_soc_name and info["soc"] != want_soc_name):
        raise BundleError(f"{bin_path.name} was compiled for v{info['arch']} ({info['soc']}) but the "
                          f"bundle says v{want_arch} ({want_soc_name}); the bundle is inconsistent")
    if device_arch is not None and device_arch != info["arch"]:
        raise BackendError(f"{bin_path.name} is built for Hexagon v{info['arch']} ({info['soc']}) but "
                           f"this device is v{device_arch}; rebuild with --target v{device_arch}")
    installed = sdk_version()
    if info["sdk"] and _ver(info["sdk"]) > _ver(installed):
        raise BackendError(f"{bin_path.name} was built with QNN SDK {info['sdk']}, newer than the "
                           f"installed {installed}; upgrade onnxruntime-qnn or rebuild")
    return info
