"""The GPU's own readings during a run: SM clock, its maximum, temperature and power, sampled from
`nvidia-smi` every `interval_s` by a background thread while the run goes on (`DeviceSampler`). Without
`nvidia-smi` (a CPU) the sampler records nothing and says so. `parse_samples` reads nvidia-smi's CSV, so
the readings can be checked from synthetic output. Each run keeps its readings beside its window
(`DEVICE_FILE`, `save_readings`/`load_readings`), so a set can be judged again later (`rejudge.py`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass

QUERY = ("clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw")
COMMAND = ["nvidia-smi", f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits", "--id=0"]


@dataclass(frozen=True)
class Sample:
    """One reading of the first GPU, at `t` (seconds since the epoch)."""

    t: float
    sm_mhz: float
    max_sm_mhz: float
    temp_c: float
    power_w: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def parse_samples(text: str, t: float) -> list[Sample]:
    """nvidia-smi's `clocks.sm, clocks.max.sm, temperature.gpu, power.draw` lines (units or not) -> one
    Sample per line that reads; a power of `[N/A]` reads as None, any other unreadable field drops the line."""
    samples = []
    for line in text.strip().splitlines():
        fields = [f.strip().split()[0] if f.strip() else "" for f in line.split(",")]
        if len(fields) != len(QUERY):
            continue
        try:
            clock, top, temp = (float(v) for v in fields[:3])
        except ValueError:
            continue
        try:
            power = float(fields[3])
        except ValueError:
            power = None
        samples.append(Sample(t, clock, top, temp, power))
    return samples[:1]  # the first GPU's


class DeviceSampler:
    """`with DeviceSampler() as s:` samples the GPU every `interval_s` until the block ends; `s.samples`.
    `available` is False where there is no nvidia-smi (nothing is sampled)."""

    def __init__(self, interval_s: float = 0.25, command: list[str] | None = None):
        self.interval_s, self.command = interval_s, command or COMMAND
        self.available = shutil.which(self.command[0]) is not None
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> list[Sample]:
        """One reading now (empty if nvidia-smi fails)."""
        try:
            out = subprocess.run(self.command, capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return parse_samples(out, time.time())

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples += self.read()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> DeviceSampler:
        if self.available:
            self._thread = threading.Thread(target=self._loop, name="device-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def within(samples: list[Sample], window: dict | None, margin_s: float = 0.5) -> list[Sample]:
    """The samples taken during a timed window (`protocol.StepWindow`'s start_unix..end_unix, widened by
    `margin_s` on each side: the reading just before it tells the state it opened in); all of them when
    there is no window."""
    if not window or "start_unix" not in window:
        return list(samples)
    return [s for s in samples if window["start_unix"] - margin_s <= s.t <= window["end_unix"] + margin_s]


DEVICE_FILE = "device.json"
"""A run's device readings, in its folder beside the protocol's window.json."""


def save_readings(folder: str, samples: list[Sample]) -> None:
    """`samples` into `folder`/DEVICE_FILE (nothing when there are none: a CPU)."""
    if samples:
        with open(os.path.join(folder, DEVICE_FILE), "w") as f:
            json.dump([s.as_dict() for s in samples], f)


def load_readings(folder: str) -> list[Sample]:
    """The readings `save_readings` kept in `folder` ([] where it kept none)."""
    path = os.path.join(folder, DEVICE_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [Sample(**d) for d in json.load(f)]
