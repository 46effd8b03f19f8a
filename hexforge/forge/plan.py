"""The shard planner: cut the decoder into contiguous layer ranges under a per-graph byte ceiling.

    layers:  [0 1 2 3 | 4 5 6 7 | 8 9]      each shard's weight bytes <= max_bytes
              shard 0   shard 1   shard 2   chained at run time through the hidden state
"""

from __future__ import annotations

from ..errors import BuildError


def plan_shards(layer_bytes: list[int], max_bytes: int) -> list[tuple[int, int]]:
    """Greedy contiguous packing; fewest shards for a contiguous split. -> [(start, end)]."""
    if max_bytes <= 0:
        raise BuildError(f"--max-shard-bytes must be positive, got {max_bytes}")
    shards: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, b in enumerate(layer_bytes):
        if b > max_bytes:
            raise BuildError(
                f"layer {i} alone holds {b:,} weight bytes > the per-graph ceiling {max_bytes:,}; "
                "raise --max-shard-bytes or use a smaller quantization")
        if acc + b > max_bytes and i > start:
            shards.append((start, i))
            start, acc = i, 0
        acc += b
    shards.append((start, len(layer_bytes)))
    return shards
