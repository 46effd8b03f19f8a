"""What a build's ``--context`` asks of the model and of this machine, checked before any work.

- The model's positions: a context past ``max_position_embeddings`` (the positions it was trained
  on) is refused in one line.
- The machine's memory: a build's graphs take the caches at ``--context`` as inputs, and every
  export (and HTP compile) holds ~3x them beside its weights. At 1M tokens SmolLM2-135M's caches
  are 46 GB in fp32: such a build was killed by the OOM killer, without a word
  (docs/notes/measurements.md, "build memory"). The estimate is the one export a build cannot
  do without, the largest of its graphs::

      need(context) = PROCESS_BYTES + max over graphs of  5 B x weights + 3.5 x caches(context)
                                                          (memory.export_need_bytes, least)

  against what the machine has available (MemAvailable) when the build starts; exports side by
  side only run while memory holds them (forge/export/onnxexport.py). Refused, it names the largest context
  that fits. A lower bound for multimodal builds: the vision / audio towers' exports do not grow
  with the context and can take more (docs/notes/realsize.md); and the weights' part is the lower of
  the measured bounds (5 B a weight at real size, 9 on a 135M model), so what is refused does
  not fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..bundle.errors import BuildError
from ..bundle.targets import Target
from . import heap as memory
from .export.graphs import plan_target
from .options import BuildOptions, DefaultContext


def max_positions(config: dict) -> int | None:
    """The checkpoint's ``max_position_embeddings`` (its text config's where it nests one)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def fit_context(config: dict, opts: BuildOptions, log: Callable[[str], None]) -> BuildOptions:
    """The options with --context's default lowered to the positions the model was trained on
    where they are fewer, and a line in the log saying so: a user who gave no --context gets a
    bundle, not a refusal naming a flag they never typed. A --context the user gave is kept as
    given (check_positions refuses it past the positions)."""
    if not isinstance(opts.context, DefaultContext):
        return opts
    positions = max_positions(config)
    if positions is None or positions >= opts.context:  # a plain int from here on
        return dataclasses.replace(opts, context=int(opts.context))
    log(f"note: --context {positions:,}: this model's max_position_embeddings (the positions it "
        f"was trained on), below the default {opts.context:,}")
    fitted = dataclasses.replace(opts, context=positions)
    fitted.validate()  # the checks against the context (--verify-len), at the one it now has
    return fitted


def check_positions(config: dict, context: int) -> None:
    """Refuse a context past the positions the model was trained on."""
    positions = max_positions(config)
    if positions is not None and context > positions:
        raise BuildError(f"--context {context:,} is past this model's max_position_embeddings "
                         f"{positions:,} (the positions it was trained on): give --context "
                         f"{positions} or less")


def cache_bytes(fam, args, context: int, layers: tuple[int, int]) -> int:
    """The fp32 bytes of the state layers [a, b) take at ``context`` (what an export of their
    graph holds as example inputs; sliding windows stay their window's size)."""
    a, b = layers
    total = 0
    for spec in fam.state_spec(args, context):
        if a <= spec.layer < b and spec.shape:
            n = 4
            for d in spec.shape:
                n *= d
            total += n
    return total


Jobs = list[tuple[int, tuple[int, int]]]  # (weights, layers) of each graph an export makes


def graph_jobs(fam, hf, targets: list[Target], opts) -> Jobs:
    """Each target's largest graphs as (weights, layers): a shard's (the cpu target's last one
    with the head, which its decode graph runs) and, on HTP targets, the head alone."""
    per_layer = fam.layer_weight_bytes(hf, 1.0)
    head = fam.head_weight_bytes(hf, 1.0)
    jobs: Jobs = []
    for target in targets:
        if target.name == "cpu" and opts.device_only:
            continue
        shards = plan_target(fam, hf, target, opts, lambda m: None)
        for i, (a, b) in enumerate(shards):
            with_head = not target.is_htp and i == len(shards) - 1
            jobs.append((sum(per_layer[a:b]) + (head if with_head else 0), (a, b)))
        if target.is_htp:
            jobs.append((head, (0, 0)))
    return jobs


def memory_need(fam, args, jobs: Jobs, context: int) -> int:
    """The build's peak at ``context``: the process and its most demanding export."""
    return memory.PROCESS_BYTES + max(
        memory.export_need_bytes(weights, cache_bytes(fam, args, context, layers), least=True)
        for weights, layers in jobs)


def largest_context(fam, args, jobs: Jobs, available: int, upto: int) -> int:
    """The largest context <= ``upto`` whose need fits in ``available`` (0: none does)."""
    lo, hi = 0, upto  # need() grows with the context: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if memory_need(fam, args, jobs, mid) <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_memory(fam, hf, args, targets: list[Target], opts) -> str:
    """Refuse a build the machine has less memory available for than its peak, naming the largest
    context that would fit; -> the line saying both, for the build's log."""
    jobs = graph_jobs(fam, hf, targets, opts)
    need = memory_need(fam, args, jobs, opts.context)
    available = memory.available_bytes()
    caches = max(cache_bytes(fam, args, opts.context, layers) for _, layers in jobs)
    line = (f"memory: about {need / 1e9:.1f} GB at the build's peak (one graph's export; its "
            f"caches at --context {opts.context:,} are {caches / 1e9:.2f} GB in fp32)")
    if available is None:  # not Linux: nothing to check against
        return line
    if need > available:
        fits = largest_context(fam, args, jobs, available, opts.context)
        way = (f"the largest context that fits is about {fits:,}" if fits >= 2 else
               "no context fits: the model's weights alone need more")
        raise BuildError(f"--context {opts.context:,} needs about {need / 1e9:.1f} GB of memory "
                         f"at the build's peak and this machine has {available / 1e9:.1f} GB "
                         f"available: {way} (or free memory, or build on a larger machine)")
    return f"{line}; {available / 1e9:.1f} GB available"
