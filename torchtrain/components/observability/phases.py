"""Per-step phase breakdown: where a step's wall time goes (`profiling.enable_phase_timing`).

The trainer marks phase boundaries: `enter(name)` starts a phase (ending the current one) and
`pause()` ends the current phase. Time spent outside any phase (metrics logging, garbage
collection, the loop itself) is the remainder. Over a logging interval of k steps and wall time T:

    phase_<name>_s = (time in <name> during the interval) / k          for each phase in PHASES
    phase_other_s  = T / k - sum of the above                          (>= 0 up to timer resolution)

so the phases and the remainder add up to `step_time_s` (= T / k) exactly, and a small remainder
says the named phases explain the step. The interval is the one of `ThroughputMeter` (both are
reset together, and the remainder is taken against the step time it reports).

CUDA work is asynchronous: without synchronisation a phase would measure how long it took to
*queue* kernels. So on CUDA every boundary synchronizes the device, which costs the overlap of CPU
launch work with GPU execution across boundaries; phase timing is therefore opt-in. With the
profiler on, each phase is also a `record_function` range, so traces show the same phases.

A `listener` (the [fault] runtime: heartbeats, compute clocks) hears every boundary, `enter(name)`
and `pause()` (as None), whether or not timing is enabled.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

PHASES = ("data", "forward_backward", "optimizer", "validation", "eval", "checkpoint", "profiler")


class PhaseTimer:
    def __init__(self, enabled: bool, device: torch.device, annotate: bool = False,
                 listener: Callable[[str | None], None] | None = None):
        self.enabled = enabled
        self.listener = listener
        self.annotate = annotate  # record_function ranges for the profiler's trace
        self._sync = enabled and device.type == "cuda"
        self._device = device
        self._current: str | None = None
        self._t0 = 0.0
        self._range: contextlib.AbstractContextManager | None = None
        self.reset()

    def reset(self) -> None:
        self.totals = {name: 0.0 for name in PHASES}
        self.steps = 0

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def enter(self, name: str) -> None:
        """Start phase `name`, ending the current one."""
        if self.listener is not None:
            self.listener(name)
        if not (self.enabled or self.annotate):
            return
        self._end()
        if name not in self.totals:
            raise KeyError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        self._current, self._t0 = name, self._now() if self.enabled else 0.0
        if self.annotate and name != "profiler":  # trace writing straddles the profiler's step ranges
            self._range = torch.profiler.record_function(f"phase:{name}")
            self._range.__enter__()

    def pause(self) -> None:
        """End the current phase (if any); time until the next `enter` is the remainder."""
        if self.listener is not None:
            self.listener(None)
        self._end()

    def _end(self) -> None:
        if self._current is None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.enabled:
            self.totals[self._current] += self._now() - self._t0
        self._current = None

    def end_step(self) -> None:
        self.steps += 1

    def summary(self, step_time: float) -> dict[str, float]:
        """Per-step means over the interval since the last summary; {} when disabled. `step_time`:
        the interval's wall time per step as ThroughputMeter measured it (the one logged as
        step_time_s), so that the remainder is taken against that very number."""
        if not self.enabled:
            return {}
        steps = max(self.steps, 1)
        out = {f"phase_{name}_s": total / steps for name, total in self.totals.items()}
        out["phase_other_s"] = step_time - sum(out.values())
        self.reset()
        return out
