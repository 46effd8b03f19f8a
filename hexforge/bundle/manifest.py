"""The bundle contract: ``manifest.json`` schema, load/validate/save.

A bundle is a directory::

    bundle/
      manifest.json          this schema (versioned)
      report.json            the oracle's parity report (per target)
      host.safetensors       host tensors: embedding table, rope inv_freq, ... (never pickle)
      tokenizer/             tokenizer.json, tokenizer_config.json, chat template
      cpu/                   one folder per target: graphs + their shared external weight files
        s0.prefill.onnx  s0.decode.onnx  head.onnx  s0.weights   (the last decode graph runs the
                                                                   head too: one file for all three)
        s0.verify.onnx   AR-k rows for speculative decoding, on the shard's weight file (cpu;
                         HTP targets with --htp-verify, beside head.verify: the head on k rows)
      v81/ ...

Every path in the manifest is relative, has no ``..``, and must resolve (symlinks included) inside
the bundle directory; that is checked on load, before anything is read.

How the runtime drives the graphs is fully declarative here: each graph input names its *source*
(``hidden``, ``embed``, ``host:<extra embed>``, ``rope_cos:<rope>``, ``rope_sin:<rope>``, ``mask:<group>``,
``valid`` = [1, T] 1.0 for real tokens / 0.0 for pad rows, ``tail:<k>`` = a one-hot [1, k, k+T] that picks
the last k real rows of [k state rows | T step rows] (conv fifos),
``state:<name>`` = the buffer before this step, ``new:<name>`` = rows an earlier graph of this step made,
``kv_seqlens:<group>`` [1] int32 / ``kv_total:<group>`` [] int32 = rows of the group's caches held once
the step is written, minus one / as is: onnxruntime GroupQueryAttention's, in cpu prefill / decode graphs;
Gemma-4's cpu graphs cut their caches to the rows held by ``kv_total``)
and each output its *sink* (``hidden``, ``logits``, ``state:<name>``, ``alias:<input>`` = the graph
writes this output into the memory of its own input ``<input>``, a cache it updates in place): the
engine never needs to know the family. A last decode graph with a ``logits`` output runs the head
itself (``TargetSpec.decode_runs_head``); the head graph then serves prefill only. Encoder
graphs (role vision/audio) also bind ``media:<key>`` (a preprocessed input), ``soft`` (soft tokens
out) and ``deepstack:<i>`` (features a decoder graph may take in). Every bind is checked on load
against the names the manifest declares (``bind_problem``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import BundleError

# 2: ``files`` records every file of the bundle (size, SHA-256); 3: a cache TensorSpec may say
# ``keys_transposed`` (an older hexforge would refuse the field in a long pydantic error: the
# version makes it say "upgrade hexforge" in one line)
SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)  # 1: bundles built before the file list; they load without its checks
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024  # refuse before parsing anything bigger


def _check_rel_path(p: str) -> str:
    pp = PurePosixPath(p)
    if not p or p.startswith(("/", "\\")) or pp.is_absolute() or ":" in p or "\\" in p:
        raise ValueError(f"path {p!r} must be relative to the bundle")
    if any(part in ("..", "") for part in p.split("/")):
        raise ValueError(f"path {p!r} must not contain '..' or empty parts")
    return p


RelPath = Annotated[str, AfterValidator(_check_rel_path)]
DType = Literal["float32", "float16", "int64", "int32", "uint16", "uint8", "int8", "bool"]
StateKind = Literal["kv_full", "kv_sliding", "kv_shared", "conv_fifo", "ssm"]
GraphRole = Literal["prefill", "decode", "verify", "head", "vision", "audio"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class TensorSpec(_Model):
    """A graph input or output. ``bind`` says where the runtime gets/puts it (see module doc)."""

    name: str
    shape: list[int]
    dtype: DType
    bind: str
    # a KV cache bind whose rows (positions) run along the last axis, [1, KVH, D, C]: HTP graphs
    # keep keys transposed, as QK^T reads them (forge/compile/kvcast.py); else [1, KVH, C, D]
    keys_transposed: bool = False


class GraphSpec(_Model):
    name: str  # unique within the target, e.g. "s0.prefill"
    role: GraphRole
    file: RelPath
    seq_len: int = Field(ge=1)  # T: tokens per call (prefill AR-N, verify AR-k) or 1 (decode)
    layers: tuple[int, int] | None = None  # [start, end) decoder layers, for decoder graphs
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    bytes: int = 0  # graph + external weight bytes on disk (shared weights counted once per file)
    verify_file: RelPath | None = None  # build-time only: the unshared twin the simulator can run
    # where no oracle ran (--no-verify): one call on the HTP vs the float graph on the CPU
    # (forge/compile/graphcheck.py): worst output relative error, cosine, max|Δ|; simulator seconds
    htp_check: dict[str, float] | None = None


class StateSpec(_Model):
    """One state buffer of one layer. Shapes are without the batch dim of the graph I/O ([1, ...]).

    kinds:  kv_full    [kv_heads, context, head_dim]   rows written at their positions
            kv_sliding [kv_heads, window, head_dim]    ring buffer: slot = position % window
            kv_shared  (no buffer) — graphs read ``source`` (a donor layer's kv_* state)
            conv_fifo  [kernel-1, channels]            replaced whole every call (rows = time)
            ssm        [heads, k_dim, v_dim]           replaced whole every call
    """

    name: str  # e.g. "L3.k"
    layer: int
    kind: StateKind
    shape: list[int] = Field(default_factory=list)
    dtype: DType = "float32"
    group: str | None = None  # kv_*: the mask/slot group that maps positions to cache rows
    source: str | None = None  # kv_shared: the donor state's name

    @model_validator(mode="after")
    def _check(self) -> StateSpec:
        if self.kind == "kv_shared":
            if not self.source:
                raise ValueError(f"state {self.name}: kv_shared needs a source")
        elif not self.shape:
            raise ValueError(f"state {self.name}: {self.kind} needs a shape")
        if self.kind in ("kv_full", "kv_sliding") and not self.group:
            raise ValueError(f"state {self.name}: {self.kind} needs a group")
        return self


class MaskGroup(_Model):
    """A set of KV caches that share slot occupancy: 'full' (capacity = context) or a sliding ring."""

    name: str
    capacity: int = Field(ge=1)  # cache rows
    window: int | None = None  # None = full causal; W = key visible iff q_pos - k_pos < W


class RopeSpec(_Model):
    """cos/sin = cat(f, f) * scaling, f = position x inv_freq  ([T, rot_dim]); host-made in fp32.

    M-RoPE (``mrope_section`` = [t, h, w] frequency counts, summing to rot_dim / 2): positions are
    [3, T] (t, h, w) and frequency j takes its position from one axis. Interleaved (Qwen3-VL,
    Qwen3.5): j % 3 == 1 and j < 3h -> h, j % 3 == 2 and j < 3w -> w, else t; contiguous
    (Qwen2-VL): the first t frequencies t, the next h h, the last w w. 1-D positions = all axes."""

    name: str
    inv_freq: str  # host tensor name, shape [rot_dim / 2]
    attention_scaling: float = 1.0
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = False

    @model_validator(mode="after")
    def _check(self) -> RopeSpec:
        if self.mrope_section is not None and (
                len(self.mrope_section) != 3 or min(self.mrope_section) < 0):
            raise ValueError(f"rope {self.name}: mrope_section must be 3 counts, got "
                             f"{self.mrope_section}")
        return self


class SharedRows(_Model):
    """An int4 or int8 host table whose bytes live in a graph weight file of the bundle: a tied
    head's MatMulNBits weight is the table quantized by the same quantizer (bundle/qtables.py
    ``Int4Table`` / ``Int8Table``), so a cpu-only quantized bundle stores it once. ``rows``:
    [offset, length] of the uint8 rows [V, D x bits / 8] in ``file``; ``scales``: of the float32
    scales [V, D / block]."""

    file: RelPath  # bundle-relative, e.g. "cpu/s0.weights"
    rows: tuple[int, int]
    scales: tuple[int, int]
    shape: tuple[int, int]  # [V, D]
    block: int
    bits: Literal[4, 8] = 4  # 4: zero point 8, two columns a byte; 8: zero point 128


class EmbedSpec(_Model):
    table: str  # host tensor [vocab, hidden]
    scale: float = 1.0  # Gemma multiplies by sqrt(hidden)
    shared: SharedRows | None = None  # the table's rows are read from a weight file


class ExtraEmbedSpec(_Model):
    """Another per-token table gathered on the host and bound as ``host:<name>``."""

    name: str
    table: str  # host tensor [vocab, D]
    scale: float = 1.0


class HostRecipe(_Model):
    embed: EmbedSpec
    extra_embeds: list[ExtraEmbedSpec] = Field(default_factory=list)
    ropes: list[RopeSpec] = Field(default_factory=list)
    positions: Literal["1d", "mrope"] = "1d"
    # host gathers (embed, extra embeds) read this id in place of media placeholder tokens
    # (Gemma-4 computes its per-layer inputs from the pad token there); None = the placeholder's own
    media_pad_id: int | None = None


class EncoderSpec(_Model):
    """A media encoder: decoded media -> host preprocessing -> encoder graph -> soft tokens::

        file ─runtime/media.py─▶ image | waveform ─preprocessor(params)─▶ {media:<key>: array}
             ─graph <name>─▶ soft [1, S, H] (+ deepstack:<i> [1, S, H])
             ─first n rows─▶ spliced over the n placeholder tokens of the prompt

    The prompt marks each item with ``placeholder_text`` (or it is put before the text); the host
    expands it to ``[begin_id] placeholder_id * n [end_id]`` with n from the preprocessor.
    """

    name: str  # the encoder graph's name in every target, e.g. "vision", "audio"
    modality: Literal["image", "audio"]
    preprocessor: str  # a key of runtime/multimodal.py PREPROCESSORS, e.g. "gemma4_image"
    params: dict = Field(default_factory=dict)  # that preprocessor's parameters (it validates them)
    placeholder_id: int = Field(ge=0)
    placeholder_text: str  # how a prompt marks where an item goes, e.g. "<|image|>"
    begin_id: int | None = None
    end_id: int | None = None
    max_soft_tokens: int = Field(ge=1)  # rows of the graph's "soft" output


class TokenizerSpec(_Model):
    dir: RelPath = "tokenizer"
    files: list[str]
    chat_template: bool = False


class GenerationDefaults(_Model):
    eos_token_ids: list[int] = Field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


class ShardPlan(_Model):
    layers: tuple[int, int]
    prefill: str  # graph names
    decode: str
    # AR-k: speculative decoding's verify step (a cpu target's last one outputs every row's
    # logits); None: speculation verifies through the prefill graph
    verify: str | None = None

    def names(self) -> list[str]:
        """The shard's graphs: they share one weight file."""
        return [self.prefill, self.decode] + ([self.verify] if self.verify else [])


