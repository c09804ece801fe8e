"""The GPU kit's time budget (`run_all.py --budget-s SECONDS`).

Before each run starts, its duration is estimated -- start-up and compilation overhead plus steps x
step time, from the tables below, refined with what the runs already made in this command measured
-- and a run that would not finish in the time left is skipped, named, with the reason. At the
deadline (SIGALRM) or on SIGTERM nothing else starts, and a run in flight (a trainer run, or a
subprocess being waited for: the `interruptible` regions) gets `Stop` raised in the main thread: it is
recorded as stopped, and the summary of what finished is still written. Elsewhere (the kit's own
bookkeeping, a trainer's clean-up) a stop only keeps the next runs from starting.
Without a budget the deadline is infinite: every run starts, and its estimate and duration are
still recorded (the summary lists both, which is how the tables below are checked).
"""

from __future__ import annotations

import contextlib
import math
import signal
import statistics
import time
from dataclasses import dataclass, field

# Seconds from a run's start to the end of its first step (process start for torchtitan, model build and
# initialisation, optimizer, CUDA/cuBLAS set-up, compilation), on an H100 or H200. The 1B figures assume
# one compiled graph shared by the 16 blocks (fwd + bwd, ~40-60 s of Inductor on 16 cores); float8 adds
# the casts and scaled matmuls to that graph. "tiny" is a dry run's CPU model (dim 64, 2 layers).
OVERHEAD_S = {
    ("torchtrain", "tiny", "eager"): 1.5, ("torchtrain", "tiny", "float8"): 2.0,
    ("torchtrain", "debug", "eager"): 5.0, ("torchtrain", "debug", "float8"): 6.0,
    ("torchtrain", "debug", "offload"): 6.0, ("torchtrain", "debug", "compile"): 30.0,
    ("torchtrain", "1B", "eager"): 12.0, ("torchtrain", "1B", "float8"): 15.0,
    ("torchtrain", "1B", "offload"): 20.0, ("torchtrain", "1B", "compile"): 60.0,
    ("torchtrain", "1B", "compile+float8"): 75.0,
    ("torchtitan", "1B", "eager"): 30.0, ("torchtitan", "1B", "compile"): 65.0,
}
UNKNOWN_OVERHEAD_S = 60.0

# Steady step seconds at each model's reference tokens per step (REF_TOKENS). The 1B: 8.22 GFLOP a token
# (6 x 1.24B non-embedding parameters + attention) x 4,096 tokens = 33.7 TFLOP a step; at ~30% of an
# H100's ~800 TFLOP/s measured bf16 peak (eager) that is ~0.14 s, ~40% compiled ~0.11 s, float8
# compiled ~0.09 s. CPU offload runs Adam over 1.5B fp32 parameters on the host and moves 6 GB of
# gradients and parameters a step: ~2.5 s. The debug model is launch-bound: ~30 ms a step.
STEP_S = {
    ("tiny", "eager"): 0.05, ("tiny", "float8"): 0.1,
    ("debug", "eager"): 0.03, ("debug", "float8"): 0.05, ("debug", "offload"): 0.1, ("debug", "compile"): 0.02,
    ("1B", "eager"): 0.15, ("1B", "float8"): 0.17, ("1B", "offload"): 2.5, ("1B", "compile"): 0.11,
    ("1B", "compile+float8"): 0.09,
}
REF_TOKENS = {"tiny": 128, "debug": 2048, "1B": 4096}
UNKNOWN_STEP_S = 0.5
SAFETY = 1.1
"""An estimate is multiplied by this before it is compared with the time left."""


class Stop(Exception):
    """Raised once, in the main thread, at the budget's deadline or on SIGTERM."""


@dataclass(frozen=True)
class RunSpec:
    engine: str
    """torchtrain | torchtitan"""
    model: str
    """tiny | debug | 1B"""
    mode: str
    """eager | compile | compile+float8 | float8 | offload"""
    steps: int
    tokens: int
    """tokens per step"""


def spec_of(argv: list[str], dry: bool, engine: str = "torchtrain") -> RunSpec:
    """The estimate's inputs, read from a trainer command line (`--section.key value` pairs)."""
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    flavor = flags.get("--model.flavor", "")
    model = "tiny" if dry else "debug" if flavor == "debugmodel" else flavor or "1B"
    compiled = flags.get("--compile.enable") == "true"
    float8 = "float8" in flags.get("--model.converters", "")
    offload = flags.get("--training.enable_cpu_offload") == "true"
    mode = ("compile+float8" if compiled and float8 else "compile" if compiled else "float8" if float8
            else "offload" if offload else "eager")
    tokens = int(flags.get("--training.seq_len", 2048)) * int(flags.get("--training.local_batch_size", 1))
    return RunSpec(engine, model, mode, int(flags.get("--training.steps", 10)), tokens)


@dataclass
class Entry:
    part: str
    name: str
    estimate_s: float
    seconds: float | None = None
    """None: skipped (then `reason` says why)"""
    reason: str = ""


