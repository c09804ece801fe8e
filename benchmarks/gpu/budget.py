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

# Seconds from a run's start to the end of its first step, as measured on the kit's H100 machine (16 cores,
# torch 2.11, 2026-11-27: each run's duration less its steps): building and initialising the model, the
# optimizer, CUDA/cuBLAS set-up and, compiled, Inductor (one graph shared by the blocks: ~11 s for the 1B,
# the loss and the final norm included); torchtitan's also count torchrun, its imports and `datasets`. The
# 3B's are the 1B's plus its larger initialisation (estimated). A process's first trainer run also pays
# the one-time imports (FIRST_RUN_S). "tiny" is a dry run's CPU model (dim 64, 2 layers).
OVERHEAD_S = {
    ("torchtrain", "tiny", "eager"): 1.5, ("torchtrain", "tiny", "float8"): 2.0,
    ("torchtrain", "tiny", "profile"): 2.5,
    ("torchtrain", "debug", "eager"): 1.0, ("torchtrain", "debug", "float8"): 1.5,
    ("torchtrain", "debug", "offload"): 1.5, ("torchtrain", "debug", "compile"): 11.0,
    ("torchtrain", "1B", "eager"): 1.5, ("torchtrain", "1B", "float8"): 2.0, ("torchtrain", "1B", "profile"): 4.5,
    ("torchtrain", "1B", "offload"): 21.0, ("torchtrain", "1B", "compile"): 12.0,
    ("torchtrain", "1B", "compile+float8"): 14.0, ("torchtrain", "1B", "compile+profile"): 15.0,
    ("torchtrain", "1B", "compile+float8+profile"): 17.0, ("torchtrain", "tiny", "float8+profile"): 3.0,
    ("torchtrain", "3B", "compile"): 15.0, ("torchtrain", "3B", "compile+float8"): 17.0,
    ("torchtitan", "1B", "eager"): 22.0, ("torchtitan", "1B", "compile"): 32.0, ("torchtitan", "1B", "profile"): 25.0,
    ("torchtitan", "1B", "compile+profile"): 35.0,
    ("torchtrain", "8B", "compile"): 30.0, ("torchtrain", "8B", "eager"): 8.0, ("torchtitan", "8B", "compile"): 50.0,
}
UNKNOWN_OVERHEAD_S = 60.0
FIRST_RUN_S = 5.0
"""One-time imports of the process's first trainer run (the kit machine's first runs took 5-9 s more)."""