class RunPlan(_Model):
    prefill_len: int = Field(ge=1)
    shards: list[ShardPlan] = Field(min_length=1)
    head: str
    verify_len: int | None = None  # rows of the shards' verify graphs (None: no verify graphs)
    # the head on verify_len rows (HTP: one call for a verify step's logits, where the cpu's last
    # verify graph holds the head); None: the head graph runs once per row read
    verify_head: str | None = None

    @model_validator(mode="after")
    def _check(self) -> RunPlan:
        if any((s.verify is None) != (self.verify_len is None) for s in self.shards):
            raise ValueError("verify graphs: every shard has one and verify_len is set, or none")
        if self.verify_head is not None and self.verify_len is None:
            raise ValueError("a verify head without verify graphs")
        return self

    def graph_names(self) -> list[str]:
        """Every graph the plan runs: the shards', the head (and its verify rows)."""
        return ([x for s in self.shards for x in s.names()] + [self.head]
                + ([self.verify_head] if self.verify_head else []))


class TargetSpec(_Model):
    """Everything needed to run one target's graphs."""

    name: str
    htp_arch: int | None = None
    soc_model: int | None = None
    qnn_sdk: str | None = None
    quant: str = "fp32"
    mask_value: float = -1e9  # additive mask for hidden keys (HTP: bounded, see docs/htp.md)
    hidden_dtype: DType = "float32"  # the shard-to-shard hand-off
    hidden_scale: float = 1.0  # the hand-off is HF's hidden state times this (fp16 graphs carry a
    # residual stream that would overflow fp16 scaled down: ExportForm.residual_scale)
    weight_shared: bool = False  # prefill + decode of a shard share one context binary (device only)
    graphs: list[GraphSpec]
    plan: RunPlan

    @model_validator(mode="after")
    def _check(self) -> TargetSpec:
        names = [g.name for g in self.graphs]
        if len(set(names)) != len(names):
            raise ValueError(f"target {self.name}: duplicate graph names")
        refs = self.plan.graph_names()
        missing = [r for r in refs if r not in names]
        if missing:
            raise ValueError(f"target {self.name}: run plan names unknown graphs {missing}")
        return self

    def graph(self, name: str) -> GraphSpec:
        return next(g for g in self.graphs if g.name == name)

    @property
    def decode_runs_head(self) -> bool:
        """The last shard's decode graph outputs the logits (cpu targets: ``blocks.WithHead``);
        the head graph then serves prefill only."""
        last = self.graph(self.plan.shards[-1].decode)
        return any(o.bind == "logits" for o in last.outputs)


