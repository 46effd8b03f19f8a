"""Which lowering gives the HTP's matrix unit integer weights (issue 76): one decode-step linear,
[1, 1, K] x [K, N], in each weight form onnxruntime-qnn might take, compiled for v81 with CPU
fallback disabled (a form the EP cannot hold as one QNN graph is refused, said so) and read under
Hextimate, SA8797 (v81): its time, its cycles on the vector units (HVX) and the matrix unit (HMX),
its uncosted ops, its context binary's bytes a weight.

    python bench/experiments/int_weights.py [--k 2048] [--n 2048] [--work W]

The forms (activations x weights):
  fp16                  fp16 MatMul (the fp16 recipe)
  nbits8 / nbits4       com.microsoft MatMulNBits, symmetric, blocks of 32 (w8-fp16 / w4-fp16)
  f16-dq-s8             fp16 activations, DequantizeLinear(int8 per output channel) -> MatMul:
                        the HTP's FP16 x INT8 MatMul, if the EP lowers it so
  f16-dq-s4b64          fp16 activations, DequantizeLinear(int4, blocks of 64) -> MatMul
  f16-dqpt-s8 / -s4     fp16 activations, DequantizeLinear(int8 / int4, one fp16 scale of 1) ->
                        MatMul -> a per-channel fp16 Mul: the EP takes a standalone DQ only per
                        tensor ("does not support a standalone DQ op with per-channel
                        quantization"); does the HTP keep the weight integer then?
  u16-dq-s8             uint16 Q/DQ activations, int8 per-channel weights (fixed point, w8-u16)
  u16-dq-s4             uint16 Q/DQ activations, int4 per-channel weights
  u16-dq-s4b64          uint16 Q/DQ activations, int4 blocks of 64
  u8-dq-s8 / -s4 / -s4b64   uint8 Q/DQ activations, the same weights (bytes a weight on the HMX)
  mixed-s8              u16-dq-s8 between float ops (a gamma Mul before, a residual Add after)
                        in an fp16 graph: does the EP keep it one QNN graph, on the HMX?
  mixed-mul-s8          the same with a float Mul after it in place of the residual Add
  u16-lpbq-s4b64        uint16 Q/DQ activations, LPBQ: uint8 block scales x a float per-channel
                        scale feed the int4 weight's DequantizeLinear (AI Hub's w4a16), the
                        float weight's Q -> DQ (refused: onnxruntime duplicates the scale DQ)
  u16-lpbqw-s4bB        the same with the weight stored int4 (blocks of B: 32, 64, 128): the
                        form the QDQ pass writes (forge/quantize/qdq.py); u8-lpbqw-s4bB with
                        uint8 activations

Prints one line a form; --json writes them. Plumbing of speed, not accuracy: weights random;
``--check`` also runs each binary on the x86 simulator against the CPU (its relative error).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import numpy as np

OPSET = 21  # blocked DequantizeLinear and int4
# LPBQ's block codes: the HTP multiplies int4 x code as int8, so codes above 16 compile and run
# wrong (the simulator's output uncorrelated at 64, -1/255 of the graph's at 255): ``--codes``
LPBQ_CODES = 16


def _graph(nodes, inits, elem_in, k: int, n: int, name: str):
    import onnx
    from onnx import helper

    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", elem_in, [1, 1, k])],
                          [helper.make_tensor_value_info("y", elem_in, [1, 1, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET),
                                            helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


def _weights(k: int, n: int) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((k, n)) * 0.02).astype(np.float32)


def _int_weight(w: np.ndarray, bits: int, block: int | None):
    """(q int8 [K, N] in the signed range of ``bits``, scale: [1, N] per channel or
    [K / block, N] per block) with w ~= q x scale."""
    top = 2 ** (bits - 1) - 1
    k, n = w.shape
    if block is None:
        scale = np.abs(w).max(0, keepdims=True) / top
    else:
        scale = np.abs(w.reshape(k // block, block, n)).max(1) / top
    rep = scale if block is None else np.repeat(scale, block, 0)
    q = np.clip(np.round(w / rep), -top - 1, top).astype(np.int8)
    return q, scale.astype(np.float32)


def _act_qdq(prefix: str, x: str, lo: float, hi: float, bits: int = 16):
    """uint16 (uint8) Quantize/Dequantize of ``x`` over [lo, hi] -> (nodes, inits, output)."""
    from onnx import TensorProto, helper

    scale = (hi - lo) / (2**bits - 1)
    zp = round(-lo / scale)
    inits = [helper.make_tensor(f"{prefix}_s", TensorProto.FLOAT, [], [scale]),
             helper.make_tensor(f"{prefix}_z", TensorProto.UINT16 if bits == 16
                                else TensorProto.UINT8, [], [zp])]
    nodes = [helper.make_node("QuantizeLinear", [x, f"{prefix}_s", f"{prefix}_z"], [f"{prefix}_q"]),
             helper.make_node("DequantizeLinear", [f"{prefix}_q", f"{prefix}_s", f"{prefix}_z"],
                              [f"{prefix}_dq"])]
    return nodes, inits, f"{prefix}_dq"


def form(name: str, k: int, n: int):
    from onnx import TensorProto, helper, numpy_helper

    w = _weights(k, n)
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    if name == "fp16":
        return _graph([helper.make_node("MatMul", ["x", "w"], ["y"])],
                      [numpy_helper.from_array(w.astype(np.float16), "w")], f16, k, n, name)
    if name.startswith("nbits"):
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        m = _graph([helper.make_node("MatMul", ["x", "w"], ["y"])],
                   [numpy_helper.from_array(w.astype(np.float16), "w")], f16, k, n, name)
        q = MatMulNBitsQuantizer(m, block_size=32, is_symmetric=True, bits=int(name[5:]))
        q.process()
        return q.model.model
    bits = 8 if "s8" in name else 4
    m = re.search(r"b(\d+)$", name)
    block = int(m.group(1)) if m else None
    q, scale = _int_weight(w, bits, block)
    qtype = TensorProto.INT8 if bits == 8 else TensorProto.INT4
    nodes, inits = [], []
    dq = dict(axis=0, block_size=block) if block else dict(axis=1)
    if name.startswith("f16-dqpt"):  # the channel scale after the product: y = (x @ q) * s
        inits += [helper.make_tensor("wq", qtype, list(q.shape), q.flatten().tolist()),
                  numpy_helper.from_array(np.array(1.0, np.float16), "one"),
                  numpy_helper.from_array(scale.reshape(n).astype(np.float16), "ws")]
        nodes += [helper.make_node("DequantizeLinear", ["wq", "one"], ["w"]),
                  helper.make_node("MatMul", ["x", "w"], ["y0"]),
                  helper.make_node("Mul", ["y0", "ws"], ["y"])]
        return _graph(nodes, inits, f16, k, n, name)
    if name.startswith(("u16-lpbqw", "u8-lpbqw")):
        # LPBQ with the weight already int4 (the fusion's second form): the int4 initializer's
        # DequantizeLinear takes as its scale a DequantizeLinear of uint8 block codes x a float
        # per-channel scale -- one consumer of the scale, so onnxruntime's EnsureUniqueDQ
        # duplicates nothing (the Q -> DQ form below leaves a /duplicated scale DQ behind)
        ch = scale.max(0, keepdims=True) / LPBQ_CODES  # [1, N]
        codes = np.clip(np.round(scale / ch), 1, LPBQ_CODES).astype(np.uint8)  # [K / block, N]
        rep = np.repeat(codes * ch, block, 0)
        top = 2 ** (bits - 1) - 1
        q = np.clip(np.round(w / rep), -top - 1, top).astype(np.int8)
        inits += [helper.make_tensor("wq", qtype, list(q.shape), q.flatten().tolist()),
                  numpy_helper.from_array(codes, "bs_q"),
                  numpy_helper.from_array(ch.reshape(n), "bs_s"),
                  numpy_helper.from_array(np.zeros(n, np.uint8), "bs_z"),
                  helper.make_tensor("wz", qtype, list(codes.shape), [0] * codes.size)]
        nodes += [helper.make_node("DequantizeLinear", ["bs_q", "bs_s", "bs_z"], ["ws"], axis=1),
                  helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], **dq)]
    elif name.startswith("u16-lpbq"):
        # LPBQ as onnxruntime-qnn's fusion reads it (lpbqmatmul_fusion): the float weight's
        # int4 QuantizeLinear -> DequantizeLinear, both scaled by per-block scales that are
        # themselves a DequantizeLinear of uint8 codes x a float per-channel scale
        ch = scale.max(0, keepdims=True) / 255  # [1, N]
        codes = np.clip(np.round(scale / ch), 1, 255).astype(np.uint8)  # [K / block, N]
        inits += [numpy_helper.from_array(w, "wf"), numpy_helper.from_array(codes, "bs_q"),
                  numpy_helper.from_array(ch.reshape(n), "bs_s"),
                  numpy_helper.from_array(np.zeros(n, np.uint8), "bs_z"),
                  helper.make_tensor("wz", qtype, list(codes.shape), [0] * codes.size)]
        nodes += [helper.make_node("DequantizeLinear", ["bs_q", "bs_s", "bs_z"], ["ws"], axis=1),
                  helper.make_node("QuantizeLinear", ["wf", "ws", "wz"], ["wq"], **dq),
                  helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], **dq)]
    else:
        inits += [helper.make_tensor("wq", qtype, list(q.shape), q.flatten().tolist()),
                  numpy_helper.from_array(scale if block else scale.reshape(n), "ws")]
        nodes.append(helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], **dq))
    if name.startswith("f16"):
        # fp16 activations: the float weight made fp16 for the MatMul (a Cast the EP may fold)
        nodes.append(helper.make_node("Cast", ["w"], ["w16"], to=f16))
        nodes.append(helper.make_node("MatMul", ["x", "w16"], ["y"]))
        return _graph(nodes, inits, f16, k, n, name)
    if name.startswith("mixed"):
        # fp16 around an integer linear: a float Mul (a norm's gamma) -> u16 Q/DQ -> the int8
        # MatMul -> u16 Q/DQ -> a float Add (the residual), in one graph of fp32 I/O
        from onnx import helper as h

        inits += [numpy_helper.from_array(np.full(k, 1.5, np.float32), "gamma")]
        qx, ix, xin = _act_qdq("xa", "xn", -4.0, 4.0)
        qy, iy, _ = _act_qdq("ya", "y0", -2.0, 2.0)
        nodes = ([h.make_node("Mul", ["x", "gamma"], ["xn"])] + qx + nodes
                 + [h.make_node("MatMul", [xin, "w"], ["y0"])] + qy
                 + ([h.make_node("Slice", ["x", "s0", "s1", "s2"], ["xr"]),
                     h.make_node("Add", ["ya_dq", "xr"], ["y"])] if name == "mixed-s8"
                    else [h.make_node("Mul", ["ya_dq", "gamma_out"], ["y"])]))
        inits.append(numpy_helper.from_array(np.full(n, 0.5, np.float32), "gamma_out"))
        inits += [numpy_helper.from_array(np.array([0], np.int64), "s0"),
                  numpy_helper.from_array(np.array([n], np.int64), "s1"),
                  numpy_helper.from_array(np.array([2], np.int64), "s2")]
        return _graph(nodes, inits + ix + iy, f32, k, n, name)
    abits = 8 if name.startswith("u8") else 16
    qx, ix, xin = _act_qdq("xa", "x", -4.0, 4.0, abits)
    qy, iy, _ = _act_qdq("ya", "y0", -2.0, 2.0, abits)
    nodes = qx + nodes + [helper.make_node("MatMul", [xin, "w"], ["y0"])] + qy
    nodes.append(helper.make_node("Identity", ["ya_dq"], ["y"]))
    return _graph(nodes, inits + ix + iy, f32, k, n, name)


FORMS = ("fp16", "nbits8", "nbits4", "f16-dq-s8", "f16-dq-s4b64", "f16-dqpt-s8", "f16-dqpt-s4",
         "u16-dq-s8", "u16-dq-s4",
         "u16-dq-s4b64", "u16-lpbq-s4b64", "u16-lpbqw-s4b64", "u8-dq-s8", "u8-dq-s4", "u8-dq-s4b64",
         "mixed-s8", "mixed-mul-s8")


def measure(name: str, k: int, n: int, work: Path, check: bool = False) -> dict:
    import onnx

    from hexforge.bundle.errors import HexforgeError
    from hexforge.bundle.targets import get_target
    from hexforge.forge.compile.contexts import compile_graph
    from hexforge.forge.compile.hextimate import estimate_graph, op_breakdown, optrace

    v81 = get_target("v81")
    src = work / f"{name}.onnx"
    onnx.save(form(name, k, n), src)
    fp16 = not name.startswith("u")  # mixed: fp16 for its float ops
    row: dict = {"form": name}
    try:
        est = estimate_graph(src, v81.htp_arch, v81.estimator, fp16, "optrace", work / name)
        r = compile_graph(src, work / f"{name}.ctx.onnx", v81.htp_arch,
                          v81.socs[0].soc_model, fp16=fp16)
    except HexforgeError as e:
        return row | {"refused": str(e).splitlines()[0][:160]}
    ops = op_breakdown(optrace(work / name / "profile_qnn.log"))
    if check:  # the binary on the x86 simulator against the graph on the CPU
        import onnxruntime as ort

        from hexforge.runtime import qnn

        x = np.random.default_rng(1).standard_normal((1, 1, k)).astype(np.float32)
        feeds = {"x": x.astype(np.float16) if fp16 and not name.startswith("mixed") else x}
        so = qnn.session_options(qnn.provider_options(v81.htp_arch, v81.socs[0].soc_model,
                                                      fp16), {})
        with qnn.native_stdout_to_stderr():
            a = ort.InferenceSession(str(r["ctx"]), so).run(None, feeds)[0].astype(np.float32)
        b = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(
            None, feeds)[0].astype(np.float32)
        row["sim_rel_err"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    row |= {"us": round(est.us, 1), "missing_ops": est.missing_ops,
            "bytes_per_weight": round(r["bin_bytes"] / (k * n), 3),
            "hvx_cycles": sum(o["cycles"] for o in ops if o["unit"] == "HVX"),
            "hmx_cycles": sum(o["cycles"] for o in ops if o["unit"] == "HMX"),
            "top_ops": [f"{o['op']}@{o['unit']}:{o['cycles']}" for o in ops[:4]]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--check", action="store_true",
                    help="also run each binary on the x86 simulator against the CPU (a form "
                    "the simulator cannot run may end the process)")
    ap.add_argument("--codes", type=int, default=LPBQ_CODES, help="LPBQ's largest block code")
    a = ap.parse_args()
    globals()["LPBQ_CODES"] = a.codes
    work = a.work or Path(tempfile.mkdtemp(prefix="intw-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.forms.split(","):
        row = measure(name, a.k, a.n, work, a.check)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
