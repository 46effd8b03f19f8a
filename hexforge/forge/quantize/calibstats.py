"""Calibration statistics for the HTP QDQ pass, streamed one graph call at a time.

    GraphStats     one float graph: ORT MinMax activation ranges (its calibration cache), the KV
                   state inputs' absmax, and the GPTQ inputs X of every weight MatMul as rows
    HessianStore   pooled H = sum X^T X per weight content on disk (as rows while they are the
                   smaller form, ``Gram``), + the GPTQ results solved from them (a shard's
                   prefill and decode share their weights: solved once)

Nothing stores a call's feeds: at real size 64 decode feeds of Qwen3-0.6B (each holding the whole
KV cache) were 15 GB before any statistic.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ...bundle.errors import BuildError


def weight_key(t) -> str:
    """Content key of a float weight (an initializer or its array; names differ between graphs)."""
    from onnx import numpy_helper

    arr = t if isinstance(t, np.ndarray) else numpy_helper.to_array(t)
    return hashlib.sha1(np.ascontiguousarray(arr, dtype=np.float32).tobytes()).hexdigest()


class _Reader:
    """onnxruntime.quantization CalibrationDataReader over recorded feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)


class GraphStats:
    """Streaming calibration statistics of one float graph, fed one call's inputs at a time (the
    feeds are never stored: a real-size decode feed holds the whole KV cache, 235 MB for
    Qwen3-0.6B at context 1024).

    - activation ranges: ORT's own MinMaxCalibrater (the augmented graph and tensor selection
      ``quantize_static`` builds internally), its per-call ranges merged by min / max — the same
      ranges as one call over every feed; ``save_ranges`` writes them as ORT's calibration cache;
    - ``past.*`` inputs' absmax (the KV state's fixed scale, ``_state_overrides``);
    - with ``hessians``: H = sum X^T X of every MatMul with an initializer weight (GPTQ), one H
      per activation (q/k/v share theirs).

    Its sessions map the graph's weight file (shared with the engine's through ``maps``); ``close``
    frees them and their temporary graph files."""

    def __init__(self, float_path: Path, workdir: Path, hessians: bool = True, ranges: bool = True,
                 maps: dict | None = None):
        import onnx

        self.path = Path(float_path)
        self.work = Path(workdir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.maps = {} if maps is None else maps  # weight file -> memmap, shared with the engine
        self._tmp: list[Path] = []
        self._cal = None
        if ranges:
            self._cal = _minmax_calibrator(self.path, self._tmp_path("augmented"), self.maps)
        self.past_absmax: dict[str, float] = {}
        self.calls = 0
        self._hsess = None
        # activation -> its rows X (float32) not yet folded into H = sum X^T X (float64, [K, K]):
        # calibration sees a few hundred rows, far fewer than K, so the rows are the smaller
        # form (real-size Qwen3.5-0.8B: ~0.2 GB of rows vs 3.6 GB of H per graph)
        self._rows: dict[str, list[np.ndarray]] = {}
        self.hessians: dict[str, np.ndarray] = {}
        self.n_rows: dict[str, int] = {}  # rows folded into hessians[a] (GPTQ's damping reads it)
        self.act_of: dict[str, str] = {}
        if not hessians:
            return
        model = onnx.load(str(self.path), load_external_data=False)
        weights = {t.name for t in model.graph.initializer}
        self.act_of = {n.input[1]: n.input[0] for n in model.graph.node
                       if n.op_type == "MatMul" and n.input[1] in weights}
        if not self.act_of:
            return
        have = {o.name for o in model.graph.output}
        for a in sorted(set(self.act_of.values()) - have):
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(a))
        hpath = self._tmp_path("hessian")
        onnx.save(model, str(hpath))
        self._hsess = _mapped_session(hpath, model, self.maps)
        self._hnames = [o.name for o in self._hsess.get_outputs()]

    def _tmp_path(self, kind: str) -> Path:
        """A graph file next to the float graph (its external weight file resolves; no 2 GB
        protobuf limit), removed by ``close``."""
        p = self.path.with_name(f".{self.path.stem}.{kind}.onnx")
        self._tmp.append(p)
        return p

    def add(self, feed: dict[str, np.ndarray]) -> None:
        if self._cal is not None:
            self._cal.collect_data(_Reader([feed]))
        self.calls += 1
        for name, v in feed.items():
            if name.startswith("past."):
                self.past_absmax[name] = max(self.past_absmax.get(name, 0.0),
                                             float(np.abs(v).max()) if v.size else 0.0)
        if self._hsess is None:
            return
        outs = dict(zip(self._hnames, self._hsess.run(None, feed), strict=True))
        for a in set(self.act_of.values()):
            x = outs[a].reshape(-1, outs[a].shape[-1])
            rows = self._rows.setdefault(a, [])
            rows.append(np.array(x, np.float32))
            if not Gram.rows_are_smaller(sum(len(r) for r in rows), x.shape[-1]):
                self._fold(a)  # rows outgrow H

    def _fold(self, a: str) -> None:
        rows = self._rows.pop(a, [])
        if rows:
            H = Gram(rows=np.concatenate(rows)).matrix()
            self.hessians[a] = self.hessians[a] + H if a in self.hessians else H
            self.n_rows[a] = self.n_rows.get(a, 0) + sum(len(r) for r in rows)

    def _gram(self, a: str) -> Gram:
        """Activation ``a``'s H in its smaller form (its rows while they are fewer than 2K)."""
        if a in self.hessians:
            self._fold(a)
            return Gram(H=self.hessians.pop(a), n=self.n_rows.pop(a))
        return Gram(rows=np.concatenate(self._rows.pop(a)))

    def save_ranges(self, cache: Path) -> Path:
        from onnxruntime.quantization.calibrate import save_tensors_data

        if not self.calls:
            raise BuildError(f"calibration never ran {self.path.name}")
        save_tensors_data(self._cal.compute_data(), cache)
        return cache

    def hessian_groups(self):
        """Yields (weight content keys, Gram): the weights that share one input activation, with
        its H = sum X^T X, one at a time."""
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(self.path), load_external_data=False)
        inits = {t.name: t for t in model.graph.initializer}
        keys: dict[str, list[str]] = {}
        for w, a in self.act_of.items() if self._hsess is not None else ():
            if a in self.hessians or a in self._rows:
                arr = numpy_helper.to_array(inits[w], base_dir=str(self.path.parent))
                keys.setdefault(a, []).append(weight_key(arr))
        for a, k in keys.items():
            yield k, self._gram(a)

    def close(self) -> None:
        self._cal = self._hsess = None
        self.hessians, self._rows, self.n_rows = {}, {}, {}
        for f in self._tmp:
            f.unlink(missing_ok=True)


