"""Real-text quality: what ``llama-perplexity --kl-divergence`` reports, bundle against HF.

    held-out text ─tokenize─▶ ids [n]
        HF fp32 forward          ─▶ logits_hf [n, V]     (one pass)
        bundle, teacher-forced   ─▶ logits    [n, V]     (prefill chunks; every row through the head)
    per position i < n-1:  KL(p_hf ‖ p_bundle), argmax agreement, -log p(ids[i+1])
    -> KL mean / p99 / max, top-1, perplexity of the bundle and of HF

Why KL and not the cosine of raw logits: a softmax ignores a constant added to every logit, the
cosine does not (an int4 cpu bundle of SmolLM2 scored logits cos 0.006 with top-1 0.91).

The text is English prose written for this purpose, and neither the calibration text
(forge/quantize/calibtext.py) nor the oracle's prompt (forge/oracle/verify.py): a build never
sees it before it is judged on it. ``--eval-text FILE`` replaces it.
"""

from __future__ import annotations

import numpy as np

from ...bundle.errors import BuildError

EVAL_TEXT = (
    "The lighthouse keeper woke before dawn, as he had done for thirty years. He climbed the "
    "narrow stairs, wiped the salt from the great lens, and checked the oil in the lamp. Outside, "
    "the wind had turned to the north during the night, and the sea was grey and restless. A "
    "fishing boat was making its way home along the edge of the bay, its engine coughing in the "
    "cold air.\n\n"
    "In the village below, the baker had already lit her ovens. She made bread the way her "
    "grandmother had taught her: flour, water, salt and a little of yesterday's dough, mixed by "
    "hand and left to rise slowly in a cool room. People said it was the best bread on the coast, "
    "and on market days a queue formed outside her door long before the shop opened.\n\n"
    "The school at the end of the main street had only two classrooms. The younger children "
    "learned to read and count in one, and the older ones studied history, geography and science "
    "in the other. Their teacher believed that every lesson should begin with a question, so on "
    "the first day of spring she asked them why the days grow longer in summer. Some said the sun "
    "comes closer to the earth; others were sure it had to do with the moon. By the end of the "
    "week they had built a model of the solar system from wire and painted wooden balls, and they "
    "understood that the tilt of the earth's axis, not its distance from the sun, gives us the "
    "seasons.\n\n"
    "Every autumn, when the storms returned, the harbour master repaired the old stone wall that "
    "protected the boats. It was slow work. Each stone had to be lifted, cleaned and set back in "
    "its place with fresh mortar, and a single careless joint could let the waves in. He kept a "
    "notebook in which he recorded the height of every tide, the direction of the wind and the "
    "damage after each storm, and over the years that notebook became the most reliable weather "
    "record the village had."
)

MAX_EVAL_BYTES = 1 << 20


def eval_text(path: str | None) -> str:
    """The built-in held-out text, or the UTF-8 text of ``--eval-text FILE``."""
    from ..quantize.calibtext import read_text_option

    return read_text_option("--eval-text", path, MAX_EVAL_BYTES) if path else EVAL_TEXT


def eval_ids(tok, text: str, max_tokens: int) -> list[int]:
    """The text's tokens (with the tokenizer's special tokens, as a prompt gets them), at most
    ``max_tokens``; at least two (one prediction)."""
    ids = tok.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise BuildError("the evaluation text is shorter than two tokens")
    return ids


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    """HF's logits [n, V] for every position of ``ids`` (one fp32 forward)."""
    import torch

    with torch.no_grad():
        x = torch.tensor([ids])
        return hf(x, attention_mask=torch.ones_like(x)).logits[0].float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray, ids: list[int]) -> dict:
    """Per position i < n-1 (each has a next token): KL(ref ‖ got), top-1 agreement, and both
    models' negative log-likelihood of ids[i+1]. ref, got: logits [n, V]."""
    n = len(ids) - 1
    lp_ref, lp_got = log_softmax(ref[:n]), log_softmax(got[:n])
    kl = (np.exp(lp_ref) * (lp_ref - lp_got)).sum(-1)
    nxt = np.asarray(ids[1:])
    rows = np.arange(n)
    return {
        "tokens": n,
        "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
        "kl_max": float(kl.max()),
        "top1": float((lp_ref.argmax(-1) == lp_got.argmax(-1)).mean()),
        "ppl": float(np.exp(-lp_got[rows, nxt].mean())),
        "ppl_hf": float(np.exp(-lp_ref[rows, nxt].mean())),
    }


