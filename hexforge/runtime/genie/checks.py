"""A Genie folder judged before libGenie is given it (``--backend genie`` and ``hexforge deploy``).

libGenie reads genie_config.json and opens what it names itself, deep in native code: a missing
context binary, a path that leaves the folder, a tokenizer of another model surface as a status
code, a crash or wrong tokens. Each is named here in one line instead::

    genie-v81/genie_config.json ── JSON, context.size, n-vocab, token ids
       ├─ every path it names (tokenizer, extensions, ctx-bins, LUTs): relative, inside the
       │  folder (links too: a phone gets the folder alone), a file; each ctx-bin a QNN context
       │  binary (its header names a SoC and arch)
       ├─ tokenizer.json: no more tokens than n-vocab (logits beyond it do not exist)
       └─ in a bundle whose manifest lists its files: n-vocab = the bundle's vocab, and the
          folder's files against their recorded sizes and digests (bundlefiles.py)

A prompt longer than the context is refused by ``options.check_request`` before a query, and
one longer than Genie's prefill can take by ``check_prompt_fits``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from ...bundle.errors import BundleError
from ...bundle.manifest import MANIFEST_NAME, confine

CONFIG = "genie_config.json"
MAX_CONFIG_BYTES = 1 << 20


def named_files(config: dict) -> Iterator[tuple[str, str]]:
    """(where, path) for every file genie_config.json names: the keys Genie 1.21's dialog schema
    gives a path (docs/genie.md), wherever in the dialog they sit."""
    d = config["dialog"]
    yield "tokenizer.path", d.get("tokenizer", {}).get("path")
    ext = d.get("engine", {}).get("backend", {}).get("extensions")
    if ext is not None:
        yield "engine.backend.extensions", ext
    binary = d.get("engine", {}).get("model", {}).get("binary", {})
    for key in ("ctx-bins", "fcb"):
        for i, p in enumerate(binary.get(key, []) or []):
            yield f"engine.model.binary.{key}[{i}]", p
    for block in ("embedding", "perlayer-embedding"):
        for where, path in lut_files(d.get(block, {})):
            yield f"{block}.{where}", path


def lut_files(lut: dict) -> Iterator[tuple[str, str]]:
    """(key path in the block, path) for the files an embedding LUT block names: the table, and a
    PCQ LUT's scales and offsets (a value a row: files, not numbers). The dialog's ``embedding``
    and a pipeline text-encoder's ``lut`` are such blocks."""
    if "lut-path" in lut:
        yield "lut-path", lut["lut-path"]
    quant = lut.get("quant-param", {})
    for key in ("scale", "offset"):
        if isinstance(quant.get(key), str):
            yield f"quant-param.{key}", quant[key]


def read_config(folder: Path) -> dict:
    path = folder / CONFIG
    if not path.is_file():
        raise BundleError(f"{folder} has no {CONFIG}: not a Genie folder (build with --genie)")
    confine(folder, CONFIG)  # a config linked in from elsewhere is a read outside
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise BundleError(f"{path} is over {MAX_CONFIG_BYTES} bytes; refused")
    try:
        config = json.loads(path.read_bytes())
        d = config["dialog"]
        int(d["context"]["size"]), int(d["context"]["n-vocab"])
        d["engine"]["model"]["binary"]["ctx-bins"]
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BundleError(f"{path} is not valid JSON: {str(e)[:200]}") from None
    except (KeyError, TypeError) as e:
        raise BundleError(f"{path} lacks dialog.{e.args[0] if e.args else '?'} (dialog.context "
                          "size / n-vocab and engine.model.binary.ctx-bins are needed)") from None
    return config


def _check_paths(folder: Path, config: dict) -> list[Path]:
    """Every named file inside ``folder`` and present; -> the context binaries."""
    bins = []
    for where, rel in named_files(config):
        if not isinstance(rel, str) or not rel:
            raise BundleError(f"{CONFIG} {where} must name a file, got {rel!r}")
        try:
            path = confine(folder, rel)
        except BundleError:
            raise BundleError(f"{CONFIG} {where} names {rel!r}, outside the Genie folder "
                              f"{folder.name}/ (a phone is given the folder alone); "
                              "refused") from None
        if not path.is_file():
            raise BundleError(f"{CONFIG} {where} names {rel!r}, which is missing from "
                              f"{folder.name}/")
        if where.startswith("engine.model.binary.ctx-bins"):
            bins.append(path)
    if not bins:
        raise BundleError(f"{CONFIG} names no context binary (engine.model.binary.ctx-bins)")
    return bins


def _check_binaries(bins: list[Path]) -> None:
    from ..qnn import binary_info  # the header text alone: no QNN library is loaded

    for b in bins:
        binary_info(b)  # "not a QNN HTP context binary (no soc/arch header)"