ENCODER_ROLES = ("vision", "audio")


def bind_problem(bind: str, names: dict[str, set[str]], encoder: bool, output: bool) -> str | None:
    """Why ``bind`` is not a known source/sink (module doc), or None. ``names`` holds the manifest's
    declared names per kind: ``host`` (extra embeds), ``rope``, ``mask``, ``state``. The engine
    looks binds up by string, so an unknown one would otherwise only fail mid-generation."""
    kind, colon, arg = bind.partition(":")
    if not colon:
        plain_in = {"hidden", "embed", "valid", "soft"} if encoder else {"hidden", "embed", "valid"}
        plain_out = {"hidden", "logits", "soft"} if encoder else {"hidden", "logits"}
        if bind in (plain_out if output else plain_in):
            return None
        return "is not a known " + ("sink" if output else "source")
    if kind in ("tail", "deepstack"):
        # deepstack:<i> features leave an encoder and enter decoder layers (Qwen3-VL)
        allowed = kind == "deepstack" or not output
        if allowed and arg.isdigit() and (kind == "deepstack" or int(arg) >= 1):
            return None
        return f"needs a {'positive ' if kind == 'tail' else ''}integer after '{kind}:'"
    if kind == "media":
        return None if encoder and arg and not output else "media:<key> binds only encoder inputs"
    if kind == "alias":  # its input is checked against the graph (Manifest._check)
        return None if output and arg else "alias:<input> binds only outputs"
    by_kind = {"host": "host", "rope_cos": "rope", "rope_sin": "rope", "mask": "mask",
               "state": "state", "new": "state", "kv_seqlens": "mask", "kv_total": "mask"}
    if kind not in by_kind or (output and kind != "state"):
        return f"has an unknown kind {kind!r}"
    if arg not in names[by_kind[kind]]:
        return f"names {by_kind[kind]} {arg!r}, which the manifest does not declare"
    return None


