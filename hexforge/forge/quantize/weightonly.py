"""The weight-only recipe kind (``WeightOnlyRecipe``: w8-fp16, w4-fp16) and its graphs: each float
graph's weight MatMuls as MatMulNBits, beside it as ``X.wo.onnx`` (fp16 activations, no
calibration), the target's and Genie's alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ...bundle.manifest import RunPlan
from ..progress import stage
from .recipe import QuantRecipe, ShardJob

WEIGHT_ONLY_SUFFIX = ".wo.onnx"


@dataclass(frozen=True)
class WeightOnlyRecipe(QuantRecipe):
    """int8 / int4 weights through MatMulNBits with fp16 activations (no calibration)."""

    compiled_suffix: ClassVar[str] = WEIGHT_ONLY_SUFFIX
    quantized: ClassVar[bool] = True
    emulated_on_simulator: ClassVar[bool] = True

    def prepare(self, job: ShardJob) -> None:
        import time

        t = time.perf_counter()
        weight_only(job.plan, job.srcs, self, job.ctx.args.vocab_size)
        job.ctx.log(f"[{job.target.name}] weights {self.name}: MatMulNBits int{self.weight_bits}, "
                f"blocks of {self.block_size}, fp16 activations ({time.perf_counter() - t:.1f}s)")

    def head_bytes_per_weight(self) -> float:
        """The head's bytes a weight as the weight-only graphs write it: under int4 the head is
        int8 in blocks (``nbits.cpu_head_format``), a byte and its block's fp16 scale."""
        from .nbits import cpu_head_format

        bits, block = cpu_head_format(self.weight_bits, self.block_size)
        return bits / 8 + 2 / block

    def genie_graphs(self, paths: list[Path], vocab_size: int, split: int, splits: int
                     ) -> list[Path]:
        return weight_only_split(paths, self, vocab_size, split, splits)


def weight_only(plan: RunPlan, folder: Path, recipe: QuantRecipe, vocab_size: int) -> None:
    """Every float graph ``X.onnx`` in ``folder`` -> ``X.wo.onnx``: each weight MatMul as
    MatMulNBits (int8 / int4 blocks, the head int8 under int4: ``nbits.cpu_head_format``),
    each weight group's into one ``<group>.wo.weights`` file (the caller drops the float graphs
    unless --keep-work keeps them for the probe). The QNN EP runs MatMulNBits on the HTP with
    fp16 activations; its activation input must be rank 3, as every projection's [1, T, K] is."""
    import onnx

    from ..export.onnxexport import share_weights
    from ..export.plan import weight_groups, weights_file
    from .nbits import quantize_cpu_graph

    groups = weight_groups(plan, cpu=False)
    with stage(f"quantize {recipe.name} weights", sum(map(len, groups))) as advance:
        for group in groups:
            for name in group:
                dst = folder / f"{name}{WEIGHT_ONLY_SUFFIX}"
                onnx.save(onnx.load(str(folder / f"{name}.onnx"), load_external_data=False),
                          str(dst))
                quantize_cpu_graph(dst, recipe.weight_bits, recipe.block_size, vocab_size,
                                   whole_blocks=True)
                advance()
            share_weights([folder / f"{n}{WEIGHT_ONLY_SUFFIX}" for n in group],
                          weights_file(group).replace(".weights", ".wo.weights"), None)


def weight_only_split(paths: list[Path], recipe: QuantRecipe, vocab_size: int, split: int,
                      splits: int) -> list[Path]:
    """A Genie split's graphs with MatMulNBits weights, as ``weight_only`` makes the target's
    (the embedding gather stays fp16: the HTP has no NBits gather), their weights one file."""
    import onnx

    from ..export.onnxexport import share_weights
    from .nbits import quantize_cpu_graph

    out = []
    for p in paths:
        dst = p.with_name(p.stem + WEIGHT_ONLY_SUFFIX)
        onnx.save(onnx.load(str(p), load_external_data=False), str(dst))
        quantize_cpu_graph(dst, recipe.weight_bits, recipe.block_size, vocab_size,
                           whole_blocks=True)
        out.append(dst)
    share_weights(out, f"genie_{split + 1}_of_{splits}.wo.weights")
    return out
