"""The measurement protocol both trainers are held to in the GPU kit (torchtrain in the kit's process,
torchtitan in its own, through `titan_window.py`).

A run is `warmup` steps (compilation, allocator and cuBLAS warm-up) and then a window of `window` steady
steps. The window is timed on each side between two device-synchronised points: the host waits for the
device before the window's first step is called and again after its last step has returned, and reads
its clock at both. Throughput is the tokens of the window's steps over that time.

Both sides do the same host work inside the window: neither logs there. Logging reads the loss and the
gradient norm back to the host (two blocking syncs a step in torchtitan's `train_step`; torchtrain defers
its reads behind the next step), so the cadence (`log_freq`) puts no logging step inside the window by
default: both log the first step, torchtrain also its last, after the window has closed. The window's
own step times come from marks it records at each step boundary (CUDA events on the stream, read after
the closing synchronisation; the host clock on a CPU), so no per-step record is needed for them. A dry
run counts the host syncs inside each window (`SyncCounter`: the operators that read a tensor's values
back to the host) and writes the count beside the times; the kit holds the two counts equal.
The window writes `window.json` into the run's folder.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_ENV = "TORCHTRAIN_KIT_WINDOW"
"""`first:last:path[:count]`: the window a torchtitan process times (read by `titan_window.py`); `count`:
count its host syncs too (a dry run)."""
WINDOW_FILE = "window.json"


@dataclass(frozen=True)
class Protocol:
    """Warm-up steps, window steps, logging cadence: the same on both sides of every comparison."""

    warmup: int = 3
    window: int = 12
    log_freq: int = 0
    """Both sides log every `log_freq` steps; 0: only outside the window (every `last + 1` steps)."""
    count_syncs: bool = False
    """Count the host syncs inside each window (a dry run: `SyncCounter` dispatches every operator)."""

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.window < 1 or self.log_freq < 0:
            raise ValueError(f"protocol: warm-up and window must be >= 1 and log_freq >= 0, got {self}")

    @property
    def cadence(self) -> int:
        """The `log_freq` both sides are given."""
        return self.log_freq or self.last + 1

    @property
    def first(self) -> int:
        return self.warmup + 1

    @property
    def last(self) -> int:
        return self.warmup + self.window

    @property
    def steps(self) -> int:
        """Steps a run trains: the warm-up and the window, nothing after it."""
        return self.last

    def describe(self) -> str:
        """One line for a table's notes: what both sides were held to."""
        cadence = (f"both sides log every {self.log_freq} step{'s' * (self.log_freq != 1)}" if self.log_freq else
                   "neither side logs inside the window (log_freq "
                   f"{self.cadence}: no host sync for a record there)")
        return (f"protocol: steps {self.first}-{self.last} (N = {self.window} after {self.warmup} warm-up) timed on "
                f"each side between two device synchronisations (before step {self.first}, after step "
                f"{self.last}); {cadence}; tokens/s = tokens in the window / window seconds; step times: the "
                f"window's marks at each step boundary")

    def window_at(self, path: str, last: int | None = None) -> StepWindow:
        """The StepWindow of this protocol writing to `path` (`last`: an earlier end, a shorter run)."""
        return StepWindow(self.first, min(self.last, last or self.last), path, count_syncs=self.count_syncs)

    def env(self, folder: str) -> dict[str, str]:
        """The environment that makes a torchtitan process time this window into `folder`."""
        count = ":count" if self.count_syncs else ""
        return {WINDOW_ENV: f"{self.first}:{self.last}:{os.path.join(folder, WINDOW_FILE)}{count}"}


def device_synchronize() -> None:
    """Wait for the CUDA device, if there is one (a CPU's work has finished when a step returns)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _cuda_active() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


class _Marks:
    """Times of step boundaries: CUDA events recorded on the current stream (no host sync; read once the
    window has been synchronised), or `clock` where no CUDA device is in use or `events` is False."""

    def __init__(self, clock: Callable[[], float], events: bool = True):
        self.clock, self.events, self.times = clock, events and _cuda_active(), []

    def mark(self) -> None:
        if self.events:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.times.append(event)
        else:
            self.times.append(self.clock())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (call after the device has been synchronised)."""
        if self.events:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.times, self.times[1:])]
        return [b - a for a, b in zip(self.times, self.times[1:])]


