"""What one build is asked for: ``BuildOptions``, the one source of ``hexforge build``'s flags.

Each field is annotated with its flag (``Flag``: the help line, and the parser or choices where
the type alone does not say them); ``add_build_flags`` makes the argparse arguments from the
fields, ``options_from_args`` the options from the parsed arguments. So a new option is a new
field and nothing else: it cannot be left out of the CLI (``--image-size`` once was, when the CLI
copied the fields by hand), and ``--help`` shows the dataclass's own defaults.

Light on purpose (no numpy, torch or onnx): ``hexforge --help`` and ``run`` build the parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, fields
from functools import cached_property
from typing import Annotated, Any, get_args, get_type_hints

from ..bundle import lade
from ..bundle.errors import BuildError
from .quantize import recipes
from .quantize.recipes import QuantRecipe


def byte_count(s: str) -> int:
    """'1800000000', '1.8G', '64M', '512k' -> bytes."""
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}
    s = s.strip().lower().rstrip("b")
    try:
        return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {s!r}") from None


def shard_bytes(s: str) -> int | dict[str, int]:
    """'1.8G' (every target) or 'cpu=300k,v81=80k' (per target)."""
    if "=" not in s:
        return byte_count(s)
    out = {}
    for part in s.split(","):
        name, _, value = part.partition("=")
        out[name.strip()] = byte_count(value)
    return out


def image_size(s: str) -> tuple[int, int]:
    """'512x384' (H x W) or '448' (square) -> (H, W)."""
    parts = s.lower().replace("*", "x").split("x")
    try:
        hw = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an image size: {s!r} (e.g. 512x512)") from None
    if len(hw) not in (1, 2) or min(hw) < 1:
        raise argparse.ArgumentTypeError(f"not an image size: {s!r} (e.g. 512x512)")
    return (hw[0], hw[-1])


def _recipes() -> tuple[str, ...]:
    """--quant's choices: the recipes, then their old names (aliases)."""
    return (*recipes.RECIPES, *recipes.ALIASES)


def _cpu_weights() -> tuple[str, ...]:
    from .quantize.nbits import CPU_WEIGHTS  # numpy only: no torch, no onnx

    return tuple(CPU_WEIGHTS)


def _kv_values() -> tuple[str, ...]:
    """--kv-values' choices (forge/compile/kvcast.py: fp16_kv, u8_values)."""
    return ("fp16", "u8")


class DefaultContext(int):
    """--context's default when nobody gave one: an int like any other to the code that reads it,
    which tells the build it may lower it to the positions a smaller model was trained on (2048
    was refused for those, naming a flag the user never typed); a --context given on the command
    line or in code is a plain int and is refused past them (forge/budget.py: fit_context)."""


DEFAULT_CONTEXT = DefaultContext(2048)


