"""Qualcomm's Genie runtime (``libGenie.so``) through ctypes: a dialog made from a
``genie_config.json``, queried with token ids or text, its tokens streamed through a callback.

    libQnnSystem.so + libQnnHtp.so (preloaded) ─▶ libGenie.so ─▶ GenieDialog ─▶ tokens

Where the libraries come from: ``HEXFORGE_GENIE_LIB_DIR`` (a QAIRT ``lib/<abi>`` folder, or the
folder ``adb push`` put them in on a phone), else the onnxruntime-qnn wheel, which ships
``libGenie.so`` beside its HTP libraries on x86 Linux: there Genie drives the same HTP simulator
that ``--backend qnn-sim`` does, so a Genie bundle runs on this machine before it runs on a phone.

Genie's log lines (its own reasons for refusing a model) are collected through its log callback and
attached to every error, so a failure names the requirement Genie checked, not just a status code.
The C API follows QAIRT's ``GenieDialog.h`` / ``GenieLog.h`` / ``GenieCommon.h``.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from ...bundle.errors import BackendError

# GenieCommon.h: 0 success, positive values are warnings, negative ones errors
STATUS_NAMES = {0: "SUCCESS", 1: "WARNING_ABORTED", 2: "WARNING_BOUND_HANDLE",
                3: "WARNING_PAUSED", 4: "WARNING_CONTEXT_EXCEEDED"}
CONTEXT_EXCEEDED = 4
# GenieDialog_SentenceCode_t
SENTENCE_COMPLETE, SENTENCE_BEGIN, SENTENCE_CONTINUE, SENTENCE_END, SENTENCE_ABORT = range(5)
ACTION_ABORT = 1  # GenieDialog_Action_t
# GenieLog_Level_t
LOG_ERROR, LOG_WARN, LOG_INFO, LOG_VERBOSE = 1, 2, 3, 4
LOG_LEVELS = {"error": LOG_ERROR, "warn": LOG_WARN, "info": LOG_INFO, "verbose": LOG_VERBOSE}

# libGenie on x86 (QNN 2.51) places every context of a dialog in one HTP process domain, whose
# room was measured with Gemma-4-E2B's fp16 and w8-fp16 binaries: contexts of 3.26 GB in all
# loaded, 3.47 GB did not ("Failed to find available PD for contextId N ... with context size
# estimate B", QNN error 1002). A device has its own budget (and a weight-shared split is one
# context, not two).
X86_PD_LOADED_BYTES = 3_262_312_448
X86_PD_REFUSED_BYTES = 3_471_118_336
NO_PD = "Failed to find available PD"


def x86_room_note(total_bytes: int) -> str | None:
    """What a Genie folder of ``total_bytes`` of unshared context binaries meets in the x86
    simulator's libGenie, when it is over the measured room; None when under it."""
    if total_bytes <= X86_PD_LOADED_BYTES:
        return None
    return (f"its context binaries are {total_bytes / 1e9:.2f} GB in all: libGenie on x86 places "
            f"a dialog's contexts in one HTP process domain ({X86_PD_LOADED_BYTES / 1e9:.2f} GB "
            f"of them loaded, {X86_PD_REFUSED_BYTES / 1e9:.2f} GB did not), so --backend genie "
            "may not load it here; a device has its own room")


_handle = ctypes.c_void_p
# void (*)(const GenieLog_Handle_t, const char* fmt, GenieLog_Level_t, uint64_t, va_list).
# A va_list argument reaches a callee as a pointer on x86-64 SysV, AArch64 (a struct over 16 bytes
# goes by reference) and Windows (char*), so it is passed on to vsnprintf as an opaque pointer.
_LOG_CB = ctypes.CFUNCTYPE(None, _handle, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64,
                           ctypes.c_void_p)
# void (*)(const uint32_t* tokens, uint32_t n, GenieDialog_SentenceCode_t, const void* userData)
_TOKEN_CB = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_int,
                             ctypes.c_void_p)
# void (*)(const char* response, GenieDialog_SentenceCode_t, const void* userData)
_TEXT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_preloaded: list[ctypes.CDLL] = []  # kept loaded: Genie dlopens libQnnHtp.so by name


def library_dir() -> Path:
    """The folder holding libGenie.so, libQnnHtp.so and libQnnSystem.so."""
    env = os.environ.get("HEXFORGE_GENIE_LIB_DIR")
    if env:
        return Path(env)
    try:
        import onnxruntime_qnn
    except ImportError:
        raise BackendError("Genie needs libGenie.so: install onnxruntime-qnn (it ships one for x86 "
                           "Linux) or set HEXFORGE_GENIE_LIB_DIR to a QAIRT lib folder") from None
    return Path(onnxruntime_qnn.__file__).parent


def _so(name: str) -> str:
    return {"nt": f"{name}.dll"}.get(os.name, f"lib{name}.so")