def _mapped_session(path: Path, model, maps: dict):
    """CPU session of ``path`` (``model``: its proto, weights external) whose external weights are
    handed in as shared initializers over one read-only memmap per weight file, unpacked: the
    calibration sessions and the float engine hold one (page-cache) copy of a shard's weights,
    not one prepacked anonymous copy per session (real size: GBs per session)."""
    import onnx
    import onnxruntime as ort
    from onnx.external_data_helper import ExternalDataInfo

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    values = []
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = ExternalDataInfo(t)
        f = (path.parent / info.location).resolve()
        if f not in maps:
            maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        raw = maps[f][info.offset:info.offset + info.length]
        values.append(ort.OrtValue.ortvalue_from_numpy(raw.view(dtype).reshape(tuple(t.dims))))
        so.add_initializer(t.name, values[-1])
    if values:
        so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    sess._hexforge_initializers = values  # the OrtValues must outlive the session
    return sess


def _minmax_calibrator(float_path: Path, augmented: Path, maps: dict):
    """ORT's MinMaxCalibrater as ``quantize_static`` makes it for the QNN config (same tensor
    selection, same ReduceMin/ReduceMax augmentation), except that its graph keeps the weights in
    their external file (ORT loads them inline: one more full copy) and its session maps them."""
    import onnx
    from onnxruntime.quantization import calibrate as ort_calibrate
    from onnxruntime.quantization.quant_utils import add_infer_metadata

    def load_with_shapes(path: Path):  # ORT's load_model_with_shape_infer, weights left external
        inferred = augmented.with_name(augmented.stem + "-inferred.onnx")
        onnx.shape_inference.infer_shapes_path(str(path), str(inferred))
        model = onnx.load(str(inferred), load_external_data=False)
        add_infer_metadata(model)
        inferred.unlink()
        return model

    from .qnnconfig import qnn_qdq_config  # the same tensors the QDQ pass then quantizes

    cfg = qnn_qdq_config(float_path, None, {})
    saved = ort_calibrate.load_model_with_shape_infer
    ort_calibrate.load_model_with_shape_infer = load_with_shapes
    try:
        cal = ort_calibrate.MinMaxCalibrater(float_path, cfg.op_types_to_quantize,
                                             augmented_model_path=str(augmented),
                                             use_external_data_format=False)
    finally:
        ort_calibrate.load_model_with_shape_infer = saved
    cal.augment_graph()  # writes the augmented graph next to the float one (its weights resolve)
    cal.infer_session = _mapped_session(augmented, cal.model, maps)
    cal.model = None
    return cal