@dataclass(frozen=True)
class Flag:
    """How a BuildOptions field is given on the command line."""

    help: str
    name: str | None = None  # default: --<field-name> with dashes
    parse: Callable[[str], Any] | None = None  # default: the field's type (int, float, str)
    choices: Callable[[], tuple[str, ...]] | None = None  # resolved when the parser is made
    metavar: str | None = None
    negate: bool = False  # a True default, turned off by the flag (--no-verify)


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """Every option of one build (``hexforge build``'s flags, ``build(..., opts)``)."""

    targets: Annotated[str, Flag("cpu (always built, unless --device-only) plus HTP archs, "
                                 "e.g. v81 or v79,v81", name="--target")] = "cpu"
    quant: Annotated[str, Flag("HTP targets' precision: fp16; w8-fp16 / w4-fp16 (weight-only: "
                               "int8 / int4 weights, fp16 activations); w8-u16, w4-u16, "
                               "w8-u16-b128, w4-u16-rtn (fixed-point: int8 / int4 weights, uint16 "
                               "activations); w8a16, w4a16, w8a16-qdq, w4a16-qdq, w8a16-qdq-b128, "
                               "w4a16-qdq-rtn: their old names, accepted as aliases; the cpu "
                               "target: see --cpu-weights", choices=_recipes)] = "w8-fp16"
    context: Annotated[int, Flag("max tokens (prompt + generated); at most the model's "
                                 "max_position_embeddings (left out: lowered to them where they "
                                 "are fewer, said in the log), and the build's memory grows "
                                 "with it (checked before any work)")] = DEFAULT_CONTEXT
    prefill_len: Annotated[int, Flag("N of the AR-N prefill graph (tokens a prefill call "
                                     "takes)")] = 64
    verify_len: Annotated[int, Flag("k of the cpu target's AR-k verify graph (run "
                                    "--prompt-lookup drafts up to k-1 tokens a step); 0: "
                                    "none")] = 8
    htp_verify: Annotated[bool, Flag(
        "HTP: AR-k verify graphs too (k = --verify-len), one more binary per shard and the head "
        "on k rows, so --prompt-lookup verifies k rows at about a decode step's cost; without "
        "them it verifies through the AR-N prefill graphs")] = False
    kv_values: Annotated[str, Flag(
        "HTP, --quant fp16: the KV cache's values as fp16, or u8 (8 bits with a scale per row, "
        "computed in the graph: a quarter fewer cache bytes a step; keys stay fp16). Measured "
        "speed and quality: docs/htp.md", choices=_kv_values)] = "fp16"
    max_shard_bytes: Annotated[int | dict[str, int] | None, Flag(
        "per-graph weight ceiling (default: the target's per-context ceiling, less 4 %% on HTP "
        "targets for the binary's overhead): 1.8G, or cpu=3G,v81=1.8G", parse=shard_bytes,
        metavar="BYTES")] = None
    cpu_weights: Annotated[str, Flag(
        "cpu target weights: fp32 (greedy-exact vs HF) or weight-only int8 / int4 (onnxruntime "
        "MatMulNBits, a scale per 32 weights; int8-b128 / int4-b128: per 128, fewer bytes and "
        "faster, coarser; the head and embedding int8; gated on KL to HF); vision and audio "
        "towers take int8 under all of them", choices=_cpu_weights)] = "fp32"
    int4_per_layer_tables: Annotated[bool, Flag(
        "under --cpu-weights int4 / int4-b128 (no HTP target), Gemma-4's per-layer embedding "
        "tables int4 in the weights' blocks too (default: int8; E2B's ~2.6 GB table)")] = False
    device_only: Annotated[bool, Flag(
        "HTP: no cpu target (its fp32 graphs, ~4 B a parameter, are most of a bundle's bytes and "
        "build time): the bundle runs with --backend qnn or qnn-sim only")] = False
    share_weights: Annotated[bool, Flag(
        "HTP: one weight-shared context per shard for prefill + decode (device only: the x86 "
        "simulator cannot load them; the oracle runs unshared twins)")] = False
    genie: Annotated[bool, Flag(
        "HTP: also write a Genie bundle per target (genie-<target>/: context binaries in "
        "Genie's I/O contract, genie_config.json, tokenizer.json) for Android phones "
        "(docs/genie.md)")] = False
    genie_kv: Annotated[str, Flag(
        "--genie: the decoder's KV update in Genie's contract: concat (the past CL - AR rows, "
        "Genie appends the new ones), scatter (a cache_index input, the past CL rows) or lade "
        "(scatter, with a graph that masks what Genie's lookahead dialog leaves behind: "
        "`run --dialog lade` then gives basic's tokens; context <= 2048); scatter: llama, "
        "qwen2, mistral, qwen3; lade: those and gemma3_text; docs/genie.md",
        choices=lambda: ("concat", "scatter", "lade"))] = "concat"
    genie_lade: Annotated[str, Flag(
        "--genie-kv lade: Genie's lookahead block the folder's `run --dialog lade` takes, "
        "window,ngram,guesses; a step feeds 1 + (window + guesses) x (ngram - 1) rows to the "
        "AR-N graph, at most --prefill-len (measured per task class: docs/genie.md)",
        metavar="W,N,G")] = lade.DEFAULT
    genie_host_rows: Annotated[bool, Flag(
        "--genie, where Genie's embedding LUT is 8-bit a row (a 16-bit one would pass the 4 GiB "
        "libGenie reads: Gemma-4-E2B / E4B): the host's embedding tables in those same rows, so "
        "the cpu and HTP targets run the weights Genie runs (how libGenie = qnn-sim is proven on "
        "one bundle); off, they keep the checkpoint's precision and the Genie oracle judges the "
        "8-bit rows (docs/genie.md)")] = False
    estimate: Annotated[bool, Flag(
        "HTP: each graph compiled once more for QNN's on-host estimator (Hextimate: v81 on "
        "SA8797, v73 on QCS9100; none for v75 / v79), the binary thrown away: per graph us, DDR "
        "bytes, ops without a cost; decode step, tok/s, prefill, TTFT into report.json "
        "(`hexforge estimate`)")] = False
    calib: Annotated[str | None, Flag("calibration text file (default: a built-in sample)",
                                      metavar="FILE")] = None
    verify: Annotated[bool, Flag("skip the HF oracle and its gates; HTP targets still run each "
                                 "compiled graph once on the HTP against the graph it was "
                                 "compiled from, on the CPU (docs/notes/realsize.md)",
                                 name="--no-verify", negate=True)] = True
    verify_tokens: Annotated[int, Flag(
        "the oracle's teacher-forced / greedy tokens; on the x86 HTP simulator a real-size "
        "decode step takes about a minute", metavar="N")] = 64
    eval_text: Annotated[str | None, Flag(
        "the oracle's held-out text (UTF-8) for KL / perplexity / top-1 against HF (default: a "
        "built-in English text no build calibrates on)", metavar="FILE")] = None
    eval_tokens: Annotated[int, Flag("score at most N tokens of it (fewer where the context or "
                                     "whole prefill chunks stop sooner)", metavar="N")] = 256
    image_size: Annotated[tuple[int, int] | None, Flag(
        "fixed-resolution vision graphs (Qwen-VL): the build resolution, e.g. 512x512 (the "
        "model's default) or 448; images are resized to it (the build log and `hexforge "
        "inspect` show it)", parse=image_size, metavar="HxW")] = None
    audio_seconds: Annotated[float | None, Flag(
        "audio models: the encoder's fixed window in seconds (default: the model's maximum, "
        "30 s on Gemma-4); longer clips are refused at run time", metavar="S")] = None
    exporter: Annotated[str, Flag("torch.onnx exporter of the graphs (torchscript: measured "
                                  "2.5x faster to export, same graphs' speed)",
                                  choices=lambda: ("torchscript", "dynamo"))] = "torchscript"
    keep_work: Annotated[bool, Flag(
        "HTP: keep _work/ (each graph's float and QDQ ONNX) in the bundle for per-tensor "
        "accuracy probes (bench/htp_tensors.py); large")] = False

    @cached_property
    def recipe(self) -> QuantRecipe:
        """The HTP targets' quantization recipe ``quant`` names: resolved here once, passed on."""
        return recipes.get_recipe(self.quant)

    def validate(self) -> None:
        """Refuse, in one line, options that contradict each other or themselves — the checks
        that need no checkpoint (``forge/budget.py`` checks --context against the model and the
        machine)."""
        from ..bundle.targets import parse_targets
        from .quantize.nbits import check_cpu_weights

        targets = parse_targets(self.targets)
        htp = any(t.is_htp for t in targets)
        self.recipe  # noqa: B018 (an unknown --quant is refused here)
        cpu_bits = (check_cpu_weights(self.cpu_weights) or (32, 0))[0]
        if self.int4_per_layer_tables and (cpu_bits != 4 or htp):
            raise BuildError("--int4-per-layer-tables needs --cpu-weights int4 or int4-b128 and "
                             "no HTP target (HTP graphs run 8/16-bit weights and read the same "
                             "tables)")
        if self.prefill_len < 1 or self.context < 2:
            raise BuildError("--prefill-len must be >= 1 and --context >= 2")
        if not 0 <= self.verify_len < self.context:
            raise BuildError(f"--verify-len must be in [0, --context), got {self.verify_len}")
        if self.htp_verify and not (htp and self.verify_len):
            raise BuildError("--htp-verify needs an HTP --target and --verify-len > 0")
        if self.kv_values != "fp16" and not (htp and self.recipe.name == "fp16"):
            # weight-only recipes' decode is bound by the vector units that dequantize their
            # weights, not by DDR: the values' dequantization made them slower under Hextimate
            # (docs/notes/htp-speed.md)
            raise BuildError(f"--kv-values {self.kv_values} needs an HTP --target and --quant "
                             "fp16 (the weight-only recipes' decode is vector-bound: 8-bit values "
                             "make it slower; fixed-point ones keep their calibrated cache)")
        if self.genie and not htp:
            raise BuildError("--genie needs an HTP --target (e.g. v81)")
        if self.genie_host_rows and not self.genie:
            raise BuildError("--genie-host-rows is the Genie LUT's rows in the host: it needs "
                             "--genie")
        if self.genie_kv != "concat" and not self.genie:
            raise BuildError("--genie-kv is the Genie graphs' KV form: it needs --genie")
        if self.genie_lade != lade.DEFAULT and self.genie_kv != "lade":
            raise BuildError("--genie-lade is the lookahead dialog's block: it needs "
                             "--genie-kv lade")
        try:
            rows = lade.lade_rows(lade.lade_from(self.genie_lade))
        except ValueError as e:
            raise BuildError(f"--genie-lade {e}") from None
        if self.genie_kv == "lade" and self.prefill_len < rows:
            raise BuildError(f"--genie-kv lade: a lookahead step of --genie-lade "
                             f"{self.genie_lade} feeds {rows} rows to the AR-N graph; "
                             f"--prefill-len {self.prefill_len} is fewer")
        if self.estimate and not htp:
            raise BuildError("--estimate needs an HTP --target (e.g. v81)")
        if self.device_only:
            if not htp:
                raise BuildError("--device-only needs an HTP --target (e.g. v81)")
            if self.cpu_weights != "fp32":
                raise BuildError("--cpu-weights sets the cpu target's weights; --device-only "
                                 "leaves the cpu target out of the bundle")