def _alias_target(graph: GraphSpec, bind: str) -> TensorSpec | None:
    """The input an ``alias:<input>`` output writes into (None: not an alias or no such input)."""
    if not bind.startswith("alias:"):
        return None
    return next((i for i in graph.inputs if i.name == bind[6:]), None)


def _graphs_in(value) -> list[GraphSpec]:
    """Every GraphSpec anywhere in a model (targets today; other graph holders, e.g. encoders,
    without this check having to know their layout)."""
    if isinstance(value, GraphSpec):
        return [value]
    if isinstance(value, BaseModel):
        return [g for f in type(value).model_fields for g in _graphs_in(getattr(value, f))]
    if isinstance(value, dict):
        return [g for v in value.values() for g in _graphs_in(v)]
    if isinstance(value, list | tuple):
        return [g for v in value for g in _graphs_in(v)]
    return []


class FileRecord(_Model):
    """One file of the bundle as the build wrote it (checked by bundlefiles.py)."""

    path: RelPath
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(_Model):
    schema_version: int
    hexforge_version: str
    family: str  # the families/<family>.py that built it
    model_type: str  # HF config.model_type
    hf_config: dict
    context: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    host_tensors: RelPath = "host.safetensors"
    host: HostRecipe
    mask_groups: list[MaskGroup]
    state: list[StateSpec]
    tokenizer: TokenizerSpec
    generation: GenerationDefaults
    targets: dict[str, TargetSpec]
    encoders: list[EncoderSpec] = Field(default_factory=list)
    report: RelPath | None = "report.json"
    # every file of the bundle but manifest.json (which cannot hold its own digest), recorded
    # last by the build; None: a schema-1 bundle, or one still being built
    file_records: list[FileRecord] | None = None

    def _alias_problem(self, graph: GraphSpec, bind: str) -> str | None:
        """An ``alias:<input>`` output must write a cache input of the same shape and dtype."""
        if not bind.startswith("alias:"):
            return None
        target = _alias_target(graph, bind)
        if target is None or not target.bind.startswith("state:"):
            return "names no state input of this graph"
        out = next(o for o in graph.outputs if o.bind == bind)
        if (out.shape, out.dtype) != (target.shape, target.dtype):
            return f"differs from input {target.name!r} in shape or dtype"
        return None

    @model_validator(mode="after")
    def _check(self) -> Manifest:
        if self.schema_version not in READABLE_SCHEMAS:
            raise ValueError(_schema_problem(self.schema_version))
        names = {s.name for s in self.state}
        groups = {g.name for g in self.mask_groups}
        for s in self.state:
            if s.source and s.source not in names:
                raise ValueError(f"state {s.name}: source {s.source} is not a state")
            if s.group and s.group not in groups:
                raise ValueError(f"state {s.name}: group {s.group} is not a mask group")
        known = {"host": {e.name for e in self.host.extra_embeds},
                 "rope": {r.name for r in self.host.ropes}, "mask": groups, "state": names}
        for g in _graphs_in(self):
            for specs, output in ((g.inputs, False), (g.outputs, True)):
                for t in specs:
                    why = (bind_problem(t.bind, known, g.role in ENCODER_ROLES, output)
                           or self._alias_problem(g, t.bind))
                    if why:
                        raise ValueError(f"graph {g.name} {'output' if output else 'input'} "
                                         f"{t.name!r}: bind {t.bind!r} {why}")
        linear = {m.name for m in self.mask_groups if m.window is None}
        for g in _graphs_in(self):
            for t in g.inputs:
                kind, _, group = t.bind.partition(":")
                if kind in ("kv_seqlens", "kv_total") and group not in linear:
                    raise ValueError(f"graph {g.name} input {t.name!r}: bind {t.bind!r} needs a "
                                     "group whose row p holds position p (no window)")
        for enc in self.encoders:
            for target in self.targets.values():
                if enc.name not in {g.name for g in target.graphs}:
                    raise ValueError(f"encoder {enc.name}: target {target.name} has no such graph")
        return self

    def encoder(self, modality: str) -> EncoderSpec | None:
        return next((e for e in self.encoders if e.modality == modality), None)

    def files(self) -> list[str]:
        """Every bundle-relative file the manifest references (graphs' external data excluded)."""
        out = [self.host_tensors] + [f"{self.tokenizer.dir}/{f}" for f in self.tokenizer.files]
        out += [g.file for t in self.targets.values() for g in t.graphs]
        return out


