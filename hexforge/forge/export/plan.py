"""The shard planner: cut the decoder into contiguous layer ranges under a per-graph byte ceiling.

    layers:  [0 1 2 3 | 4 5 6 | 7 8 9]      each shard's weight bytes <= max_bytes
              shard 0   shard 1  shard 2    chained at run time through the hidden state

The fewest shards a contiguous split allows, then the layers spread evenly over them: greedy
packing alone fills every shard but the last to the ceiling ([0,14) [14,28) [28,32) for
Qwen3.5-4B on v81), and a shard's compile peaks at ~9x its binary (docs/notes/realsize.md), so the
biggest shard sets the build's memory. Balanced, the same three contexts are ~11 layers each.
"""

from __future__ import annotations

from ...bundle.errors import BuildError
from ...bundle.manifest import RunPlan


def _greedy(layer_bytes: list[int], cap: int) -> list[tuple[int, int]]:
    shards: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, b in enumerate(layer_bytes):
        if acc + b > cap and i > start:
            shards.append((start, i))
            start, acc = i, 0
        acc += b
    shards.append((start, len(layer_bytes)))
    return shards


def plan_shards(layer_bytes: list[int], max_bytes: int) -> list[tuple[int, int]]:
    """Fewest contiguous shards under max_bytes, the largest as small as that count allows.
    -> [(start, end)]."""
    if max_bytes <= 0:
        raise BuildError(f"--max-shard-bytes must be positive, got {max_bytes}")
    for i, b in enumerate(layer_bytes):
        if b > max_bytes:
            raise BuildError(
                f"layer {i} alone holds {b:,} weight bytes > the per-graph ceiling {max_bytes:,}; "
                "raise --max-shard-bytes or use a smaller quantization")
    count = len(_greedy(layer_bytes, max_bytes))
    # the smallest cap that still packs into `count` shards (greedy's count only falls as the
    # cap grows, so a bisection finds it)
    lo, hi = max(layer_bytes, default=0), max_bytes
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy(layer_bytes, mid)) <= count:
            hi = mid
        else:
            lo = mid + 1
    return _greedy(layer_bytes, hi)


def weight_groups(plan: RunPlan, cpu: bool) -> list[list[str]]:
    """The graphs that share one weight file: each shard's prefill + decode (+ verify), and the
    head — on its own for HTP targets (with its verify rows), with the last shard on cpu (whose
    decode graph runs it)."""
    groups = [s.names() for s in plan.shards]
    if cpu:
        groups[-1].append(plan.head)
    else:
        groups.append([plan.head] + ([plan.verify_head] if plan.verify_head else []))
    return groups


def weights_file(group: list[str]) -> str:
    """s3.prefill -> s3.weights, head -> head.weights."""
    return group[0].split(".")[0] + ".weights"
