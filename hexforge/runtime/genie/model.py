"""``--backend genie``: a bundle's Genie folder run through libGenie, with the Model API's
``generate`` / ``stream`` (runtime/genie/libgenie.py is the C API; this is the bundle side).

    BUNDLE/genie-v81/genie_config.json   (build --genie), or a Genie folder itself
      └─ config, made runnable here: paths absolute, BOS off (hexforge tokenizes, its tokenizer's
         post-processor adds the BOS), sampler / EOS from the request
           └─ GenieDialog_tokenQuery: tokens streamed, detokenized like every backend's

Genie decides everything a Model decides itself (sampler, stop at EOS, context), so the options it
has no counterpart for (constrained output, media, prompt lookup, min-p, repetition penalty, stop
strings) are refused, not ignored.
"""

from __future__ import annotations

import copy
import json
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from ...bundle.errors import BundleError, RequestError
from ...bundle.lade import DIALOGS, LADE, lade_from, lade_rows
from ...bundle.lut import LUT_DTYPES
from ...bundle.manifest import GenerationDefaults, load_manifest
from ..loop import Stops, StopStrings, emit
from ..options import (
    Done,
    GenerationMethods,
    GenerationOptions,
    GenerationResult,
    Piece,
    check_prefill_mode,
    check_request,
    request_clock,
)
from ..text import ChatTemplate, TextTokenizer, encode_prompt
from . import libgenie as genie
from .checks import check_folder, check_prompt_fits, keep_ar1, prefill_len

CONFIG = "genie_config.json"


def find_folder(bundle: Path, target: str | None = None) -> Path:
    """The Genie folder of a bundle (``genie-<target>``; the only one when no target is given),
    or ``bundle`` itself when it is one."""
    if (bundle / CONFIG).is_file():
        return bundle
    found = sorted(p.parent for p in bundle.glob(f"genie-*/{CONFIG}"))
    if target is not None:
        found = [p for p in found if p.name == f"genie-{target}"]
    if len(found) == 1:
        return found[0]
    if not found:
        raise BundleError(f"{bundle} has no Genie bundle" + (f" for {target}" if target else "")
                          + ": build it with --genie")
    raise BundleError(f"{bundle} has Genie bundles for several targets "
                      f"({', '.join(p.name for p in found)}): pick one with --arch")


def sampler_config(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   seed: int | None = None) -> dict:
    """Genie's sampler block; temperature 0 is greedy."""
    if temperature <= 0:
        return {"version": 1, "seed": seed if seed is not None else 42, "temp": 0.0,
                "top-k": 1, "top-p": 1.0, "greedy": True}
    return {"version": 1, "seed": seed if seed is not None else -1, "temp": float(temperature),
            "top-k": int(top_k), "top-p": float(top_p)}


def absolute_paths(config: dict, folder: Path) -> dict:
    """A copy of ``config`` whose file paths (relative to ``folder`` in a bundle, as
    genie-t2t-run wants them) are absolute: Genie resolves them against the working directory.
    The keys that name files are ``genie_checks.named_files``' (one list for both)."""
    import re

    from .checks import named_files

    cfg = copy.deepcopy(config)
    for where, path in list(named_files(cfg)):
        if path is None or Path(path).is_absolute():
            continue
        node, keys = cfg["dialog"], re.findall(r"[^.\[\]]+", where)
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        node[int(last) if isinstance(node, list) else last] = str(folder / path)
    return cfg


def never_eos(dialog: dict, folder: Path, n_vocab: int) -> int:
    """The eos-token that turns EOS off: -1, or with an embedding LUT (whose eos-token row
    Genie reads: -1 made libGenie read before the table and segfault) the row past the
    vocabulary the build writes for it (``forge.genie_bundle.write_lut``), which the sampler
    never picks. A LUT without it (an older bundle) is refused in one line."""
    emb = dialog.get("embedding")
    if emb is None:
        return -1
    import numpy as np

    item = np.dtype(LUT_DTYPES.get(emb.get("datatype", "float32"), np.float32)).itemsize
    path = Path(emb["lut-path"])
    rows = (path if path.is_absolute() else folder / path).stat().st_size // (int(emb["size"]) * item)
    if rows <= n_vocab:
        raise RequestError("--ignore-eos is not available with this Genie bundle: Genie reads "
                           "its eos-token's row of the embedding table (rebuild it with this "
                           "hexforge for a row that turns EOS off)")
    return n_vocab


