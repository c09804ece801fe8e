"""The measurement protocol both trainers are held to in the GPU kit (torchtrain in the kit's process,
torchtitan in its own, through `titan_window.py`).

A run is `warmup` steps (compilation, allocator and cuBLAS warm-up) and then a window of `window` steady
steps. The window is timed on each side between two device-synchronised points: the host waits for the
device before the window's first step is called and again after its last step has returned, and reads
its clock at both. Throughput is the tokens of the window's steps over that time. Both sides log at the
same cadence (`log_freq`, forced alike: every step by default, so that each side's per-step records stay
for the table of step times). The window writes `window.json` into the run's folder.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_ENV = "TORCHTRAIN_KIT_WINDOW"
"""`first:last:path`: the window a torchtitan process times (read by `titan_window.py`)."""
WINDOW_FILE = "window.json"


@dataclass(frozen=True)
class Protocol:
    """Warm-up steps, window steps, logging cadence: the same on both sides of every comparison."""

    warmup: int = 3
    window: int = 12
    log_freq: int = 1

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.window < 1 or self.log_freq < 1:
            raise ValueError(f"protocol: warm-up, window and log_freq must be >= 1, got {self}")

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
        return (f"protocol: steps {self.first}-{self.last} (N = {self.window} after {self.warmup} warm-up) timed on "
                f"each side between two device synchronisations (before step {self.first}, after step "
                f"{self.last}); both sides log every {self.log_freq} step{'s' * (self.log_freq != 1)}; tokens/s = "
                f"tokens in the window / window seconds; step times: each side's per-step records")

    def env(self, folder: str) -> dict[str, str]:
        """The environment that makes a torchtitan process time this window into `folder`."""
        return {WINDOW_ENV: f"{self.first}:{self.last}:{os.path.join(folder, WINDOW_FILE)}"}


def device_synchronize() -> None:
    """Wait for the CUDA device, if there is one (a CPU's work has finished when a step returns)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepWindow:
    """Times steps `first`..`last` between two device-synchronised points and writes them to `path`."""

    def __init__(self, first: int, last: int, path: str, sync: Callable[[], None] = device_synchronize,
                 clock: Callable[[], float] = time.perf_counter):
        if not 1 <= first <= last:
            raise ValueError(f"a window is steps first..last with 1 <= first <= last, got {first}..{last}")
        self.first, self.last, self.path, self.sync, self.clock = first, last, path, sync, clock
        self._start: tuple[float, float] | None = None
        self.result: dict | None = None

    def before(self, step: int) -> None:
        """Called before step `step` is run: the window opens at its first step."""
        if step == self.first:
            self.sync()
            self._start = (self.clock(), time.time())

    def after(self, step: int) -> None:
        """Called once step `step` has returned: the window closes at its last step."""
        if step != self.last or self._start is None:
            return
        self.sync()
        seconds = self.clock() - self._start[0]
        self.result = {"first": self.first, "last": self.last, "steps": self.last - self.first + 1,
                       "seconds": seconds, "start_unix": self._start[1], "end_unix": time.time()}
        with open(self.path, "w") as f:
            json.dump(self.result, f)


def parse_window_env(value: str) -> StepWindow:
    """`first:last:path` (WINDOW_ENV) -> its StepWindow."""
    first, last, path = value.split(":", 2) if value.count(":") >= 2 else (None, None, None)
    if not (first and last and path and first.isdigit() and last.isdigit()):
        raise ValueError(f"{WINDOW_ENV} must be first:last:path, got {value!r}")
    return StepWindow(int(first), int(last), path)


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