def _flags() -> Iterable[tuple[str, Any, Flag, Any]]:
    """(field name, its type, its Flag, its default) per BuildOptions field."""
    hints = get_type_hints(BuildOptions, include_extras=True)
    for f in fields(BuildOptions):
        typ, flag = get_args(hints[f.name])[:2]
        yield f.name, typ, flag, None if f.default is MISSING else f.default


def add_build_flags(p: argparse.ArgumentParser, only: Iterable[str] | None = None) -> None:
    """BuildOptions' fields (or ``only`` those) as ``p``'s flags, each with its field's default."""
    keep = set(only) if only is not None else None
    for name, typ, flag, default in _flags():
        if keep is not None and name not in keep:
            continue
        opt = flag.name or "--" + name.replace("_", "-")
        if typ is bool:
            if default is not flag.negate:  # a store_true flag on a True default does nothing
                raise TypeError(f"BuildOptions.{name}: a bool flag turns its default around "
                                "(False, or True with negate=True)")
            p.add_argument(opt, dest=name, help=flag.help,
                           action="store_false" if flag.negate else "store_true")
            continue
        parse = flag.parse or next(t for t in (int, float, str) if t is typ or t in get_args(typ))
        p.add_argument(opt, dest=name, type=parse, default=default, help=flag.help,
                       metavar=flag.metavar, choices=flag.choices() if flag.choices else None)


def options_from_args(args: argparse.Namespace, **fixed: Any) -> BuildOptions:
    """The BuildOptions of parsed arguments (every field ``add_build_flags`` added; ``fixed``
    for the rest)."""
    given = {name: getattr(args, name) for name, *_ in _flags() if hasattr(args, name)}
    return BuildOptions(**{**given, **fixed})
