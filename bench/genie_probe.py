"""Probe: how far does Qualcomm's Genie get with hexforge-built QNN context binaries?

Builds a tiny llama bundle for an HTP arch (fp16), then hands Genie (the onnxruntime-qnn wheel's
libGenie.so, which drives the x86 HTP simulator) one variant after another:

  A*  the bundle's own binaries, with the config knobs Genie offers (cache-group names)
  F*  the decoder re-exported in Genie's I/O contract (families/genieio.py ``GenieContract``): the whole
      contract, then the contract with one part left as hexforge has it, to see which parts Genie
      really requires, and a weight-shared context
and prints, per attempt, Genie's verdict in its own words (the last error lines of its log) and,
where it generates, whether its greedy tokens equal ``--backend qnn-sim``'s on the bundle.

    python bench/genie_probe.py --work /tmp/genie-probe [--arch v81] [--tokens 16] [--json out.json]

Each Genie run is a child process: a refusal can end in a segfault inside libGenie / libQnnHtp
(the simulator's answer to a weight-shared context), which must not end the probe.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPT = "The capital of France is"


def run_one(config: Path, ids: list[int], n: int) -> dict:
    """In the child: a dialog, one token query, closed; then a second dialog in the same process
    (Genie leaves the first one's buffers behind: the second shows whether the graph survives
    a cache it did not clear). -> {"tokens", "again", "status", "log"}. Genie's whole log (info
    level) goes to genie.log beside the config as it comes."""
    from hexforge.runtime.genie import libgenie as genie

    out: dict = {"tokens": None, "again": None, "status": None, "log": []}
    with open(config.parent / "genie.log", "w") as f:
        echo = lambda line: print(line, file=f, flush=True)  # noqa: E731
        try:
            for key in ("tokens", "again"):
                with genie.Dialog(config, log_level="info", echo=echo) as d:
                    out[key] = list(d.generate(ids, n))
                    out["log"] = d.log.tail(6)
            out["status"] = "ok"
        except genie.GenieError as e:
            out["status"] = f"{e.what}: {genie.STATUS_NAMES.get(e.status, e.status)}"
            out["log"] = e.log
    return out


def attempt(config: Path, ids: list[int], n: int, stdout_log: Path) -> dict:
    """Run ``run_one`` in a child process; its stdout (some of Genie's errors are printed there,
    not logged) is kept in ``stdout_log``."""
    cmd = [sys.executable, __file__, "--child", str(config), ",".join(map(str, ids)), str(n)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    stdout_log.write_text(p.stdout + p.stderr)
    result = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
    printed = [ln.strip() for ln in (p.stdout + p.stderr).splitlines()
               if ln.strip() and not ln.startswith(("RESULT ", " # LIBNATIVE", "warn: failed"))]
    if result is None:
        result = {"tokens": None, "status": f"crashed (exit {p.returncode})", "log": []}
    result["printed"] = printed[-3:]
    result["exit"] = p.returncode
    return result


def genie_config(bins: list[Path], folder: Path, manifest, tokenizer_json: Path, soc_model: int,
                 arch: int, extra: dict | None = None) -> Path:
    """A Genie config around ``bins`` (absolute paths) in ``folder``; ``extra`` is merged into
    the dialog block. BOS is off: the probe passes hexforge's own token ids, BOS included."""
    from hexforge.families.base import GenieRope, GenieSpec
    from hexforge.forge.genie.folder import EXTENSIONS, backend_extensions, dialog_config

    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXTENSIONS).write_text(json.dumps(backend_extensions(soc_model, arch, False)))
    head_dim = manifest.state[0].shape[-1]
    spec = GenieSpec(kv_dim=head_dim, ropes=(GenieRope("", head_dim // 2, rope_theta(manifest)),))
    cfg = dialog_config(manifest, [str(b) for b in bins], -1, spec,
                        tokenizer=str(tokenizer_json), extensions=str(folder / EXTENSIONS))
    merge(cfg["dialog"], extra or {})
    path = folder / "genie_config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def rope_theta(manifest) -> float:
    cfg = manifest.hf_config
    return float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta")))


def merge(into: dict, extra: dict) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v


def groups(prefix: str) -> dict:
    """An engine cache group with hexforge's mask name: the knob Genie offers for names."""
    return {"engine": {"cache-groups": [{"version": 1, "prefix": prefix,
                                         "attention-mask-tensor-name": "mask_full"}]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", help="checkpoint, bundle and attempts go here")
    ap.add_argument("--arch", default="v81")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the attempts here")
    ap.add_argument("--only", default=None, help="comma-separated attempt names (A0,F3,..)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        cfg, ids, n = a.child
        res = run_one(Path(cfg), [int(x) for x in ids.split(",")], int(n))
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if not a.work:
        ap.error("--work is required")

    from hexforge.bundle.manifest import load_manifest
    from hexforge.bundle.targets import TARGETS
    from hexforge.families import load_family
    from hexforge.families.blocks import calibrate_norm_scales
    from hexforge.families.genieio import DenseGenieStep, GenieContract
    from hexforge.forge.compile.contexts import compile_shared
    from hexforge.forge.context import StageContext
    from hexforge.forge.genie.decoder import compile_genie_graphs, export_genie_graphs
    from hexforge.forge.pipeline import BuildOptions, build
    from hexforge.forge.source.tiny import make_tiny_checkpoint
    from hexforge.runtime.model import Model

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    target = TARGETS[a.arch]
    soc, arch = target.default_soc.soc_model, target.htp_arch
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").is_file():
        make_tiny_checkpoint("llama", ckpt)
    bundle = work / "bundle"
    context, prefill = 128, 16
    if not (bundle / "manifest.json").is_file():
        build(ckpt, bundle, BuildOptions(targets=a.arch, quant="fp16", context=context,
                                         prefill_len=prefill, verify=False), log=print)
    model = Model(bundle, backend="qnn-sim")
    ids = model.encode(PROMPT)
    ref = model.generate(ids, max_new_tokens=a.tokens, temperature=0.0, ignore_eos=True).token_ids
    print(f"qnn-sim greedy {ref}")
    manifest = load_manifest(bundle)
    tokenizer_json = bundle / "tokenizer" / "tokenizer.json"

    results = []

    only = set(a.only.split(",")) if a.only else None

    def wanted(name: str) -> bool:
        return only is None or name in only

    def record(name: str, what: str, bins: list[Path], extra: dict | None = None):
        if not wanted(name):
            return
        folder = work / "attempts" / name
        cfg = genie_config(bins, folder, manifest, tokenizer_json, soc, arch, extra)
        r = attempt(cfg, ids, a.tokens, folder / "stdout.txt")
        r.update(name=name, what=what, equal=r["tokens"] == ref if r["tokens"] else None,
                 equal_again=r["again"] == ref if r.get("again") else None)
        results.append(r)
        verdict = (f"tokens {r['tokens']} ({'=' if r['equal'] else '!='} qnn-sim); "
                   f"a second dialog: {'=' if r['equal_again'] else '!='} qnn-sim"
                   + ("" if r["equal_again"] else f" {r['again']}")
                   if r["tokens"] else r["status"])
        print(f"[{name}] {what}: {verdict}")
        for line in r["log"][-3:] + r["printed"]:
            print(f"    {line}")

    own = [bundle / a.arch / f"{g}.ctx_qnn.bin" for g in ("s0.prefill", "s0.decode", "head")]
    record("A0", "hexforge's own binaries (s0.prefill, s0.decode, head)", own)
    record("A1", "+ cache group 'past.' with mask 'mask_full'", own, groups("past."))
    record("A2", "+ cache group 'past_' with mask 'mask_full'", own, groups("past_"))

    fam = load_family(manifest.model_type).FAMILY
    args = fam.Args.from_config(manifest.hf_config)
    hf = fam.load_hf(ckpt)
    calibrate_norm_scales(hf, ids, fam.reference_layers(hf))
    host = fam.host_recipe(hf, args)
    full = GenieContract()
    forms = [("F0", "Genie's whole I/O contract", full)]
    for i, f in enumerate(dataclasses.fields(GenieContract), 1):
        if f.type == "bool" or f.type is bool:
            forms.append((f"F{i}", f"the contract but {f.name}=False",
                          dataclasses.replace(full, **{f.name: False})))
    forms.append(("F9", "the contract but token_ids=False, the input named inputs_embeds",
                  dataclasses.replace(full, token_ids=False, embeds_name="inputs_embeds")))
    compiled = {}
    for name, what, form in forms:
        if not (wanted(name) or wanted(name + "e") or (name == "F0" and wanted("S0"))):
            continue
        folder = work / "forms" / name
        def step(hf, args, host, layers, T, context, scale, form=form):
            return DenseGenieStep.make(fam, hf, args, host, layers, T, context, form, scale)

        ctx = StageContext(fam, hf, args, BuildOptions(context=context, prefill_len=prefill,
                                                       exporter="torchscript"), folder, print)
        (paths,) = export_genie_graphs(ctx, host, folder / "onnx", 1.0, step=step)
        compiled[name] = paths
        bins = compile_genie_graphs(paths, folder / "bin", arch, soc, print)
        # hexforge's names: point the default group's mask at ours
        record(name, what, bins, None if form.names else groups("past_"))
        if not form.token_ids:  # the embedding as Genie's lookup table instead of a graph gather
            lut = folder / "embedding.f32"
            fam.text_model(hf).embed_tokens.weight.detach().float().numpy().tofile(lut)
            record(name + "e", what + ", + Genie's embedding LUT", bins,
                   {"embedding": {"version": 1, "type": "lut", "lut-path": str(lut),
                                  "size": args.hidden_size, "datatype": "float32"}})
    if not wanted("S0"):
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1, default=str))
        return 0
    shared = work / "forms" / "S0"
    shared.mkdir(parents=True, exist_ok=True)
    res = compile_shared([(p, shared / p.name.replace(".onnx", ".ctx.onnx"))
                          for p in compiled["F0"]], arch, soc, fp16=True)
    record("S0", "the whole contract, prefill + decode in one weight-shared context",
           [res["bin"]])
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