SYNCING_OPS = ("_local_scalar_dense", "nonzero", "equal", "masked_select", "_unique2", "unique_consecutive")
"""Operators whose result depends on a tensor's values read back to the host (on a GPU, each waits for
the device): `.item()`, `bool()`, `float()` and `.tolist()` of a scalar reach `_local_scalar_dense`."""


class SyncCounter:
    """Counts the SYNCING_OPS dispatched while it is entered (a dry run's check that both trainers do the
    same host work inside the window; it sees every operator, so a timed GPU run does not enter it)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in SYNCING_OPS:
                    counter.count += 1
                    counter.ops[name] = counter.ops.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.count, self.ops, self._mode = 0, {}, _Mode()

    def __enter__(self) -> SyncCounter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


class StepWindow:
    """Times steps `first`..`last` between two device-synchronised points and writes them to `path`: the
    window's seconds, each step's time from the marks at its boundaries (from its call to the next step's
    call, the last one's to its return: the loop's host work between steps counts), and with
    `count_syncs` the host syncs dispatched inside the window."""

    def __init__(self, first: int, last: int, path: str, sync: Callable[[], None] = device_synchronize,
                 clock: Callable[[], float] = time.perf_counter, count_syncs: bool = False):
        if not 1 <= first <= last:
            raise ValueError(f"a window is steps first..last with 1 <= first <= last, got {first}..{last}")
        self.first, self.last, self.path, self.sync, self.clock = first, last, path, sync, clock
        self.count_syncs = count_syncs
        self._start: tuple[float, float] | None = None
        self._marks: _Marks | None = None
        self._counter: SyncCounter | None = None
        self.result: dict | None = None

    def before(self, step: int) -> None:
        """Called before step `step` is run: the window opens at its first step; each step in it is marked."""
        if step == self.first:
            self.sync()
            self._start = (self.clock(), time.time())
            # a window given its own clock and synchronisation (a test's) marks its steps by that clock
            self._marks = _Marks(self.clock, events=self.sync is device_synchronize and self.clock is time.perf_counter)
            if self.count_syncs:
                self._counter = SyncCounter().__enter__()
        if self._marks is not None and self.first <= step <= self.last:
            self._marks.mark()

    def after(self, step: int) -> None:
        """Called once step `step` has returned: the window closes at its last step."""
        if step != self.last or self._start is None:
            return
        self._marks.mark()
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
        self.sync()
        seconds = self.clock() - self._start[0]
        self.result = {"first": self.first, "last": self.last, "steps": self.last - self.first + 1,
                       "seconds": seconds, "start_unix": self._start[1], "end_unix": time.time(),
                       "step_times": self._marks.intervals(), "clock": "cuda events" if self._marks.events else "host"}
        if self._counter is not None:
            self.result.update(host_syncs=self._counter.count, host_sync_ops=self._counter.ops)
        with open(self.path, "w") as f:
            json.dump(self.result, f)


def parse_window_env(value: str) -> StepWindow:
    """`first:last:path[:count]` (WINDOW_ENV) -> its StepWindow."""
    count = value.endswith(":count")
    value = value.removesuffix(":count")
    first, last, path = value.split(":", 2) if value.count(":") >= 2 else (None, None, None)
    if not (first and last and path and first.isdigit() and last.isdigit()):
        raise ValueError(f"{WINDOW_ENV} must be first:last:path[:count], got {value!r}")
    return StepWindow(int(first), int(last), path, count_syncs=count)


class WindowedStep:
    """A trainer's step callable, timed by `window` (the step number read from `step_of` at each call);
    every other attribute is the step's own."""

    def __init__(self, step: Callable, window: StepWindow, step_of: Callable[[], int]):
        self.__dict__.update(_step=step, _window=window, _step_of=step_of)

    def __call__(self, *args, **kwargs):
        step = self._step_of()
        self._window.before(step)
        result = self._step(*args, **kwargs)
        self._window.after(step)
        return result

    def __getattr__(self, name: str):
        return getattr(self._step, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._step, name, value)


def read_window(folder: str) -> dict | None:
    """The window a run in `folder` timed (None: it did not reach the window's end)."""
    path = os.path.join(folder, WINDOW_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def window_tokens_per_s(window: dict | None, tokens_per_step: int | None) -> float | None:
    """Tokens of the window's steps over the window's seconds."""
    if not window or not tokens_per_step or window.get("seconds", 0) <= 0:
        return None
    return tokens_per_step * window["steps"] / window["seconds"]