# Steady step seconds: (host, GPU at the model's REF_TOKENS) -> max(host, GPU x tokens / REF_TOKENS), the
# planner's form: a small step waits on the host dispatching it, a large one on the GPU. Measured on the
# kit's H100 machine: 1B eager 0.286 s at 4,096 tokens (host-bound; 0.14 s of GPU work a step in its
# profile); compiled 0.138 s at 4,096 and 0.273 s at 16,384 tokens; compiled float8 0.206 s at 4,096; the
# feature runs' float8 (eager) 0.395 s and CPU offload 2.5 s; torchtitan eager 0.177 s (0.116 s of GPU
# work), compiled 0.105 s at 4,096 and 0.312 s at 16,384 tokens. Estimated: the 3B (28 blocks of 3072:
# 2.2x the 1B's FLOPs a token, 1.75x its blocks' host work), the 8B (32 blocks of 4096: 5.9x the 1B's FLOPs
# a token, 2x its blocks' host work; its overhead adds the initialisation of 8B parameters), float8's GPU
# share, profiled steps (1.5x the host part, compiled 1.2x the GPU part; writing the trace ~3 s).
# The debug model and the dry run's tiny one are host-bound.
STEP_S = {
    ("torchtrain", "tiny", "eager"): (0.05, 0.0), ("torchtrain", "tiny", "float8"): (0.1, 0.0),
    ("torchtrain", "tiny", "profile"): (0.08, 0.0),
    ("torchtrain", "debug", "eager"): (0.05, 0.005), ("torchtrain", "debug", "float8"): (0.14, 0.005),
    ("torchtrain", "debug", "offload"): (0.07, 0.005), ("torchtrain", "debug", "compile"): (0.035, 0.005),
    ("torchtrain", "1B", "eager"): (0.286, 0.14), ("torchtrain", "1B", "float8"): (0.395, 0.12),
    ("torchtrain", "1B", "profile"): (0.43, 0.14), ("torchtrain", "1B", "offload"): (2.5, 0.14),
    ("torchtrain", "1B", "compile"): (0.138, 0.068), ("torchtrain", "1B", "compile+float8"): (0.206, 0.085),
    ("torchtrain", "3B", "compile"): (0.24, 0.19), ("torchtrain", "3B", "compile+float8"): (0.36, 0.23),
    ("torchtitan", "1B", "eager"): (0.177, 0.116), ("torchtitan", "1B", "compile"): (0.105, 0.078),
    ("torchtitan", "1B", "profile"): (0.27, 0.116),
    ("torchtrain", "1B", "compile+profile"): (0.21, 0.082), ("torchtitan", "1B", "compile+profile"): (0.16, 0.094),
    ("torchtrain", "1B", "compile+float8+profile"): (0.31, 0.1), ("torchtrain", "tiny", "float8+profile"): (0.15, 0.0),
    ("torchtrain", "8B", "compile"): (0.28, 0.40), ("torchtrain", "8B", "eager"): (0.57, 0.45),
    ("torchtitan", "8B", "compile"): (0.21, 0.45),
}
REF_TOKENS = {"tiny": 128, "debug": 2048, "1B": 4096, "3B": 4096, "8B": 4096}
UNKNOWN_STEP_S = 0.5
SAFETY = 1.1
"""An estimate is multiplied by this before it is compared with the time left."""
MIN_RUN_S = 0.5
"""No run costs less than this: building its trainer (an estimate refined from a fast run stays above it)."""


class Stop(Exception):
    """Raised once, in the main thread, at the budget's deadline or on SIGTERM."""


@dataclass(frozen=True)
class RunSpec:
    engine: str
    """torchtrain | torchtitan"""
    model: str
    """tiny | debug | 1B"""
    mode: str
    """eager | offload | otherwise "+"-joined: compile, float8, profile (a profiler window), e.g.
    compile+float8+profile"""
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
    profiled = flags.get("--profiling.enable_profiling") == "true"
    mode = ("compile" if compiled else "") + ("+float8" if float8 else "") + ("+profile" if profiled else "")
    mode = mode.lstrip("+") or ("offload" if offload else "eager")
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
    @staticmethod
    def table_step_s(key: tuple[str, str, str], tokens: int) -> float:
        host, gpu = STEP_S.get(key, (UNKNOWN_STEP_S, 0.0))
        return max(host, gpu * tokens / REF_TOKENS.get(key[1], tokens or 1))

    def step_s(self, spec: RunSpec) -> float:
        """The table's step at the spec's tokens, scaled by how far this machine measured from it: the
        same (engine, model, mode) when measured, else the median over the model's measured modes."""
        key = (spec.engine, spec.model, spec.mode)
        table = self.table_step_s(key, spec.tokens)
        if key in self._steps:
            measured, tokens = self._steps[key]
            return table * measured / self.table_step_s(key, tokens)
        ratios = [m / self.table_step_s(k, t) for k, (m, t) in self._steps.items() if k in STEP_S and k[1] == spec.model]
        return table * min(max(statistics.median(ratios), 0.5), 3.0) if ratios else table

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
        first = FIRST_RUN_S if spec.engine == "torchtrain" and not self._trained else 0.0
        return max(first + self.overhead_s(spec) + spec.steps * self.step_s(spec), MIN_RUN_S)

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
        key = (spec.engine, spec.model, spec.mode)
        if step_s:
            self._steps[key] = (step_s, spec.tokens)
        step = step_s or self.step_s(spec)
        first = FIRST_RUN_S if spec.engine == "torchtrain" and not self._trained else 0.0
        self._overheads[key] = max(seconds - spec.steps * step - first, 0.0)
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
