"""GGUF input: a llama.cpp ``.gguf`` file as a checkpoint, through transformers' own GGUF loader.

    MODEL.gguf ──transformers (gguf_file=…): dequantized to fp32──▶ HF model + tokenizer
               ──save_pretrained (safetensors) into the cache──▶ an ordinary checkpoint dir
               (config.json, model.safetensors, tokenizer.json, chat template, generation config)

The dequantized fp32 model is the oracle: the bundle is judged against what the GGUF holds, not
against the (unavailable) weights it was quantized from. transformers marks a GGUF-loaded model
as quantized, which ``save_pretrained`` refuses, so its state dict is copied into a plain
``from_config`` model first.

The conversion runs once per file: the cache key is the file's sha256, and a conversion writes
into a temp dir renamed into place at the end (a killed conversion leaves nothing that looks
done). The cache lives in ``$HEXFORGE_CACHE/gguf`` (default ``~/.cache/hexforge/gguf``).

Before any of that the file's layout is walked (``check_gguf``): a download cut short or a file
damaged on the way is named as such in one line, where transformers' reader fails deep inside
with a ``struct.error`` traceback (or reshapes a short tensor)::

    "GGUF" │ version │ n_tensors │ n_kv │ n_kv × (key, type, value) │ n_tensors × (name, dims,
    ggml type, offset) │ pad to general.alignment │ tensor data: offset + bytes(dims, type) each
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

from ...bundle.bundlefiles import sha256_of
from ...bundle.errors import CheckpointError
from ..partial import TempDir, remove_stale

GGUF_MAGIC = b"GGUF"


def cache_root() -> Path:
    return Path(os.environ.get("HEXFORGE_CACHE") or Path.home() / ".cache" / "hexforge") / "gguf"


def find_gguf(path: str | Path) -> Path | None:
    """``path`` if it is a .gguf file, the one .gguf in a dir without config.json, else None
    (a dir with several .gguf files and no config.json is an error: which one is meant?)."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:4])
        raise CheckpointError(f"{p} holds several .gguf files ({names}); give the file itself")
    return found[0] if found else None


# the fixed sizes of GGUF's metadata value types (GGUFValueType: 8 string, 9 array are not)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


class _Damaged(Exception):
    """The layout read so far contradicts itself (a count or length no file of this size holds)."""


class _Reader:
    """Little-endian reads from a GGUF file's start; reading past its end raises EOFError."""

    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size = f, size

    def take(self, n: int) -> bytes:
        if n > self.size - self.f.tell():
            raise EOFError
        return self.f.read(n)

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        """A uint64 count of items of at least a byte each: more than the file holds is damage."""
        n = self.unpack("Q")
        if n > self.size:
            raise _Damaged(f"{what} {n:,} > the file's {self.size:,} bytes")
        return n

    def string(self) -> bytes:
        return self.take(self.count("a string's length"))

    def skip_value(self, kind: int) -> object:
        """Read past one metadata value; -> it when it is a scalar (general.alignment is one)."""
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise _Damaged(f"metadata value type {kind}")
        item, n = self.unpack("I"), self.count("an array's length")
        if item in _SCALAR:
            self.take(n * struct.calcsize(_SCALAR[item]))
        else:
            for _ in range(n):
                self.skip_value(item)
        return None


