"""Straggler detection: which rank is slow in its *own* work, not in waiting for the others.

In synchronous training every rank's step takes as long as the slowest one's: the fast ranks spend
the difference waiting inside collectives. So wall time cannot name a straggler; each rank's own
compute time per phase (data, forward_backward, optimizer) can:

* on CPU: the training thread's CPU time (`time.thread_time`). A rank blocked in a gloo collective
  sleeps on a condition variable and accrues none, so the measure is compute (and Python overhead)
  only. Two clock reads per phase boundary; every step of the window is measured.
* on CUDA: the GPU time of the compute kernels each phase launched, from one profiled step per
  window (torch.profiler, CUDA activity): every kernel is attributed to the phase during which its
  launching operator started (backward operators run on the autograd thread, within the
  forward_backward phase of the training thread), and communication kernels (NCCL) are left out,
  because a fast rank's all-gather kernel runs as long as it waits for the slow one. Skipped while
  the user's own profiler ([profiling]) is on (only one profiler can run).

Every `straggler_freq` steps each rank posts its totals of the window; rank 0's monitor thread
compares them (`compare`): a rank whose compute time per step exceeds the median rank's by more than
`straggler_threshold` is a straggler, named with its host, how much slower it is, and the phase
that accounts for most of the excess.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

COMPUTE_PHASES = ("data", "forward_backward", "optimizer")
PHASE_RANGE = "torchtrain.phase."  # record_function name prefix of a phase in a profiled step


@dataclass
class Straggler:
    rank: int
    host: str
    seconds: float
    """Compute seconds per step of this rank."""
    median: float
    """Median compute seconds per step over all ranks."""
    phase: str
    """The phase with the largest excess over the median rank's time in it."""
    excess: float
    """Seconds per step this rank spends in `phase` beyond the median."""

    @property
    def slowdown(self) -> float:
        return self.seconds / self.median if self.median > 0 else float("inf")

    def describe(self) -> str:
        return (f"rank {self.rank} (host {self.host}) computes {self.seconds:.4g} s per step vs a median of "
                f"{self.median:.4g} s ({self.slowdown:.2f}x, {100 * (self.slowdown - 1):+.0f}%), mostly in "
                f"{self.phase} (+{self.excess:.4g} s per step)")


def compare(windows: dict[int, dict], threshold: float) -> tuple[list[Straggler], dict[str, float]]:
    """Stragglers (slowest first) among the ranks' window reports {rank: {"phases": {name: seconds},
    "steps": n, "host": h}}, and summary numbers (median and max compute seconds per step)."""
    per_step = {r: {p: w["phases"].get(p, 0.0) / max(w["steps"], 1) for p in COMPUTE_PHASES}
                for r, w in windows.items()}
    totals = {r: sum(v.values()) for r, v in per_step.items()}
    median = statistics.median(totals.values())
    phase_median = {p: statistics.median(v[p] for v in per_step.values()) for p in COMPUTE_PHASES}
    found = []
    for rank, total in totals.items():
        if median > 0 and total > median * (1 + threshold):
            phase = max(COMPUTE_PHASES, key=lambda p: per_step[rank][p] - phase_median[p])
            found.append(Straggler(rank, windows[rank].get("host", "?"), total, median, phase,
                                   per_step[rank][phase] - phase_median[phase]))
    found.sort(key=lambda s: -s.seconds)
    return found, {"compute_s_median": median, "compute_s_max": max(totals.values())}


def kernel_seconds_by_phase(events) -> dict[str, float]:
    """GPU seconds of the compute kernels launched in each phase of a profiled step (`events`: the
    profiler's FunctionEvents). Phases are the `PHASE_RANGE` ranges of the training thread; an
    operator's kernels count for the phase its CPU start time falls in; NCCL kernels are not compute."""
    ranges = sorted((e.time_range.start, e.time_range.end, e.name[len(PHASE_RANGE):])
                    for e in events if e.name.startswith(PHASE_RANGE))
    totals = {p: 0.0 for p in COMPUTE_PHASES}
    for e in events:
        kernels = getattr(e, "kernels", None)
        if not kernels:
            continue
        start = e.time_range.start
        phase = next((name for lo, hi, name in ranges if lo <= start < hi), None)
        if phase in totals:
            totals[phase] += sum(k.duration for k in kernels if "nccl" not in k.name.lower()) / 1e6
    return totals


class ThreadClock:
    """CPU: the training thread's CPU time per compute phase, every step."""

    failed: str | None = None
    """(As `KernelClock.failed`; a thread clock does not fail.)"""

    def __init__(self):
        self.totals = {p: 0.0 for p in COMPUTE_PHASES}
        self._phase: str | None = None
        self._t = 0.0

    def switch(self, phase: str | None) -> None:
        now = time.thread_time()
        if self._phase in self.totals:
            self.totals[self._phase] += now - self._t
        self._phase, self._t = phase, now

    def step_begins(self, sampled: bool) -> None:
        """A step starts (every step is measured on CPU)."""

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {p: 0.0 for p in COMPUTE_PHASES}
        return out


class KernelClock:
    """CUDA: compute-kernel time per phase of one profiled step per window (the module docstring)."""

    def __init__(self, device):
        self.device = device
        self.totals = {p: 0.0 for p in COMPUTE_PHASES}
        self._prof = None
        self._range = None
        self.failed: str | None = None

    def step_begins(self, sampled: bool) -> None:
        self._finish()
        if not sampled or self.failed:
            return
        import torch

        try:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
        except Exception as e:  # e.g. another profiler is active
            self._prof, self.failed = None, f"{type(e).__name__}: {e}"

    def switch(self, phase: str | None) -> None:
        if self._prof is None:
            return
        import torch

        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if phase in self.totals:
            self._range = torch.profiler.record_function(PHASE_RANGE + phase)
            self._range.__enter__()
        elif phase in ("validation", "checkpoint"):  # the profiled step's compute is over
            self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        import torch

        try:
            torch.cuda.synchronize(self.device)
            prof.__exit__(None, None, None)
            for phase, seconds in kernel_seconds_by_phase(prof.events()).items():
                self.totals[phase] += seconds
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"

    def take(self) -> dict[str, float]:
        self._finish()
        out, self.totals = self.totals, {p: 0.0 for p in COMPUTE_PHASES}
        return out