def bundle_logits(engine, ids: list[int], head=None) -> np.ndarray:
    """The bundle's logits [n, V] for every position of ``ids``, teacher-forced as a prompt is
    run: AR-N prefill chunks, each chunk's valid hidden rows through the head graph one by one,
    or through ``head`` ([1, 1, H] -> [1, 1, V]: ``twin_head``) where given.
    (A cpu target's decode graph runs its own head; the prefill path here has none.)"""
    rows: list[np.ndarray] = []
    last = engine.target.plan.shards[-1].prefill

    def observe(graph, _feeds, outputs, positions):
        if graph.name == last:
            rows.extend(outputs["hidden"][0, i:i + 1].copy() for i in range(len(positions)))

    engine.reset()
    engine.observer = observe
    try:
        engine.prefill(ids)
    finally:
        engine.observer = None
    if len(rows) != len(ids):  # a prompt tail that went through AR-1 (an in-place cache's end)
        raise BuildError(f"evaluation text of {len(ids)} tokens does not fit the prefill chunks "
                         f"of a {engine.context}-token context")
    if head is not None:
        return np.stack([head(r[None])[0, -1] for r in rows])
    batched = rows_head(engine)
    if batched is not None:
        hidden = np.stack(rows)  # [n, 1, H]
        return np.concatenate([batched(hidden[i:i + HEAD_ROWS, 0][None])[0]
                               for i in range(0, len(rows), HEAD_ROWS)])
    return np.stack([engine.head_logits(r[None]) for r in rows])


HEAD_ROWS = 64  # rows a call of the cpu head at once: [1, 64, 262144] fp32 logits are 67 MB
# the ops a head may hold for its rows to be batched: each row computed alone, no shape in them
ROW_WISE_OPS = frozenset({"SimplifiedLayerNormalization", "MatMul", "MatMulNBits", "Mul", "Div",
                          "Add", "Tanh", "Cast"})


