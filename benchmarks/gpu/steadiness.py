"""Whether a measured run is evidence: judged from the device's own readings (`device_watch.Sample`) and
from the step times of the protocol's window (`protocol.py`), never from a single record.

A run is unsteady when
- the GPU ran at THROTTLE_C or hotter (its thermal slowdown range); or
- the window's pace drifted: the median step of its last third differs from that of its first third by
  more than DRIFT -- a slowdown with the SM clock fallen more than CLOCK_DROP below the window's highest
  reading is called a device change (a throttling GPU, a neighbour); any other drift is the run's own (a
  host-bound step warming up, say); or
- the window's step times spread: more than one step lies further than STEP_BAND from the window's median.
A clock that moves while the pace holds is not a device change: a GPU at its power limit (an H200 under a
compiled 1B step draws its 700 W and trades SM clock for power many times a second, 1290-1980 MHz in the
readings) runs its kernels at a steady rate, and the figures repeat from one command to the next (the
2026-12-04 H200 sets: within 0.6 % for every run whose pace held). Such a verdict is steady and names the
clock's range. A lone outlier step is named but does not make the run unsteady, and is never called a device
change (a garbage-collection pause, a late record). The verdict names the cause it saw.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from device_watch import Sample

CLOCK_DROP = 0.05
"""An SM clock this far below the window's highest reading: the device moved, if the pace moved with it."""
DRIFT = 0.05
"""The last third's median step this far from the first third's: the window's pace moved."""
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


def drift(step_times: list[float]) -> float | None:
    """How far the window's pace moved: median of its last third / median of its first third - 1 (None
    with fewer than 6 steps)."""
    third = len(step_times) // 3
    if third < 2:
        return None
    return statistics.median(step_times[-third:]) / statistics.median(step_times[:third]) - 1


def _clock(samples: list[Sample]) -> tuple[str, bool]:
    """The device's readings in words, and whether its SM clock fell more than CLOCK_DROP in them."""
    clocks = [s.sm_mhz for s in samples]
    top, low = max(clocks), min(clocks)
    power = [s.power_w for s in samples if s.power_w is not None]
    watts = f", up to {max(power):.0f} W" if power else ""
    text = (f"{len(samples)} readings: SM {low:.0f}-{top:.0f} MHz (of {samples[0].max_sm_mhz:.0f}){watts}, "
            f"{max(s.temp_c for s in samples):.0f} C at most")
    return text, low < (1 - CLOCK_DROP) * top


def judge(samples: list[Sample], step_times: list[float], sampled: bool = True) -> Verdict:
    """The verdict on one run: `samples` the device's readings during its window, `step_times` the
    window's step times (`sampled`: whether the device could be read at all)."""
    readings, fell = _clock(samples) if samples else ("", False)
    hot = max((s.temp_c for s in samples), default=0.0)
    if hot >= THROTTLE_C:
        return Verdict(False, f"device moved: the GPU reached {hot:.0f} C (slowdown from {THROTTLE_C:.0f} C; "
                              f"{readings})", device_moved=True)
    moved = drift(step_times)
    pace = "" if moved is None or abs(moved) <= DRIFT else \
        f"the window's pace {'slowed' if moved > 0 else 'quickened'} {abs(moved):.1%} from its first to its last third"
    if pace and fell and moved > 0:  # slower as the clock fell; a pace that quickened is the run's own
        return Verdict(False, f"device moved: {pace} as the SM clock fell ({readings})", device_moved=True)
    if not samples:
        device = "device not read" if not sampled else "no device reading in the window"
    elif fell:
        device = f"device clock moving, as at a power limit ({readings})"
    else:
        device = f"device steady ({readings})"
    if len(step_times) < 3:
        return Verdict(True, f"{device}; fewer than 3 step times in the window")
    median = statistics.median(step_times)
    off = [(i, t) for i, t in enumerate(step_times) if abs(t - median) > STEP_BAND * median]
    if len(off) > 1:
        return Verdict(False, f"the window's step times spread: {len(off)} of {len(step_times)} steps more than "
                              f"{STEP_BAND:.0%} from the median {median:.3f} s ({min(step_times):.3f}-"
                              f"{max(step_times):.3f} s); {device}")
    if pace:
        return Verdict(False, f"{pace}; {device}")
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