def load() -> ctypes.CDLL:
    """libGenie, after the QNN libraries it opens by name are in the process (a later dlopen of
    the same soname finds them, wherever LD_LIBRARY_PATH points). RTLD_LOCAL, not GLOBAL:
    measured (x86, QNN 2.51), with libQnnHtp / libGenie global a QNN EP session made later in the
    process segfaults; local, Genie and the EP run one after the other either way round."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        folder = library_dir()
        genie = folder / _so("Genie")
        if not genie.is_file():
            raise BackendError(f"no {genie.name} in {folder}; set HEXFORGE_GENIE_LIB_DIR")
        mode = getattr(ctypes, "RTLD_LOCAL", 0)
        for dep in ("QnnSystem", "QnnHtp"):
            p = folder / _so(dep)
            if p.is_file():
                _preloaded.append(ctypes.CDLL(str(p), mode=mode))
        lib = ctypes.CDLL(str(genie), mode=mode)
        _declare(lib)
        _lib = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    p = ctypes.POINTER
    sigs = {
        "Genie_getApiMajorVersion": ([], ctypes.c_uint32),
        "Genie_getApiMinorVersion": ([], ctypes.c_uint32),
        "Genie_getApiPatchVersion": ([], ctypes.c_uint32),
        "GenieLog_create": ([_handle, _LOG_CB, ctypes.c_int, p(_handle)], ctypes.c_int32),
        "GenieLog_free": ([_handle], ctypes.c_int32),
        "GenieDialogConfig_createFromJson": ([ctypes.c_char_p, p(_handle)], ctypes.c_int32),
        "GenieDialogConfig_bindLogger": ([_handle, _handle], ctypes.c_int32),
        "GenieDialogConfig_free": ([_handle], ctypes.c_int32),
        "GenieDialog_create": ([_handle, p(_handle)], ctypes.c_int32),
        "GenieDialog_tokenQuery": ([_handle, p(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_int,
                                    _TOKEN_CB, ctypes.c_void_p], ctypes.c_int32),
        "GenieDialog_query": ([_handle, ctypes.c_char_p, ctypes.c_int, _TEXT_CB, ctypes.c_void_p],
                              ctypes.c_int32),
        "GenieDialog_setMaxNumTokens": ([_handle, ctypes.c_uint32], ctypes.c_int32),
        "GenieDialog_reset": ([_handle], ctypes.c_int32),
        "GenieDialog_signal": ([_handle, ctypes.c_int], ctypes.c_int32),
        "GenieDialog_free": ([_handle], ctypes.c_int32),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


def api_version() -> str:
    lib = load()
    return (f"{lib.Genie_getApiMajorVersion()}.{lib.Genie_getApiMinorVersion()}."
            f"{lib.Genie_getApiPatchVersion()}")


class GenieLog:
    """Genie's log lines, formatted with the C library's vsnprintf, kept in order (and passed to
    ``echo`` as they come, if given)."""

    def __init__(self, level: str = "warn", echo: Callable[[str], None] | None = None):
        lib = load()
        self.lines: list[str] = []
        self.echo = echo
        self._libc = ctypes.CDLL(None) if os.name != "nt" else ctypes.cdll.msvcrt
        self._vsnprintf = self._libc.vsnprintf
        self._vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                    ctypes.c_void_p]
        self._cb = _LOG_CB(self._on_log)  # referenced for as long as Genie may call it
        self.handle = _handle()
        _check(lib.GenieLog_create(None, self._cb, LOG_LEVELS[level], ctypes.byref(self.handle)),
               "GenieLog_create")

    def _on_log(self, _h, fmt, level, _ts, args) -> None:
        buf = ctypes.create_string_buffer(4096)
        self._vsnprintf(buf, len(buf), fmt, args)
        tag = {LOG_ERROR: "ERROR", LOG_WARN: "WARN", LOG_INFO: "INFO"}.get(level, "VERBOSE")
        line = f"[{tag}] {buf.value.decode('utf-8', 'replace').rstrip()}"
        self.lines.append(line)
        if self.echo:
            self.echo(line)

    def tail(self, n: int = 12, min_level: str = "warn") -> list[str]:
        keep = {"error": ("[ERROR]",), "warn": ("[ERROR]", "[WARN]")}.get(min_level)
        lines = [ln for ln in self.lines if keep is None or ln.startswith(keep)]
        return lines[-n:]

    def close(self) -> None:
        if self.handle:
            load().GenieLog_free(self.handle)
            self.handle = _handle()


class GenieError(BackendError):
    """A Genie call that failed; ``log`` holds Genie's own error and warning lines before it."""

    def __init__(self, what: str, status: int, log: list[str] | None = None):
        self.what, self.status, self.log = what, status, log or []
        name = STATUS_NAMES.get(status, f"error {status}")
        lines = "".join(f"\n  {ln}" for ln in self.log)
        super().__init__(f"{what} failed ({name}){lines}")


def _check(status: int, what: str, log: GenieLog | None = None) -> int:
    if status < 0:
        raise GenieError(what, status, log.tail() if log else None)
    return status


