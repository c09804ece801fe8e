"""A logged step's device values, on their way to the host without holding the host up.

On CUDA the host queues a step's kernels well ahead of the GPU running them. Reading a logged step's loss
at once (`.item()`) makes the host wait until the GPU has finished the step; the GPU then waits in turn
while the host writes the record, fetches the next batch and queues the next step's first kernels: a few
milliseconds a logged step in which the GPU runs nothing (about 2 % of a 1B model's step on an H100 when
every step is logged). `StepValues` instead queues copies of the step's values into pinned host memory
behind the step's own work and marks the point with an event; the trainer writes the record after it has
queued the next step (`Trainer._flush_log`), waiting only for that event, while the GPU runs on.

The record says the same thing either way: its host-side fields are taken when the step ends, and on CUDA
its step time is the device's, from one logged step's end to the next (`StepValues.seconds_after`), read
only once both ends have completed on the device: a step whose work ends late is timed to where it ended,
never to where the host happened to be. The run's last record is written after the device has finished
all its work (`StepClock.synchronize`). On a CPU the step has finished when it returns, so the record is
written at once (`defers_log`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from torchtrain.trainer.step import StepResult

DEVICE_FIELDS = ("loss", "grad_norm", "tokens", "z_loss", "moe", "extra_losses")
"""The `StepResult` fields that are device tensors."""


def defers_log(device: torch.device, immediate_reasons: list[str]) -> bool:
    """A logged step's record is written after the next step is queued: on CUDA, unless something makes the
    step's end a point where the host waits anyway or reads state the next step changes
    (`immediate_reasons`: non-empty for a verdict, an evaluation, loss scaling, phase timing, replica
    groups or a checkpoint failure to report)."""
    return device.type == "cuda" and not immediate_reasons


class StepEvent(Protocol):
    """A point in the device's stream of work (what `torch.cuda.Event(enable_timing=True)` offers)."""

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: StepEvent) -> float: ...


class StepClock:
    """How a step's end is marked on the device and how the host waits for the device: CUDA events
    recorded on the current stream, `torch.cuda.synchronize`. `step_clock` gives one for a CUDA device
    (None for a CPU, whose steps end when they return)."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> StepEvent:
        """An event recorded behind the work queued so far."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        """Wait until the device has finished everything queued on it (every stream)."""
        torch.cuda.synchronize(self.device)


def step_clock(device: torch.device) -> StepClock | None:
    return StepClock(device) if device.type == "cuda" else None


def _to_host(value):
    if isinstance(value, torch.Tensor) and value.device.type == "cuda":  # pinned: the copy is queued, not waited for
        return torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value.detach(), non_blocking=True)
    return value


class StepValues:
    """`out`'s tensors and the tokens seen so far, copied to the host behind the step's work; `ready()`
    waits for the copies alone (the device's later work goes on)."""

    def __init__(self, out: StepResult, tokens_seen: torch.Tensor, clock: StepClock | None = None):
        self.out = dataclasses.replace(out, **{f: _to_host(getattr(out, f)) for f in DEVICE_FIELDS})
        self._tokens_seen = _to_host(tokens_seen)
        self._event = None if clock is None else clock.mark()  # after the copies, on the same stream

    def ready(self) -> StepValues:
        if self._event is not None:
            self._event.synchronize()
        return self

    def seconds_after(self, earlier: StepValues | None) -> float | None:
        """Device seconds between the end of `earlier`'s step and this one's (both `ready`); None on a CPU
        or without an earlier one. A deferred record's step time: the host's own clock would measure
        where it happened to be when it waited, which is not where the step ended. Both ends are waited
        for first: an interval is read only between two points the device has passed."""
        if self._event is None or earlier is None or earlier._event is None:
            return None
        earlier._event.synchronize()
        self._event.synchronize()
        return earlier._event.elapsed_time(self._event) / 1e3

    @property
    def tokens_seen(self) -> int:
        return int(self._tokens_seen)