def _check_tokens(folder: Path, config: dict) -> None:
    from tokenizers import Tokenizer

    ctx = config["dialog"]["context"]
    n_vocab = int(ctx["n-vocab"])
    tok_path = folder / config["dialog"]["tokenizer"]["path"]
    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the Rust library's parse error: any malformed file
        raise BundleError(f"{tok_path.name} in {folder.name}/ is not a tokenizer Genie can read "
                          f"({str(e)[:160]})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > n_vocab:
        raise BundleError(f"{tok_path.name} in {folder.name}/ holds {size:,} tokens but "
                          f"{CONFIG}'s n-vocab is {n_vocab:,}: the tokenizer of another model?")
    for key in ("bos-token", "eos-token", "pad-token"):
        ids = ctx.get(key, -1)
        for t in ids if isinstance(ids, list) else [ids]:
            if not isinstance(t, int) or not -1 <= t < n_vocab:
                raise BundleError(f"{CONFIG} context.{key} {t!r} is outside the vocabulary "
                                  f"[0, {n_vocab}) (-1: none)")


def _check_against_bundle(folder: Path, config: dict, digests: bool | None) -> None:
    """Where the folder sits in a bundle: its n-vocab is the bundle's, its files the build's."""
    bundle = folder.parent
    if not (bundle / MANIFEST_NAME).is_file():
        return  # a Genie folder on its own (copied out, or AI Hub's): the checks above only
    from ...bundle.bundlefiles import check_load
    from ...bundle.manifest import load_manifest, refuse_symlinks_outside

    m = load_manifest(bundle, check_files=False)  # the other targets' files are not read here
    refuse_symlinks_outside(folder)  # nor is anything through a link out of the Genie folder
    n_vocab = int(config["dialog"]["context"]["n-vocab"])
    if n_vocab != m.vocab_size:
        raise BundleError(f"{folder.name}/{CONFIG}'s n-vocab {n_vocab:,} is not the bundle's "
                          f"vocabulary of {m.vocab_size:,}")
    inside = f"{folder.name}/"
    check_load(bundle, m, lambda rel: rel.startswith(inside), digests)


def check_folder(folder: Path, digests: bool | None = None) -> dict:
    """Everything above, before libGenie is loaded; -> the parsed genie_config.json.
    ``digests`` as ``hexforge.load``'s ``check_digests`` (bundles with a file list only)."""
    folder = Path(folder)
    config = read_config(folder)
    _check_against_bundle(folder, config, digests)  # sizes first: a short file is named as such
    _check_binaries(_check_paths(folder, config))
    _check_tokens(folder, config)
    return config


def _ar_of(binary: str) -> int | None:
    """N of a context binary named ``..._ar<N>_cl<C>_...`` (None: a weight-shared split's
    ``decoder_<i>_of_<n>.bin``, which holds its AR-N and AR-1 graphs in one context)."""
    m = re.search(r"_ar(\d+)_cl\d+", Path(binary).name)
    return int(m.group(1)) if m else None


def prefill_len(config: dict) -> int:
    """N of the folder's AR-N prompt graphs (``prompt_ar<N>_cl<C>_...`` in ctx-bins; 1 if none)."""
    bins = config["dialog"]["engine"]["model"]["binary"]["ctx-bins"]
    return max((n for b in bins if (n := _ar_of(b)) is not None), default=1)


def keep_ar1(dialog: dict, folder: Path) -> None:
    """``dialog`` (a genie_config's dialog or a pipeline's text-generator) given only its AR-1
    context binaries, in place: Genie then feeds a prompt one token a step. A folder whose
    AR-N and AR-1 contexts together pass what one HTP process domain holds (the x86
    simulator's ~3.3 GB: docs/genie.md#what-genie-refuses-here) runs so; a weight-shared
    split holds both graphs in one context and cannot."""
    binary = dialog["engine"]["model"]["binary"]
    bins = binary["ctx-bins"]
    if any(_ar_of(b) is None for b in bins):
        raise BundleError(f"{folder.name} holds each split's AR-N and AR-1 graphs in one context "
                          "(--share-weights): it has no AR-1-only dialog")
    binary["ctx-bins"] = [b for b in bins if _ar_of(b) == 1]
    if not binary["ctx-bins"]:
        raise BundleError(f"{folder.name} has no AR-1 context binary (token_ar1_*) in its "
                          f"{CONFIG}")


def check_prompt_fits(n_prompt: int, config: dict) -> None:
    """libGenie 1.21 takes a prompt of at most CL - N + 1 tokens through AR-N graphs of a CL
    context: past that it logs "Context Size was exceeded." and returns no token and no error
    (docs/genie.md#every-family), though decoding runs on to the context's end. Refused here in
    one line instead of an empty answer."""
    from ...bundle.errors import RequestError

    C = int(config["dialog"]["context"]["size"])
    N = prefill_len(config)
    most = C - N + 1
    if n_prompt > most:
        raise RequestError(f"a prompt of {n_prompt} tokens is more than Genie's AR-{N} prefill "
                           f"takes in a context of {C} ({most} at most): shorten it, or rebuild "
                           "with a larger --context or a smaller --prefill-len")
