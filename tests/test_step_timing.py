"""A logged step's time is the device's, read only once the device has passed both ends of it
(trainer/step_record.py), and the run's last record is written after the device has finished its work.

The device here is simulated: the host queues work instantly, the device runs it in order; an event marks
the end of the work queued before it and completes only when the device gets there; reading an interval
between events that have not completed fails, as it does on CUDA. A step whose work ends late must be
recorded at its full device time, not at the moment the host happened to write its record.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_JOB, read_metrics, world_of_one

from torchtrain.trainer import trainer as trainer_module
from torchtrain.trainer.step import StepResult
from torchtrain.trainer.step_record import StepValues


class SimulatedDevice:
    """A device that runs queued work in order, with its own timeline and the host's."""

    def __init__(self):
        self.host_s = 0.0  # where the host is
        self.queued_until_s = 0.0  # when the device finishes what has been queued so far
        self.synchronized = 0

    def launch(self, seconds: float) -> None:
        self.queued_until_s = max(self.queued_until_s, self.host_s) + seconds

    def mark(self) -> SimulatedEvent:
        return SimulatedEvent(self, self.queued_until_s)

    def synchronize(self) -> None:
        self.synchronized += 1
        self.host_s = max(self.host_s, self.queued_until_s)

    def idle(self) -> bool:
        return self.host_s >= self.queued_until_s


class SimulatedEvent:
    def __init__(self, device: SimulatedDevice, at_s: float):
        self.device, self.at_s = device, at_s

    def query(self) -> bool:
        return self.device.host_s >= self.at_s

    def synchronize(self) -> None:
        self.device.host_s = max(self.device.host_s, self.at_s)

    def elapsed_time(self, end: SimulatedEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("event not completed")  # CUDA: cudaErrorNotReady
        return (end.at_s - self.at_s) * 1e3


def _values(device: SimulatedDevice) -> StepValues:
    one = torch.tensor(1.0)
    return StepValues(StepResult(one, one, 0.0, torch.tensor(1), True), torch.tensor(1), device)


def test_a_step_that_completes_late_is_timed_to_its_end_on_the_device():
    device = SimulatedDevice()
    device.launch(0.1)
    first = _values(device)
    first.ready()
    device.launch(0.7)  # the last step: queued at once, its work ends 0.7 s later
    last = _values(device)
    assert not last._event.query()  # the host is ahead of the device when it comes to write the record
    assert last.seconds_after(first) == pytest.approx(0.7)  # waited for: its full time, not the host's
    assert device.host_s == pytest.approx(0.8)


STEPS = 4
WORK_S = {1: 0.2, 2: 0.1, 3: 0.1, 4: 0.6}
"""The simulated device seconds of each step: the last one ends late."""


def test_the_last_record_waits_for_its_work(tmp_path, monkeypatch):
    """The trainer's deferred records (as on CUDA) on a simulated device: every record after the first is
    the step's device time, the last one included, and the last one is written with the device idle."""
    from torchtrain.config import parse_args
    from torchtrain.trainer.trainer import Trainer

    world_of_one(monkeypatch)
    device = SimulatedDevice()
    monkeypatch.setattr(trainer_module, "defers_log", lambda _device, reasons: not reasons)
    monkeypatch.setattr(trainer_module, "step_clock", lambda _device: device)
    trainer = Trainer(parse_args(TINY_JOB + ["--training.steps", str(STEPS), "--metrics.log_freq", "1",
                                             "--metrics.enable_tensorboard", "false",
                                             "--job.dump_folder", str(tmp_path)]))

    class OnTheDevice(type(trainer.train_step)):
        def __call__(self, batches, hooks=None):
            device.launch(WORK_S[trainer.state.step])  # queued: the host returns before the work ends
            return super().__call__(batches, hooks)

    trainer.train_step.__class__ = OnTheDevice
    idle_when_written = {}
    log = trainer.metrics.log
    trainer.metrics.log = lambda step, record: (idle_when_written.__setitem__(step, device.idle()), log(step, record))
    try:
        trainer.train()
    finally:
        trainer.close(True)
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["step_time_s"] for r in records[1:]] == pytest.approx([WORK_S[s] for s in range(2, STEPS + 1)])
    assert idle_when_written[STEPS] and device.synchronized == 1  # one synchronisation: before the last record
    assert not idle_when_written[2]  # earlier records were written while the next step ran on