def _refuse_shared_weights_off_device(folder: Path, config: dict) -> None:
    """Weight-shared contexts (build --share-weights) load on a device only: libQnnHtp on x86
    says "Shared weights buffer isn't supported on this platform", fails the context (err 1000)
    and the process then segfaults inside libGenie (measured, QNN 2.51) — refused here in one
    line instead."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return
    ext = config["dialog"]["engine"]["backend"].get("extensions")
    path = folder / ext if isinstance(ext, str) else None
    if path is not None and path.is_file():
        shared = json.loads(path.read_text()).get("context", {}).get("weight_sharing_enabled")
        if shared:
            raise BundleError(f"{folder.name} holds weight-shared contexts (--share-weights), "
                              "which load on a Snapdragon device only, not in the x86 simulator")


def _no_room(folder: Path, config: dict) -> str:
    """The one-line error for a Genie folder whose contexts libGenie found no HTP memory for."""
    bins = config["dialog"]["engine"]["model"].get("binary", {}).get("ctx-bins", [])
    total = sum((folder / b).stat().st_size for b in bins if (folder / b).is_file())
    why = genie.x86_room_note(total) if platform.machine().lower() not in ("aarch64", "arm64") \
        else None
    return (f"{folder.name}: libGenie found no HTP memory for its {len(bins)} context binaries "
            f"({total / 1e9:.2f} GB; \"{genie.NO_PD}\")" + (f": {why}" if why else ""))


def genie_result(tokenizer, tokens: list[int], prompt_tokens: int, finish: str, t0: float,
                 t_first: float | None, backend: str) -> GenerationResult:
    """A Genie request's result from its tokens and clock readings (perf_counter: the start,
    the first token; the end is now)."""
    return GenerationResult(
        text=tokenizer.decode(tokens), token_ids=tokens, prompt_tokens=prompt_tokens,
        finish_reason=finish, **request_clock(t0, t_first, len(tokens)),
        timings={"backend": backend})


class GenieModel(GenerationMethods):
    """generate / stream over a Genie bundle folder; one dialog, reset before each request."""

    def __init__(self, bundle: str | Path, arch: str | None = None, log_level: str = "warn",
                 prefill_mode: str = "chunked", dialog: str = "basic"):
        """``prefill_mode`` "decode": the dialog is given the folder's AR-1 contexts alone
        (``checks.keep_ar1``), so Genie feeds a prompt one token a step. ``dialog`` "lade":
        Genie's lookahead dialog, on a folder built with ``--genie-kv lade`` (``lade_block``)."""
        self.bundle = Path(bundle)
        self.folder = find_folder(self.bundle, arch if arch is None or arch.startswith("v")
                                  else f"v{arch}")
        # integrity (checks.py): the folder's files, paths and tokenizer judged before
        # libGenie sees them
        self.config = check_folder(self.folder)
        _refuse_shared_weights_off_device(self.folder, self.config)
        self.prefill_mode = check_prefill_mode(prefill_mode)
        if prefill_mode == "decode":
            keep_ar1(self.config["dialog"], self.folder)
        self.lade = lade_block(self.folder, dialog, prefill_mode, prefill_len(self.config))
        d = self.config["dialog"]
        self.context = int(d["context"]["size"])
        self.n_vocab = int(d["context"]["n-vocab"])
        eos = d["context"].get("eos-token", -1)
        self.eos = [e for e in (eos if isinstance(eos, list) else [eos]) if e >= 0]
        self.tokenizer = TextTokenizer(self.folder)
        tok_dir = self.bundle / "tokenizer"  # the chat template, when the folder is in a bundle
        self.chat_template = ChatTemplate.load(tok_dir) if tok_dir.is_dir() else None
        # the length a request gets by default: the bundle's generation defaults, as Model's
        self.max_new_tokens = (load_manifest(self.bundle).generation.max_new_tokens
                               if (self.bundle / "manifest.json").is_file()
                               else GenerationDefaults().max_new_tokens)
        self.log_level = log_level
        self._dialog: genie.Dialog | None = None
        self._made_for: str | None = None

    def _dialog_for(self, temperature: float, top_k: int, top_p: float, seed: int | None,
                    ignore_eos: bool) -> genie.Dialog:
        """A dialog whose sampler and EOS are the request's (Genie fixes them when the dialog is
        made: a request that changes them makes a new one)."""
        cfg = absolute_paths(self.config, self.folder)
        d = cfg["dialog"]
        if self.lade is not None:  # a text query: Genie's tokenizer, Genie's BOS
            d.update(type="lade", lade=self.lade)
        else:
            d["context"]["bos-token"] = -1  # hexforge's ids carry the BOS already
        if ignore_eos:
            # Genie pads the last AR-N chunk with pad-token, which falls back to eos-token: a
            # -1 there reaches the graph's gather and the HTP fails the execute (error 10)
            d["context"].setdefault("pad-token", self.eos[0] if self.eos else 0)
            d["context"]["eos-token"] = never_eos(d, self.folder, self.n_vocab)
        d["sampler"] = sampler_config(temperature, top_k, top_p, seed)
        if platform.machine().lower() not in ("aarch64", "arm64"):
            # the x86 simulator: a polling thread would take a core the simulator needs
            d["engine"]["backend"]["QnnHtp"]["poll"] = False
        key = json.dumps(cfg, sort_keys=True)
        if self._dialog is None or key != self._made_for:
            self.close()
            try:
                self._dialog = genie.Dialog(cfg, log_level=self.log_level)
            except genie.GenieError as e:
                if any(genie.NO_PD in ln for ln in e.log):  # no HTP memory for a context
                    raise BundleError(_no_room(self.folder, self.config)) from e
                raise
            self._made_for = key
        else:
            self._dialog.reset()
        return self._dialog

    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def request(self, prompt: str | list[int], o: GenerationOptions,
                media: frozenset[str] = frozenset()) -> GenieRequest:
        """``o`` checked against what Genie can do (``media``: the options a pipeline adds) and
        completed with the bundle's defaults: Genie's sampler block for the sampler, the
        manifest's generation defaults for the length (as ``Model``)."""
        refuse_unsupported(o, media)
        sampler = self.config["dialog"].get("sampler", {})
        return GenieRequest(
            ids=self.encode(prompt),
            max_new=self.max_new_tokens if o.max_new_tokens is None else o.max_new_tokens,
            temperature=(0.0 if sampler.get("greedy") else sampler.get("temp", 0.0))
            if o.temperature is None else o.temperature,
            top_k=sampler.get("top-k", 0) if o.top_k is None else o.top_k,
            top_p=sampler.get("top-p", 1.0) if o.top_p is None else o.top_p,
            seed=o.seed, ignore_eos=o.ignore_eos)

    def iterate(self, prompt: str | list[int], o: GenerationOptions | None = None
                ) -> Iterator[Piece | Done]:
        """As ``Model.iterate``: a ``Piece`` per piece of text, then one ``Done``."""
        t0 = time.perf_counter()
        r = self.request(prompt, o or GenerationOptions())
        check_request(r.ids, r.max_new, self.n_vocab, self.context)  # integrity: before libGenie
        check_prompt_fits(len(r.ids), self.config)
        if self.lade is not None:
            yield from self.iterate_lade(r, t0)
            return
        dialog = self._dialog_for(r.temperature, r.top_k, r.top_p, r.seed, r.ignore_eos)
        yield from self.pieces(dialog.generate(r.ids, r.max_new), r, len(r.ids), t0, "genie",
                               lambda: dialog.last_status == 0)

    def iterate_lade(self, r: GenieRequest, t0: float) -> Iterator[Piece | Done]:
        """A request through Genie's lookahead dialog, which takes text (a token query on one
        ends the process) and hands text back, a piece a token: the prompt's text must encode
        back to its ids (else Genie would run another prompt), and the answer's ids are its
        text's. libGenie 1.21's lade goes on to the context's end whatever max-num-tokens says:
        the answer is cut here at ``r.max_new`` pieces, the rest read and dropped."""
        text = self.prompt_text(r.ids)
        dialog = self._dialog_for(r.temperature, r.top_k, r.top_p, r.seed, r.ignore_eos)
        out: list[str] = []
        t_first = None
        for piece in dialog.stream(text, r.max_new):
            t_first = t_first or time.perf_counter()
            out.append(piece)
            yield Piece(piece, None)
        finish = "length" if len(out) >= r.max_new or dialog.last_status else "stop"
        ids = self.tokenizer.encode("".join(out), add_special_tokens=False)
        yield Done(genie_result(self.tokenizer, ids, len(r.ids), finish, t0, t_first,
                                "genie-lade"))

    def prompt_text(self, ids: list[int]) -> str:
        """The text Genie's own tokenizer turns into ``ids`` (its BOS first, as its config says)
        -- refused where it turns into other ids."""
        bos = int(self.config["dialog"]["context"].get("bos-token", -1))
        body = ids[1:] if bos >= 0 and ids[:1] == [bos] else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        back = ([bos] if bos >= 0 else []) + self.tokenizer.encode(text, add_special_tokens=False)
        if back != ids:
            raise RequestError("--dialog lade: Genie's lookahead dialog takes text, and these "
                               "prompt ids are not their text's encoding: give the prompt as text")
        return text

    def pieces(self, tokens: Iterator[int], r: GenieRequest, prompt_tokens: int, t0: float,
               backend: str, ended_itself: Callable[[], bool]) -> Iterator[Piece | Done]:
        """A Genie request's tokens, a dialog's or a pipeline's, through the generation loop
        every runtime shares (runtime/loop.py): a ``Piece`` per piece of text, then one ``Done``.
        ``tokens`` is closed at an EOS or at ``r.max_new`` (its producer stops Genie or lets it
        run out); ``ended_itself``: once the tokens ran out short of ``r.max_new``, whether
        Genie stopped at an EOS it did not hand over."""
        eos = set() if r.ignore_eos else set(self.eos)  # Genie hands the EOS over, then stops
        try:
            out = yield from emit(((t, None) for t in tokens), self.tokenizer.detokenizer(),
                                  Stops(eos, StopStrings([])), r.max_new)
        finally:  # read out, stopped early or abandoned: the producer is stopped
            close = getattr(tokens, "close", None)
            if close is not None:
                close()
        finish = out.finish
        if finish == "length" and len(out.tokens) < r.max_new and ended_itself():
            finish = "stop"
        yield Done(genie_result(self.tokenizer, out.tokens, prompt_tokens, finish, t0,
                                out.t_first, backend))

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.chat_template is None:
            raise RequestError("no chat template beside this Genie bundle: use a plain prompt")
        return self.chat_template.render(messages, add_generation_prompt=True)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def close(self) -> None:
        if self._dialog is not None:
            self._dialog.close()
            self._dialog = None