@dataclass
class Budget:
    seconds: float = math.inf
    """The whole command's budget; inf: no limit."""
    clock: object = time.monotonic
    start: float = field(default=0.0)
    stopped: str = ""
    """Why nothing more starts (deadline, SIGTERM); empty while running."""
    entries: list[Entry] = field(default_factory=list)
    _steps: dict = field(default_factory=dict)
    _overheads: dict = field(default_factory=dict)
    _drift: list = field(default_factory=list)
    """(key, measured overhead) of the finished runs but the process's first (which also pays one-time
    imports): how far the machine is from the table, applied to the same model's modes not measured yet
    (compiled modes from compiled runs, the others from the others)."""
    _trained: int = 0
    _interruptible: bool = False

    def __post_init__(self):
        self.start = self.clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    # ------------------------------------------------------------------ estimates
    def step_s(self, spec: RunSpec) -> float:
        measured = self._steps.get((spec.model, spec.mode))
        if measured is None:
            table = STEP_S.get((spec.model, spec.mode), UNKNOWN_STEP_S)
            ratios = [m / STEP_S[k] for k, m in self._steps.items() if k in STEP_S and k[0] == spec.model]
            measured = table * min(max(statistics.median(ratios), 0.5), 3.0) if ratios else table
        return measured * spec.tokens / REF_TOKENS.get(spec.model, spec.tokens or 1)

    def overhead_s(self, spec: RunSpec) -> float:
        key = (spec.engine, spec.model, spec.mode)
        if key in self._overheads:
            return self._overheads[key]
        table = OVERHEAD_S.get(key, UNKNOWN_OVERHEAD_S)
        group = (spec.model, "compile" in spec.mode)  # compiling is slow or fast apart from the rest
        pairs = [(m, OVERHEAD_S[k]) for k, m in self._drift if k in OVERHEAD_S and (k[1], "compile" in k[2]) == group]
        drift = sum(m for m, _ in pairs) / sum(t for _, t in pairs) if pairs else 1.0
        return table * min(max(drift, 0.5), 2.0)

    def estimate(self, spec: RunSpec) -> float:
        return self.overhead_s(spec) + spec.steps * self.step_s(spec)

    # ------------------------------------------------------------------ admission and records
    def admit(self, part: str, name: str, estimate_s: float) -> Entry | None:
        """The entry to finish with `done` when the run may start; None (and the skip recorded) when not."""
        left, reason = self.left(), ""
        if self.stopped:
            reason = f"not started: {self.stopped}"
        elif estimate_s * SAFETY > left:
            reason = f"needs ~{estimate_s:.0f} s (estimated), {max(left, 0):.0f} s of the budget left"
        entry = Entry(part, name, round(estimate_s, 1))
        if reason:
            entry.reason = reason
            self.entries.append(entry)
            return None
        return entry

    def done(self, entry: Entry, seconds: float, spec: RunSpec | None = None, step_s: float | None = None,
             stopped: str = "") -> None:
        """Record a run that ended (`stopped`: it was cut off, and counts as skipped); a finished run's
        step time and overhead refine the next estimates."""
        entry.seconds, entry.reason = (None, f"stopped after {seconds:.0f} s: {stopped}") if stopped \
            else (round(seconds, 1), "")
        self.entries.append(entry)
        if stopped or spec is None:
            return
        if step_s:
            self._steps[(spec.model, spec.mode)] = step_s * REF_TOKENS.get(spec.model, spec.tokens) / spec.tokens
        step = step_s or self.step_s(spec)
        key = (spec.engine, spec.model, spec.mode)
        self._overheads[key] = max(seconds - spec.steps * step, 0.0)
        if spec.engine == "torchtrain":
            self._trained += 1
        if self._trained > 1 or spec.engine != "torchtrain":
            self._drift.append((key, self._overheads[key]))

    def of_part(self, part: str) -> tuple[list[list], list[str]]:
        """(finished runs as [name, estimated s, took s], skipped runs as 'name: reason') of one part."""
        mine = [e for e in self.entries if e.part == part]
        return ([[e.name, e.estimate_s, e.seconds] for e in mine if e.seconds is not None],
                [f"{e.name}: {e.reason}" for e in mine if e.seconds is None])

    # ------------------------------------------------------------------ deadline and SIGTERM
    def arm(self) -> None:
        """SIGTERM, and SIGALRM at the deadline, stop the budget (and raise Stop inside `interruptible`).
        A budget already spent sets no alarm: every run is then skipped, one by one, for want of time."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGALRM, self._on_signal)
        if self.seconds != math.inf and self.left() > 0:
            signal.setitimer(signal.ITIMER_REAL, self.left())

    def disarm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self._interruptible = False

    @contextlib.contextmanager
    def interruptible(self):
        """A run's work: inside, a stop raises Stop at once (also on entering, if already stopped)."""
        if self.stopped:
            raise Stop(self.stopped)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _on_signal(self, signum, frame) -> None:
        if self.stopped:
            return
        self.stopped = "SIGTERM" if signum == signal.SIGTERM else f"the budget's {self.seconds:.0f} s ran out"
        if self._interruptible:
            self._interruptible = False
            raise Stop(self.stopped)