def _schema_problem(version) -> str:
    readable = ", ".join(map(str, READABLE_SCHEMAS))
    fix = ("upgrade hexforge" if isinstance(version, int) and version > SCHEMA_VERSION
           else "rebuild the bundle with this version of hexforge")
    return f"schema_version {version!r} is not supported (this hexforge reads {readable}); {fix}"


def confine(bundle: Path, rel: str) -> Path:
    """Resolve ``rel`` inside ``bundle``; refuse anything (symlinks too) that lands outside."""
    try:
        _check_rel_path(rel)
    except ValueError as e:
        raise BundleError(f"bundle path refused: {e}") from None
    root = bundle.resolve()
    p = (root / rel).resolve()
    if p != root and root not in p.parents:
        raise BundleError(f"bundle path {rel!r} resolves outside the bundle ({p}); refused")
    return p


def refuse_symlinks_outside(bundle: Path) -> None:
    """Any symlink in the bundle that resolves outside it is refused, not only the paths the
    manifest names: the runtime also reads files by fixed name (tokenizer/chat_template.jinja,
    tokenizer_config.json, ONNX external data), and a bundle is untrusted input."""
    root = bundle.resolve()
    for dirpath, dirnames, filenames in os.walk(bundle):  # does not follow symlinked dirs
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                target = p.resolve()
                if target != root and root not in target.parents:
                    rel = p.relative_to(bundle).as_posix()
                    raise BundleError(f"bundle path {rel!r} is a symlink to {target}, outside the "
                                      "bundle; refused")


