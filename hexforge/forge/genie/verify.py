"""The oracle of a Genie bundle: its compiled graphs, fed as Genie feeds them, against HF.

Genie hands back tokens, never logits, so a run through ``libGenie`` can be compared with
``--backend qnn-sim`` token for token (tests/test_genie.py) but not scored. The build scores the
Genie graphs itself: each variant's context binary (the unshared twin where the bundle shares
weights) runs on the HTP — the x86 simulator here — through onnxruntime's QNN EP, driven the way
Genie's SMART_MASK KV manager drives it (docs/genie.md, measured with ``dump-tensors``):

    cache   past_key_{L}   [KVH, 1, D, CL]   rows 0..n-1 hold the tokens so far (host side)
    AR-N    a prompt in chunks of N, the last right-padded (pad rows masked whole, not kept)
    AR-1    one token a step once the prompt is in
    feeds   input_ids [1, AR] int32; past_*_in = the cache's first CL - AR rows;
            attention_mask [1, 1, AR, CL]: 0 on the n valid past rows and causally on the
            AR new ones, -1000 elsewhere; position_ids_cos/sin [1, 1, AR, D/2] = cos/sin of
            (n + i) * inv_freq, inv_freq from genie_config.json's positional-encoding
    after   the first T rows of past_*_out appended at n
    scatter (``--genie-kv scatter``, a ``cache_index`` input): past_*_in = the CL rows whole;
            the new rows' mask columns n + i (their slots) and cache_index [1, AR] = n + i,
            a pad row's CL - 1

and judged as every target is (``verify.verify_target``'s measures and GATES): the held-out
text through the AR-N graph (every row's logits), the oracle prompt through AR-N and HF's greedy
tokens through AR-1 (teacher-forced), then greedy tokens of its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ...bundle.errors import BuildError
from ...bundle.lut import LUT_DTYPES, LutEncoding

MASKED = -1000.0  # what Genie writes into a float32 mask (docs/genie.md)
STATES = ("conv_state_", "recurrent_state_")  # Genie's linear-attention tensors


def genie_inv_freq(positional_encoding: dict) -> np.ndarray:
    """inv_freq [rope-dim] as Genie computes it from one positional-encoding entry (the rope
    types ``families.base.genie_rope_scaling`` writes: default, linear, llama3).

    libGenie 1.21 reads ``rope-theta`` as an integer: given 31.622776 (Gemma-4's proportional
    rope as a default one over its 25 %) its dumped position_ids_cos / _sin are the angles of
    31^(-i/4), not 31.62^(-i/4) (regression: tiny Gemma-4 seeds 1-3 and the published E2B left
    qnn-sim's tokens), so the oracle truncates it as Genie does and a fractional theta fails
    ``genie.check_ropes`` at build time."""
    half = int(positional_encoding["rope-dim"])
    theta = float(int(positional_encoding["rope-theta"]))
    inv = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / (2 * half))
    scaling = positional_encoding.get("rope-scaling")
    if scaling is None:
        return inv
    kind = scaling["rope-type"]
    if kind == "qwen3vl-mrope":  # issue 61: on text t = h = w, each section the same 1-D rope
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":  # HF's _compute_llama3_parameters
        factor, lo, hi = scaling["factor"], scaling["low-freq-factor"], scaling["high-freq-factor"]
        old = scaling["original-max-position-embeddings"]
        wavelen = 2 * np.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / factor + smooth * inv
        return np.where(wavelen > old / lo, inv / factor,
                        np.where(wavelen < old / hi, inv, mid))
    raise BuildError(f"genie oracle: rope-type {kind!r} is not one hexforge writes")


def _entries(positional_encoding) -> list[dict]:
    return positional_encoding if isinstance(positional_encoding, list) else [positional_encoding]


class GenieGraphs:
    """The Genie variants of one bundle (AR -> its splits' sessions, in order) driven as Genie
    drives them, from the bundle alone (its genie_config.json and the graphs' tensor names), so
    no family code can make the oracle agree with itself:

      * a step runs the splits one after another over one table of named tensors (Genie's
        buffers are shared by name: a split's ``residual_<b>`` output is the next one's input);
      * every ``<group>key_<L>_in`` a graph takes (each cache group's prefix; past_ by
        default) gets a cache of CL rows on the host, its first CL - AR rows fed, the step's
        rows of ``<group>key_<L>_out`` appended (SMART_MASK);
      * each positional-encoding entry fills ``<prefix>position_ids_cos/sin``;
      * with ``linear-attention``, each ``conv_state_<L>_in`` / ``recurrent_state_<L>_in``
        starts at zero and takes the step's ``_out`` after it (measured with dump-tensors);
      * ``inputs_embeds`` are the ids' rows of the embedding LUT; an 8-bit one with a scale a
        row (PCQ) dequantized, then put in the graph input's 16-bit encoding ``lut_input``
        (scale, zero point), as Genie converts its rows."""

    def __init__(self, sessions: dict[int, list], config: dict, folder: Path,
                 lut_input: tuple[float, int] | None = None):
        d = config["dialog"]
        self.sessions, self.C = sessions, int(d["context"]["size"])
        self.N = max(sessions)
        eos = d["context"]["eos-token"]
        self.pad = max(int(d["context"].get("pad-token", eos[0] if isinstance(eos, list)
                                            else eos)), 0)
        self.ropes = {e.get("prefix", ""): genie_inv_freq(e)
                      for e in _entries(d["engine"]["model"]["positional-encoding"])}
        self.lut = None  # the rows Genie gathers into inputs_embeds, as they are in the file
        if "embedding" in d:
            width = int(d["embedding"]["size"])
            dtype = LUT_DTYPES[d["embedding"].get("datatype", "float32")]
            self.lut = np.memmap(folder / d["embedding"]["lut-path"], dtype,
                                 "r").reshape(-1, width)
        self.row_scales, self.lut_input = None, lut_input
        if "embedding" in d and d["embedding"].get("datatype") == "ufixed8":
            if lut_input is None:
                raise BuildError("genie oracle: an 8-bit LUT needs its graph input's encoding")
            self.row_scales = np.fromfile(folder / d["embedding"]["quant-param"]["scale"],
                                          np.float32)
        # cache groups by prefix (the default past_ when the config names none)
        prefixes = [g["prefix"] for g in d["engine"].get("cache-groups", [])] or ["past_"]
        self.shapes: dict[str, tuple] = {}  # cache name -> [H, 1, d, S] (keys) / [H, 1, S, d]
        self.state_shapes: dict[str, tuple] = {}  # linear-attention state -> its shape
        linear = bool(d["engine"]["model"].get("linear-attention"))
        for sess in sessions[1]:
            for x in sess.get_inputs():
                if x.name.startswith(tuple(prefixes)) and x.name.endswith("_in"):
                    self.shapes[x.name[:-3]] = tuple(x.shape)
                elif linear and x.name.startswith(STATES) and x.name.endswith("_in"):
                    self.state_shapes[x.name[:-3]] = tuple(x.shape)
        # the scatter form (--genie-kv scatter): a cache_index input, the past CL rows whole
        self.scatter = any(x.name == "cache_index" for sess in sessions[1]
                           for x in sess.get_inputs())
        self.reset()

    def reset(self) -> None:
        self.cache = {}
        for name, (H, _, a, b) in self.shapes.items():  # AR-1: the past is CL - 1 rows
            keys = self._keys(name)
            self.cache[name] = np.zeros((H, 1, a, self.C) if keys else (H, 1, self.C, b),
                                        np.float32)
        self.states = {name: np.zeros(shape, np.float32) for name, shape in self.state_shapes.items()}
        self.n = 0

    def _keys(self, name: str) -> bool:
        return re.search(r"key_\d+$", name) is not None

    def run(self, ids: list[int]) -> np.ndarray:
        """``ids`` through AR-1 (one id) or AR-N (2..N ids, padded) -> their logits [T, V]."""
        T = len(ids)
        AR = 1 if T == 1 else self.N
        if not 1 <= T <= AR or self.n + AR > self.C:
            raise BuildError(f"genie oracle: {T} tokens after {self.n} do not fit AR-{AR} / "
                             f"CL-{self.C}")
        S = self.C - AR
        mask = np.full((1, 1, AR, self.C), MASKED, np.float32)
        mask[..., :T, :self.n] = 0.0
        # the new rows' slots: concat, the last AR columns; scatter, n + i as Genie writes
        # cache_index (a pad row's slot CL - 1, attended by no row)
        first = self.n if self.scatter else S
        for i in range(T):  # the pad rows of a last chunk attend nothing, as Genie masks them
            mask[0, 0, i, first:first + i + 1] = 0.0
        padded = ids + [self.pad] * (AR - T)
        bus = {"input_ids": np.array([padded], np.int32), "attention_mask": mask}
        if self.scatter:
            bus["cache_index"] = np.array([[self.n + i if i < T else self.C - 1
                                            for i in range(AR)]], np.int32)
            S = self.C
        positions = (self.n + np.arange(AR, dtype=np.float64))[:, None]
        for prefix, inv in self.ropes.items():
            angles = positions * inv[None]
            bus[f"{prefix}position_ids_cos"] = np.cos(angles).astype(np.float32)[None, None]
            bus[f"{prefix}position_ids_sin"] = np.sin(angles).astype(np.float32)[None, None]
        if self.lut is not None:
            rows = np.asarray(self.lut[padded])
            if self.row_scales is not None:  # real = s x (q - 128), then the input's encoding
                real = (rows.astype(np.float64) - 128) * self.row_scales[padded][:, None]
                rows = LutEncoding(*self.lut_input).quantize(real)
            bus["inputs_embeds"] = rows[None]
        for name, c in self.cache.items():
            bus[f"{name}_in"] = c[..., :S] if self._keys(name) else c[:, :, :S]
        for name, state in self.states.items():
            bus[f"{name}_in"] = state
        bus.update(text_side_inputs(self.sessions[AR], AR))  # issue 61: a pipeline's, on text
        for sess in self.sessions[AR]:
            feeds = {x.name: bus[x.name] for x in sess.get_inputs()}
            names = [o.name for o in sess.get_outputs()]
            bus.update(zip(names, sess.run(None, feeds), strict=True))
        for name, c in self.cache.items():
            new = bus[f"{name}_out"]
            if self._keys(name):
                c[..., self.n:self.n + T] = new[..., :T]
            else:
                c[:, :, self.n:self.n + T] = new[:, :, :T]
        for name in self.states:  # Genie hands each state's output to the next step's input
            self.states[name] = bus[f"{name}_out"]
        self.n += T
        return bus["logits"][0, :T].astype(np.float32)

    def prompt(self, ids: list[int]) -> np.ndarray:
        """A prompt in AR-N chunks, as Genie runs one -> every position's logits [n, V]."""
        return np.concatenate([self.run(ids[i:i + self.N]) for i in range(0, len(ids), self.N)])


# issue 61: the decoder inputs a Genie pipeline's image node feeds (forge/genie/towers.py,
# Qwen3-VL's deepstack): on a text prompt Genie writes no row of them
SIDE_INPUTS = ("visual_pos_masks", "deepstack_visual_embeds_")
UNWRITTEN = 1e30  # what an unwritten row may hold (Genie's buffers: up to 2e34, measured)


def text_side_inputs(sessions: list, AR: int) -> dict[str, np.ndarray]:
    """Each split's pipeline side inputs as a text prompt has them: no image row (False), and
    features Genie never wrote -- huge, so a graph that let them reach a text row fails the
    oracle (the media flag's gate, ``families/qwen3_vl.Qwen3VLGenieStep``)."""
    out = {}
    for sess in sessions:
        for x in sess.get_inputs():
            if x.name == SIDE_INPUTS[0]:
                out[x.name] = np.zeros((1, AR), bool)
            elif x.name.startswith(SIDE_INPUTS[1]):
                out[x.name] = np.full([int(d) for d in x.shape], UNWRITTEN, np.float32)
    return out


def open_genie_graphs(ctx_files: dict[int, list[Path]], genie_folder: Path, htp_arch: int,
                      soc_model: int, lut_input: tuple[float, int] | None = None) -> GenieGraphs:
    import onnxruntime as ort

    from ...runtime import qnn

    cfg = json.loads((genie_folder / "genie_config.json").read_text())
    so = qnn.session_options(qnn.provider_options(htp_arch, soc_model, True), {})
    sessions = {}
    for ar, paths in ctx_files.items():
        with qnn.native_stdout_to_stderr():
            sessions[ar] = [ort.InferenceSession(str(p), so) for p in paths]
    return GenieGraphs(sessions, cfg, genie_folder, lut_input)


def verify_genie(graphs: GenieGraphs, ref: dict, quant: str, new_tokens: int,
                 text_name: str, steps: int | None = None, continue_after_miss: bool = True
                 ) -> dict:
    """The Genie graphs judged like a target (``verify.verify_target``'s measures and gates,
    ``steps`` and ``continue_after_miss`` as there)."""
    from dataclasses import asdict

    from ..oracle.quality import compare, log_softmax
    from ..oracle.verify import GATES, first_miss, greedy_as_forced, greedy_up_to_miss, kl_failures

    prompt, tokens = ref["prompt"], ref["tokens"][:steps]
    graphs.reset()
    got = [graphs.prompt(prompt)[-1]]
    for token in tokens[:-1]:
        got.append(graphs.run([token])[0])
    want = ref["logits"][len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    lp_got, lp_want = log_softmax(np.stack(got)), log_softmax(want)
    kl_tf = (np.exp(lp_want) * (lp_want - lp_got)).sum(-1)
    tf = {"kl_mean": float(kl_tf.mean()), "kl_max": float(kl_tf.max()),
          "top1": float((lp_got.argmax(-1) == lp_want.argmax(-1)).mean())}

    graphs.reset()
    ids = ref["eval_ids"][:graphs.C]
    text = {"text": text_name, **compare(ref["eval_logits"], graphs.prompt(ids), ids)}

    n = min(new_tokens, graphs.C - len(prompt))
    own = greedy_as_forced(got[:n], tokens[:n])
    if own is None and not continue_after_miss:  # up to the miss, read off the forced run
        own = greedy_up_to_miss(got[:n], tokens[:n])
    elif own is None:  # a miss: Genie's own greedy tokens from there on
        graphs.reset()
        own, logits = [], graphs.prompt(prompt)[-1]
        for i in range(n):
            own.append(int(logits.argmax()))
            if i + 1 < n:
                logits = graphs.run([own[-1]])[0]
    match = first_miss(own, tokens)

    gate = GATES[quant]
    failures = kl_failures(gate, tf, text)
    return {"quant": quant, "gate": asdict(gate), "runs": "genie graphs, Genie's feeds",
            "prompt_tokens": len(prompt), "teacher_forced": tf, "text": text,
            "greedy": {"new_tokens": len(own), "matching_prefix": match,
                       "exact": match == len(tokens), "hf": tokens, "bundle": own},
            "passed": not failures, "failures": failures}


def genie_ctx_files(work: Path, target: str, context: int) -> dict[int, list[Path]]:
    """AR -> the EPContext models of a target's unshared Genie binaries in the build's _work/,
    split 1 first (``genie.compile_genie_graphs``; named ``genie.graph_name``)."""
    import re

    found: dict[int, dict[int, Path]] = {}
    for p in (work / target).glob(f"*_ar*_cl{context}_*_of_*.ctx.onnx"):
        m = re.search(r"_ar(\d+)_cl\d+_(\d+)_of_(\d+)\.", p.name)
        found.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    if 1 not in found or len(found) != 2:
        raise BuildError(f"genie oracle: no prefill + decode EPContext models in {work / target}")
    return {ar: [splits[i] for i in sorted(splits)] for ar, splits in found.items()}


def verify_genie_bundles(root: Path, manifest, args, refs: dict[str, dict], new_tokens: int,
                         text_name: str) -> dict[str, dict]:
    """Each HTP target's Genie bundle (``genie-<target>/``) judged on the HTP -> {folder: report},
    beside the targets' own in report.json."""
    from ...runtime import qnn
    from ..oracle.verify import simulated_steps
    from ..progress import stage
    from .folder import LUT_INPUT, folder_name

    out = {}
    work = root / "_work" / "genie"
    note = work / LUT_INPUT
    lut_input = tuple(json.loads(note.read_text())) if note.exists() else None
    for name, spec in manifest.targets.items():
        if spec.htp_arch is None:
            continue
        with stage(f"oracle {folder_name(name)}", 1) as advance:
            graphs = open_genie_graphs(genie_ctx_files(work, name, manifest.context),
                                       root / folder_name(name), spec.htp_arch, spec.soc_model,
                                       lut_input)
            simulated = not qnn.is_arm_host()
            out[folder_name(name)] = verify_genie(
                graphs, refs[name], spec.quant, new_tokens, text_name,
                steps=simulated_steps(spec, new_tokens) if simulated else None,
                continue_after_miss=not simulated)
            del graphs
            advance()
    return out