class Gram:
    """H = sum X^T X of one input activation, kept in the smaller of its two forms: the rows X
    [r, K] (float32) while r < 2K, else H [K, K] (float64). Calibration sees a few hundred rows,
    so for wide inputs the rows win by far: a real-size Gemma-4-E2B down projection (K = 12288)
    has a 1.2 GB H and ~330 rows of 16 MB; storing every H (~29 GB in all) ran such a build out
    of disk."""

    def __init__(self, rows: np.ndarray | None = None, H: np.ndarray | None = None,
                 n: int | None = None):
        """rows [n, K], or H [K, K] with n, the number of rows summed into it."""
        if (rows is None) == (H is None) or (H is not None and n is None):
            raise ValueError("a Gram is rows, or H and its row count")
        self.rows, self.H = rows, H
        self.n = rows.shape[0] if rows is not None else int(n)

    def __add__(self, other: Gram) -> Gram:
        if self.rows is not None and other.rows is not None:
            rows = np.concatenate([self.rows, other.rows])
            if Gram.rows_are_smaller(*rows.shape):
                return Gram(rows=rows)
        return Gram(H=self.matrix() + other.matrix(), n=self.n + other.n)

    @staticmethod
    def rows_are_smaller(n_rows: int, K: int) -> bool:
        """n rows float32 [n, K] take less room than H float64 [K, K]."""
        return n_rows < 2 * K

    def matrix(self) -> np.ndarray:
        """H [K, K] float64."""
        if self.H is not None:
            return self.H
        x = self.rows.astype(np.float64)
        return x.T @ x

    def save(self, f: Path) -> None:
        with open(f, "wb") as fh:  # np.savez would append ".npz" to a name without it
            np.savez(fh, **({"rows": self.rows} if self.rows is not None
                            else {"H": self.H, "n": np.int64(self.n)}))

    @staticmethod
    def load(f: Path) -> Gram:
        with np.load(f) as z:
            return (Gram(rows=z["rows"]) if "rows" in z.files
                    else Gram(H=z["H"], n=int(z["n"])))


class HessianStore:
    """Pooled GPTQ Hessians on disk, one ``Gram`` per input activation group (rows or H, the
    smaller), made into H one at a time by ``get`` (requantize_weights)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file_of: dict[str, Path] = {}
        self._n = 0
        self.gptq_kept = [0, 0]  # weights quantized by round to nearest / GPTQ (_weight_format)

    def _new(self, gram: Gram) -> Path:
        f = self.folder / f"h{self._n}.npz"
        self._n += 1
        gram.save(f)
        return f

    def add(self, groups) -> None:
        """Sum each group's ``Gram`` into every one of its weights' pooled one."""
        for keys, gram in groups:
            files = {self.file_of.get(k) for k in keys}
            f = files.pop() if len(files) == 1 else None
            if f is not None and {k for k, v in self.file_of.items() if v == f} == set(keys):
                (Gram.load(f) + gram).save(f)  # the same weights pooled again (prefill + decode)
            elif not any(k in self.file_of for k in keys):
                f = self._new(gram)
                self.file_of.update(dict.fromkeys(keys, f))
            else:  # groups that overlap differently: each weight its own copy
                for k in keys:
                    old = self.file_of.get(k)
                    self.file_of[k] = self._new(gram + Gram.load(old) if old is not None else gram)

    def gram(self, key: str) -> Gram | None:
        """Weight ``key``'s pooled ``Gram`` (its rows while they are fewer than 2K), or None."""
        f = self.file_of.get(key)
        return None if f is None else Gram.load(f)

    def get(self, key: str) -> np.ndarray | None:
        """Weight ``key``'s pooled H [K, K] float64, or None."""
        gram = self.gram(key)
        return None if gram is None else gram.matrix()

    def solved(self, key: str, kind: str, result: tuple | None = None):
        """The GPTQ result (scale, q) of weight ``key`` as ``kind``, kept once solved: prefill
        and decode of a shard share every weight and its pooled H. -> (scale, q) or None."""
        f = self.folder / f"gptq-{kind}-{key}.npz"
        if result is not None:
            np.savez(f, scale=result[0], q=result[1])
            return result
        if not f.is_file():
            return None
        with np.load(f) as z:
            return z["scale"], z["q"]

    def __len__(self) -> int:
        return len(self.file_of)