def lade_block(folder: Path, dialog: str, prefill_mode: str, ar: int) -> dict | None:
    """The lade block a ``dialog`` "lade" runs with (the folder's ``LADE``, its steps' rows at
    most ``ar``, the AR-N graph's), None for basic; refused where lade's tokens would not be
    basic's or it cannot run."""
    if dialog not in DIALOGS:
        raise RequestError(f"--dialog {dialog!r}: one of {', '.join(DIALOGS)}")
    if dialog == "basic":
        return None
    path = folder / LADE
    if not path.is_file():
        raise BundleError(f"--dialog lade: {folder.name} was not built for Genie's lookahead "
                          "dialog, whose tokens on it would not be basic's (build with --genie "
                          "--genie-kv lade)")
    if prefill_mode == "decode":
        raise RequestError("--dialog lade runs its steps through the AR-N graph: not with "
                           "--prefill-mode decode")
    try:
        block = json.loads(path.read_text())
        lade_from(f"{block['window']},{block['ngram']},{block['gcap']}")
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{path}: not a lade block ({e})") from None
    if lade_rows(block) > ar:
        raise BundleError(f"{path}: a lookahead step of this block feeds {lade_rows(block)} rows, "
                          f"past the folder's AR-{ar} graph")
    return block


@dataclass(frozen=True)
class GenieRequest:
    """One request as Genie takes it: the prompt's ids and the sampler, defaults filled in."""

    ids: list[int]
    max_new: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    ignore_eos: bool


# the GenerationOptions a Genie dialog has a counterpart for; the others must keep their defaults
GENIE_OPTIONS = frozenset({"max_new_tokens", "temperature", "top_k", "top_p", "seed",
                           "ignore_eos"})


def refuse_unsupported(o: GenerationOptions, media: frozenset[str] = frozenset()) -> None:
    """One line for an option Genie cannot honour (it samples and stops by itself): refused,
    not ignored. "Unused" is the field's own default in GenerationOptions (one source)."""
    for f in fields(GenerationOptions):
        if f.name in GENIE_OPTIONS or f.name in media:
            continue
        value = getattr(o, f.name)
        if f.name == "prefill_mode" and value is not None:
            raise RequestError("--backend genie: a Genie dialog's prefill mode is the model's, "
                               "set when it is loaded (hexforge.load(..., prefill_mode=...), "
                               "--prefill-mode)")
        if value is not None and value != f.default and value != []:
            what = ("images / audio need a Genie pipeline (build --genie with the model's towers)"
                    if f.name in ("images", "audios") else
                    "Genie samples and stops by itself")
            raise RequestError(f"--backend genie: {f.name.replace('_', '-')} is not supported "
                               f"({what})")