def rows_head(engine):
    """A cpu target's head graph with its row axis symbolic, as a function [1, n, H] -> logits
    [1, n, V]; None for HTP targets (static shapes) or a head with more inputs than ``hidden``.

    Why: the head graph is [1, 1, H] (the decode step's), so the held-out text went through it a
    row at a time, each call reading the whole head (Gemma-3's 262,144 x 640 fp32 rows) again.
    The same graph, the same weights, 64 rows a call: about 14x less time for bit-identical
    logits."""
    import onnx
    import onnxruntime as ort

    from ...bundle.manifest import confine
    from ...runtime.backends import configure_threads, disable_prepacking

    if engine.target.htp_arch is not None:
        return None
    spec = engine.plan.head
    path = confine(engine.bundle, spec.file)
    model = onnx.load(str(path), load_external_data=False)
    if [i.name for i in model.graph.input] != ["hidden"] or any(
            n.op_type not in ROW_WISE_OPS for n in model.graph.node):
        return None  # e.g. a QDQ twin's head, whose norm reshapes to [1, 1, H]
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if len(dims) != 3:
            return None
        dims[1].dim_param = "rows"
    so = ort.SessionOptions()  # as the runtime opens a cpu head (backends.Backend.session)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    configure_threads(so)
    disable_prepacking(so)  # no second, packed copy of the head's weights beside the engine's
    # the weights stay where they are: the external data is read from the graph's own folder
    so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                str(path.parent))
    session = ort.InferenceSession(model.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    dtype = engine.hidden_dtype
    out = model.graph.output[0].name
    return lambda hidden: session.run([out], {"hidden": hidden.astype(dtype)})[0]


def twin_head(path, hidden_dtype: str = "float32"):
    """The head graph an HTP target's head binary was compiled from (``path``, its weights
    beside it) on the CPU EP, as a function [1, 1, H] -> logits [1, 1, V].

    Why: on the x86 simulator a weight-only head (MatMulNBits, emulated) takes seconds a row,
    over the 256 rows of the held-out text. Its CPU twin holds the same quantized weights (the
    int8 / int4 grid the device reads) at milliseconds a row
    (docs/quality.md#what-the-oracle-measures); only the HTP's fp16 rounding of the activations
    is missing, which the head binary's own rows (the teacher-forced ones, on the simulator)
    measure."""
    import onnxruntime as ort

    from ...runtime.backends import configure_threads

    so = ort.SessionOptions()
    so.log_severity_level = 3
    configure_threads(so)
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    name, out = session.get_inputs()[0].name, session.get_outputs()[0].name
    return lambda hidden: session.run([out], {name: hidden.astype(hidden_dtype)})[0]



def fake_quant_floor(hf, bits: int, block: int | None, ids: list[int], ref: np.ndarray,
                     layers) -> dict:
    """HF itself with the Linear weights of ``layers`` (the decoder layers; not the embedding,
    not the head) rounded to nearest on a symmetric ``bits`` grid, a scale per ``block`` input
    columns (per output channel where ``block`` is None), judged on ``ids`` against ``ref`` (the
    fp32 model's logits): the floor a weight-only bundle of that format reaches without smarter
    rounding. The weights are restored after."""
    import torch

    saved = []
    try:
        with torch.no_grad():
            for layer in layers:
                for m in layer.modules():
                    if isinstance(m, torch.nn.Linear):
                        saved.append((m, m.weight.data))
                        m.weight.data = rtn(m.weight.data.float(), bits, block)
            return compare(ref, hf_logits(hf, ids), ids)
    finally:
        for m, w in saved:
            m.weight.data = w


def rtn(w, bits: int, block: int | None):
    """Symmetric round to nearest of w [N, K] (torch): q = round(w / s) in +-(2^(b-1) - 1),
    s = absmax / (2^(b-1) - 1) per block of K (zero-padded at the end) or per row."""
    import torch

    qmax = 2 ** (bits - 1) - 1
    N, K = w.shape
    B = block or K
    pad = -K % B
    x = torch.nn.functional.pad(w, (0, pad)).reshape(N, -1, B)
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / qmax
    return (torch.round(x / s).clamp(-qmax, qmax) * s).reshape(N, -1)[:, :K].to(w.dtype)


def oracle_line(r: dict) -> str:
    """One target's verdict in a line: held-out text KL / top-1 / perplexity, greedy prefix."""
    t, g, tf = r.get("text"), r["greedy"], r["teacher_forced"]
    if t is None or "kl_mean" not in tf:  # a report written before the held-out text
        return (f"{'PASS' if r['passed'] else 'FAIL'}  teacher-forced logits cos min "
                f"{tf['cos_min']:.6f} top-1 {tf['top1']:.3f}; greedy {g['matching_prefix']}/"
                f"{g['new_tokens']}")
    return (f"{'PASS' if r['passed'] else 'FAIL'}  text KL {t['kl_mean']:.4g} (p99 {t['kl_p99']:.3g}) "
            f"top-1 {t['top1']:.3f} ppl {t['ppl']:.3f} (HF {t['ppl_hf']:.3f}) over {t['tokens']} "
            f"tokens; teacher-forced KL {tf['kl_mean']:.3g} top-1 "
            f"{tf['top1']:.3f}; greedy {g['matching_prefix']}/{g['new_tokens']}")
