"""The target table: one row per build target, in one place.

Sources (keep them next to the numbers; the QNN EP accepts any soc_model id without validating it, so
a wrong id here would silently build for the wrong SoC):
  * v81 = SM8850, soc_model 87 — the seed bundles (the hand-made QNN bundles hexforge came after,
    docs/notes/realsize.md), device-validated; docs/htp.md.
  * v79 = SM8750 (69), v75 = SM8650 (57), v73 = SM8550 (43) and SC8380XP / Snapdragon X Elite (60):
    commonly cited QNN soc_model ids (docs/htp.md; not device-validated here).
  * per-context ceiling: v81 — 1.8 GB per context loads, 3.6 GB fails with 0x3ea (the seed
    bundles). Other arches use the same conservative 1.8 GB until measured on a device.
  * DDR GB/s: vendor peak LPDDR bandwidth (bus width x data rate), the roofline's denominator only.
  * the binary header names the SoC a soc_model id compiles for (and that SoC's arch: the id wins
    over htp_arch): 43 SM8550 v73, 57 SM8650 v75, 60 SC8380XP v73, 69 SM8750 v79, 87 SM8850 v81
    (QNN 2.51, ids 0-129 probed: docs/htp.md "Speed on the NPU: Hextimate").
  * estimator: the SoC of this arch for which QNN's on-host estimator (Hextimate) gives estimates;
    of ids 0-129 only 52 SA8255 (v73), 62 SA8540 / 63 AIC100 (v68), 72 SA8797 (v81), 77 QCS9100
    (v73) and 114 SA8787 (v85) do, none for v75 / v79 ("Performance Estimates unsupported on soc").
    Its ddr_gbps is the bandwidth the estimator implies, the estimator's own bound, not a vendor
    figure: fp16 MatMuls at M=1, 2048x2048 -> 4096x4096 read 25.2 MB more in 370 us more on SA8797
    (68 GB/s), 549 us more on QCS9100 (46 GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import HexforgeError

GB = 1_000_000_000


@dataclass(frozen=True)
class Soc:
    name: str
    soc_model: int
    ddr_gbps: float  # peak DRAM bandwidth, GB/s (vendor spec)
    source: str


@dataclass(frozen=True)
class Target:
    name: str  # "cpu" | "v73" | ...
    htp_arch: int | None  # None for the portable cpu target
    max_context_bytes: int  # per QNN context: its binary's byte ceiling (the planner's budget)
    socs: tuple[Soc, ...]
    source: str
    # the SoC Hextimate estimates this arch on (hexforge/forge/compile/hextimate.py)
    estimator: Soc | None = None

    @property
    def is_htp(self) -> bool:
        return self.htp_arch is not None

    @property
    def default_soc(self) -> Soc | None:
        return self.socs[0] if self.socs else None


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        # cpu: ORT handles external data of any size; 2 GB keeps each graph under the protobuf limit
        # even if someone embeds the weights.
        Target("cpu", None, 2 * GB, (), "ONNX protobuf 2 GB limit"),
        Target(
            "v73", 73, int(1.8 * GB),
            (Soc("SM8550", 43, 67.0, "Snapdragon 8 Gen 2, LPDDR5X-4200 x64"),
             Soc("SC8380XP", 60, 135.0, "Snapdragon X Elite, LPDDR5X-8448 x128")),
            "ids as the binary header names them; ceiling assumed = v81",
            Soc("QCS9100", 77, 46.0, "Hextimate's v73: its implied bandwidth, not a vendor figure"),
        ),
        Target("v75", 75, int(1.8 * GB),
               (Soc("SM8650", 57, 77.0, "Snapdragon 8 Gen 3, LPDDR5X-4800 x64"),),
               "id as the binary header names it; ceiling assumed = v81"),
        Target("v79", 79, int(1.8 * GB),
               (Soc("SM8750", 69, 85.0, "Snapdragon 8 Elite, LPDDR5X-5300 x64"),),
               "id as the binary header names it; ceiling assumed = v81"),
        Target("v81", 81, int(1.8 * GB),
               (Soc("SM8850", 87, 85.0, "Snapdragon 8 Elite Gen 5, LPDDR5X-5300 x64"),),
               "seed bundles: soc 87 device-validated; 1.8 GB/context loads, 3.6 GB fails 0x3ea",
               Soc("SA8797", 72, 68.0, "Hextimate's v81, another chip than SM8850: its implied "
                   "bandwidth, not a vendor figure")),
    )
}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise HexforgeError(f"unknown target {name!r}; choose from {', '.join(TARGETS)}") from None


def parse_targets(spec: str) -> list[Target]:
    """``"cpu,v81"`` -> targets, de-duplicated, in the given order; cpu is always built (reference)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise HexforgeError("--target is empty; e.g. --target cpu or --target v79,v81")
    out = [get_target(n) for n in dict.fromkeys(["cpu", *names])]
    return out