def load_manifest(bundle: str | os.PathLike, check_files: bool = True) -> Manifest:
    bundle = Path(bundle)
    mpath = bundle / MANIFEST_NAME
    if not bundle.is_dir():
        raise BundleError(f"{bundle} is not a bundle directory")
    if not mpath.is_file():
        raise BundleError(f"{bundle} has no {MANIFEST_NAME}; is it a hexforge bundle?")
    confine(bundle, MANIFEST_NAME)  # a manifest.json symlinked outside is a read outside
    if check_files:
        refuse_symlinks_outside(bundle)  # also files the runtime reads by fixed name
    size = mpath.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{mpath} is {size} bytes (> {MAX_MANIFEST_BYTES}); refused")
    try:
        raw = json.loads(mpath.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{mpath} is not valid JSON: {e}") from None
    except RecursionError:  # found by the fuzzer: "[" * 100000 overflows json's recursion
        raise BundleError(f"{mpath} nests JSON too deeply; refused") from None
    if not isinstance(raw, dict):
        raise BundleError(f"{mpath} must hold a JSON object")
    if raw.get("schema_version") not in READABLE_SCHEMAS:
        raise BundleError(f"{mpath}: {_schema_problem(raw.get('schema_version'))}")
    try:
        m = Manifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise BundleError(f"{mpath}: invalid manifest at {loc or '<root>'}: {first['msg']}") from None
    if check_files:
        for rel in m.files():
            p = confine(bundle, rel)
            if not p.is_file():
                raise BundleError(f"bundle file {rel!r} named in the manifest is missing")
    return m


def save_manifest(bundle: str | os.PathLike, m: Manifest) -> None:
    path = Path(bundle) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(m.model_dump(mode="json"), indent=1))
    os.replace(tmp, path)