def check_gguf(src: Path) -> None:
    """Refuse, in one line, a file that is not a whole GGUF: no magic, a header that runs past
    the end (a truncated download), counts no file of its size holds, or tensor data ending
    past the end. Reads the header only (the tokenizer's arrays included), never the tensors."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = src.stat().st_size
    with open(src, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise CheckpointError(f"{src} is not a GGUF file (no GGUF magic)")
        r = _Reader(f, size)
        try:
            version = r.unpack("I")
            if version not in (2, 3):
                raise CheckpointError(f"{src}: GGUF version {version} is not supported (2 or 3)")
            n_tensors, n_kv = r.count("the tensor count"), r.count("the metadata count")
            alignment = 32  # GGUF's default
            for _ in range(n_kv):
                key, kind = r.string(), r.unpack("I")
                value = r.skip_value(kind)
                if key == b"general.alignment" and isinstance(value, int) and value > 0:
                    alignment = value
            end = 0  # where the last tensor's data ends, from the data section's start
            for _ in range(n_tensors):
                name = r.string().decode("utf-8", "replace")
                n_dims = r.unpack("I")
                if not 1 <= n_dims <= _MAX_DIMS:
                    raise _Damaged(f"tensor {name!r} has {n_dims} dimensions")
                elements = 1
                for _ in range(n_dims):
                    elements *= r.unpack("Q")
                kind, offset = r.unpack("I"), r.unpack("Q")
                try:
                    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise _Damaged(f"tensor {name!r} has ggml type {kind}") from None
                end = max(end, offset + elements // block * block_bytes)
            data = -(-f.tell() // alignment) * alignment
        except EOFError:
            raise CheckpointError(f"{src} is truncated: its header runs past the file's end at "
                                  f"{size:,} bytes (a partial download? fetch it again)") from None
        except _Damaged as e:
            raise CheckpointError(f"{src} is damaged or cut short: {e} (fetch it again)") from None
    if data + end > size:
        raise CheckpointError(f"{src} is truncated: {size:,} bytes, its {n_tensors} tensors end at "
                              f"{data + end:,} (a partial download? fetch it again)")


def gguf_checkpoint(path: str | Path, log=None) -> Path:
    """The checkpoint dir converted from GGUF file ``path`` (converted now if not cached)."""
    src = Path(path)
    check_gguf(src)
    out = cache_root() / sha256_of(src)[:24]
    if (out / "config.json").is_file():
        return out
    from filelock import FileLock  # transformers' own dependency

    out.parent.mkdir(parents=True, exist_ok=True)
    # two builds of one GGUF at once convert it once: the second waits for the first's result
    # (both converted it side by side, minutes of CPU each, and the loser's work was thrown away)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").is_file():
            return out
        if log:
            log(f"converting {src.name} (GGUF, dequantized to fp32) into {out}")
        remove_stale(out.parent)  # conversions killed earlier (the OOM killer runs no finally)
        temp = TempDir(out)
        try:
            _convert(src, temp.path)
            (temp.path / "hexforge_gguf.json").write_text(json.dumps({"source": src.name}))
            try:
                os.replace(temp.path, out)
            except OSError:  # a conversion without the lock (an older hexforge) finished first
                if not (out / "config.json").is_file():
                    raise
        finally:
            temp.discard()
    return out


def _convert(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kw = {"gguf_file": src.name}
    try:
        with _no_tensor_bar(), _one_reader():
            config = AutoConfig.from_pretrained(str(src.parent), **kw)
            loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32,
                                                          **kw)
            tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kw)
    except (ValueError, KeyError, RuntimeError, OSError, struct.error) as e:  # an architecture
        # transformers' GGUF loader does not know, or damage check_gguf's layout walk cannot see
        raise CheckpointError(f"{src}: transformers cannot load this GGUF file "
                              f"({' '.join(str(e).split())[:300]})") from None
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing = model.load_state_dict(loaded.state_dict(), strict=False).missing_keys
    missing = [k for k in missing if k not in _tied(model)]
    if missing:
        raise CheckpointError(f"{src}: the GGUF has no values for {', '.join(missing[:3])}")
    dst.mkdir(parents=True, exist_ok=True)  # the locked temp dir, empty
    model.save_pretrained(str(dst), safe_serialization=True)
    tokenizer.save_pretrained(str(dst))
    GenerationConfig.from_model_config(loaded.config).save_pretrained(str(dst))
    if not (dst / "tokenizer.json").is_file():
        raise CheckpointError(f"{src}: its tokenizer has no fast (tokenizer.json) form")


@contextlib.contextmanager
def _no_tensor_bar():
    """Without transformers' per-tensor "Converting and de-quantizing GGUF tensors" bar (the
    build logs its own line): its loader calls tqdm directly, which read TQDM_DISABLE when it
    was imported, so setting that now changed nothing; its tqdm is a disabled one meanwhile."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as loader

    bar = loader.tqdm
    loader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        loader.tqdm = bar


@contextlib.contextmanager
def _one_reader():
    """The GGUF file parsed once, not once for each of transformers' config, weights and
    tokenizer loads: its reader reads the metadata item by item, and a 262,144-token vocabulary
    (Gemma-3's) is millions of small reads — two thirds of a conversion's time, three times
    over. Its readers are read-only views of one memory map, so one serves all three."""
    import gguf

    real, made = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in made:
            made[key] = real(path, mode)
        return made[key]

    gguf.GGUFReader = reader  # transformers imports it from the module at each load
    try:
        yield
    finally:
        gguf.GGUFReader = real


def _tied(model) -> set[str]:
    """Parameter names that share a tensor with another (a tied head)."""
    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied |= {name, seen[id(p)]}
        seen.setdefault(id(p), name)
    return tied
