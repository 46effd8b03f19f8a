"""What every stage of one build reads, in one object: the family module, the HF model, the
family's Args, the options, the build's temp root and the log.

    pipeline._Build ──stage()──▶ StageContext ──▶ compile/stage.build_htp_targets
                                               ├─▶ export/graphs.export_float
                                               ├─▶ genie/decoder.build_genie_bundles
                                               └─▶ genie/towers.export_nodes

Made afresh for each stage call, not kept: the oracle drops the HF model (``_Build.hf = None``)
before the graphs load, and no stage may hold it past its own call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Log = Callable[[str], None]


@dataclass(frozen=True)
class StageContext:
    fam: Any  # the family module (families/<model_type>.py)
    hf: Any  # the HF model: the weights the graphs hold (None once the oracle freed it)
    args: Any  # the family's Args (its HF config fields)
    opts: Any  # forge/options.BuildOptions; not imported: the stages stand below the options
    root: Path  # the build's locked temp dir: every file a stage writes is under it
    log: Log
