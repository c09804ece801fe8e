"""Whether a measured run is evidence: judged from the device's own readings (`device_watch.Sample`) and
from the step times of the protocol's window (`protocol.py`), never from a single record.

A run is unsteady when
- the device moved: its SM clock fell more than CLOCK_DROP below the highest reading of the window
  (a throttling or power-capped GPU, a neighbour), or it ran at THROTTLE_C or hotter; or
- the window's step times spread: more than one step lies further than STEP_BAND from the window's median.
A lone outlier step with the device steady is named but does not make the run unsteady, and is never
called a device change (a garbage-collection pause, a late record). The verdict names the cause it saw.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from device_watch import Sample

CLOCK_DROP = 0.05
"""An SM clock this far below the window's highest reading is the device slowing down."""
THROTTLE_C = 85.0
"""An H100/H200 at this temperature or above is in its thermal slowdown range."""
STEP_BAND = 0.10
"""A step further than this from the window's median step time is off the steady pace."""


@dataclass(frozen=True)
class Verdict:
    steady: bool
    cause: str
    """What was seen: the device's movement, the spread, a lone outlier, or that all held still."""
    device_moved: bool = False


def device_verdict(samples: list[Sample]) -> Verdict | None:
    """The device's readings alone: a Verdict when they moved, None when they held (or none were taken)."""
    if not samples:
        return None
    clocks = [s.sm_mhz for s in samples]
    top, low = max(clocks), min(clocks)
    hot = max(s.temp_c for s in samples)
    at_low = min(samples, key=lambda s: s.sm_mhz)
    power = "" if at_low.power_w is None else f", {at_low.power_w:.0f} W"
    causes = []
    if low < (1 - CLOCK_DROP) * top:
        causes.append(f"the SM clock fell from {top:.0f} to {low:.0f} MHz (of {at_low.max_sm_mhz:.0f}) at "
                      f"{at_low.temp_c:.0f} C{power}")
    if hot >= THROTTLE_C:
        causes.append(f"the GPU reached {hot:.0f} C (slowdown from {THROTTLE_C:.0f} C)")
    if not causes:
        return None
    return Verdict(False, "device moved: " + "; ".join(causes), device_moved=True)


def judge(samples: list[Sample], step_times: list[float], sampled: bool = True) -> Verdict:
    """The verdict on one run: `samples` the device's readings during its window, `step_times` the
    window's step times (`sampled`: whether the device could be read at all)."""
    moved = device_verdict(samples)
    if moved is not None:
        return moved
    device = (f"device steady ({len(samples)} readings: SM {min(s.sm_mhz for s in samples):.0f}-"
              f"{max(s.sm_mhz for s in samples):.0f} MHz, {max(s.temp_c for s in samples):.0f} C at most)"
              if samples else "device not read" if not sampled else "no device reading in the window")
    if len(step_times) < 3:
        return Verdict(True, f"{device}; fewer than 3 step times in the window")
    median = statistics.median(step_times)
    off = [(i, t) for i, t in enumerate(step_times) if abs(t - median) > STEP_BAND * median]
    if len(off) > 1:
        return Verdict(False, f"the window's step times spread: {len(off)} of {len(step_times)} steps more than "
                              f"{STEP_BAND:.0%} from the median {median:.3f} s ({min(step_times):.3f}-"
                              f"{max(step_times):.3f} s); {device}")
    if off:
        i, t = off[0]
        return Verdict(True, f"one outlier step (window step {i + 1}: {t:.3f} s against the median {median:.3f} s) "
                             f"with the {device}: not a device change")
    return Verdict(True, f"{device}; steps within {STEP_BAND:.0%} of the median {median:.3f} s")


def notes(verdicts: dict[str, Verdict]) -> list[str]:
    """A note for each run whose verdict is unsteady (`UNSTEADY name: cause`) or names an outlier."""
    out = []
    for name, v in verdicts.items():
        if not v.steady:
            out.append(f"UNSTEADY {name}: {v.cause}; its figures and the ratios taken with it are not evidence")
        elif "outlier" in v.cause:
            out.append(f"steady {name}: {v.cause}")
    return out


def ratio(numerator: float | None, denominator: float | None, verdicts: list[Verdict]) -> str | None:
    """numerator / denominator for a table, marked "(unsteady)" when a run it was taken from is."""
    if not (numerator and denominator):
        return None
    return f"{numerator / denominator:.2f}" + (" (unsteady)" if any(not v.steady for v in verdicts) else "")