class Dialog:
    """One GenieDialog made from a config dict (or a genie_config.json path). Genie resolves the
    config's relative paths against the process's working directory: callers pass absolute ones
    (``genie_model.absolute_paths``)."""

    def __init__(self, config: dict | str | Path, log_level: str = "warn",
                 echo: Callable[[str], None] | None = None):
        lib = load()
        self.config: dict = (config if isinstance(config, dict)
                             else json.loads(Path(config).read_text()))
        config = self.config
        self.log = GenieLog(log_level, echo)
        self._cfg, self.handle = _handle(), _handle()
        self.last_status = 0
        try:
            _check(lib.GenieDialogConfig_createFromJson(json.dumps(config).encode(),
                                                        ctypes.byref(self._cfg)),
                   "GenieDialogConfig_createFromJson", self.log)
            _check(lib.GenieDialogConfig_bindLogger(self._cfg, self.log.handle),
                   "GenieDialogConfig_bindLogger", self.log)
            _check(lib.GenieDialog_create(self._cfg, ctypes.byref(self.handle)),
                   "GenieDialog_create", self.log)
        except GenieError:
            self.close()
            raise

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Iterator[int]:
        """Tokens after ``prompt_ids`` (the config's sampler), streamed as Genie's callback hands
        them over. ``last_status`` holds Genie's status once the tokens end
        (``CONTEXT_EXCEEDED`` when the context filled up)."""
        if self.config["dialog"].get("type") == "lade":  # Genie would end the process
            raise BackendError("a lade dialog takes text: a token query on one ends the process "
                               "(libGenie 1.21)")
        lib = load()
        _check(lib.GenieDialog_setMaxNumTokens(self.handle, max_new_tokens),
               "GenieDialog_setMaxNumTokens", self.log)
        ids = (ctypes.c_uint32 * len(prompt_ids))(*prompt_ids)

        def query(put):
            def on_tokens(ptr, n, _code, _user):
                for i in range(n):
                    put(int(ptr[i]))
            cb = _TOKEN_CB(on_tokens)
            return lib.GenieDialog_tokenQuery(self.handle, ids, len(prompt_ids),
                                              SENTENCE_COMPLETE, cb, None)
        return self._stream(query, max_new_tokens, "GenieDialog_tokenQuery")

    def stream(self, text: str, max_pieces: int) -> Iterator[str]:
        """Genie's own text path (its tokenizer, its BOS), the pieces of text its callback hands
        over (one a token), at most ``max_pieces``: where Genie goes on past them (``lade``
        ignores max-num-tokens and ABORT), the rest is read and dropped before this returns."""
        lib = load()
        _check(lib.GenieDialog_setMaxNumTokens(self.handle, max_pieces),
               "GenieDialog_setMaxNumTokens", self.log)
        raw = text.encode()

        def query(put):
            cb = _TEXT_CB(lambda s, _c, _u: put(s.decode("utf-8", "replace") if s else ""))
            return lib.GenieDialog_query(self.handle, raw, SENTENCE_COMPLETE, cb, None)
        return self._stream(query, max_pieces, "GenieDialog_query")

    def _stream(self, query: Callable, limit: int, what: str) -> Iterator:
        """``query(put)`` -> Genie's status, on a thread (ctypes lets go of the GIL for the
        call), each item its callback ``put``s yielded here, up to ``limit``. A consumer that
        stops early: Genie is told to stop before the dialog may go."""
        lib = load()
        items: queue.Queue = queue.Queue()
        done = object()
        result: list[int] = []

        def run():
            try:
                result.append(query(items.put))
            finally:
                items.put(done)

        worker = threading.Thread(target=run, name="genie-query", daemon=True)
        worker.start()
        n = 0
        try:
            while (x := items.get()) is not done:
                if n < limit:
                    n += 1
                    yield x
        finally:
            if worker.is_alive():
                lib.GenieDialog_signal(self.handle, ACTION_ABORT)
            worker.join()
        self.last_status = result[0] if result else -1
        _check(self.last_status, what, self.log)

    def query(self, text: str, on_text: Callable[[str], None]) -> int:
        """Genie's own text path: its tokenizer (the bundle's tokenizer.json) and prompt
        handling; ``on_text`` gets each piece. -> Genie's status."""
        lib = load()
        cb = _TEXT_CB(lambda s, _c, _u: on_text(s.decode("utf-8", "replace") if s else ""))
        return _check(lib.GenieDialog_query(self.handle, text.encode(), SENTENCE_COMPLETE, cb,
                                            None), "GenieDialog_query", self.log)

    def reset(self) -> None:
        _check(load().GenieDialog_reset(self.handle), "GenieDialog_reset", self.log)

    def close(self) -> None:
        lib = load()
        if self.handle:
            lib.GenieDialog_free(self.handle)
            self.handle = _handle()
        if self._cfg:
            lib.GenieDialogConfig_free(self._cfg)
            self._cfg = _handle()
        self.log.close()

    def __enter__(self) -> Dialog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
