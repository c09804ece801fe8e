"""A logged step's record written after the next step is queued (trainer/step_record.py).

On CUDA the trainer writes a logged step's record once it has queued the next step, so the GPU never waits
for the host's logging, data loading or launches. A CPU runs each step to its end before it returns, so
there the record is written at once; these tests force the deferred path on the CPU (in-process trainers, a
world of one, gloo) and hold it to the immediate one: the same records, nothing lost, one step late.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_JOB, read_metrics, world_of_one

from torchtrain.trainer import trainer as trainer_module
from torchtrain.trainer.step import StepResult
from torchtrain.trainer.step_record import StepValues, defers_log

STEPS = 4
JOB = TINY_JOB + ["--training.steps", str(STEPS), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]
EXACT = ("step", "loss", "grad_norm", "lr", "tokens_seen")
"""Fields that must be equal: the same step's values whichever path wrote them."""


def run(folder, monkeypatch, deferred: bool, fail_at: int | None = None) -> tuple[list[dict], list[tuple[int, int]]]:
    """Train in this process; (records, (record's step, trainer's step when it was written) per record)."""
    from torchtrain.config import parse_args
    from torchtrain.trainer.trainer import Trainer

    world_of_one(monkeypatch)
    # each path forced, whichever device the process finds (deferred is CUDA's default)
    monkeypatch.setattr(trainer_module, "defers_log", lambda device, reasons: deferred and not reasons)
    trainer = Trainer(parse_args(JOB + ["--job.dump_folder", str(folder)]))
    written = []
    log = trainer.metrics.log
    trainer.metrics.log = lambda step, record: (written.append((step, trainer.state.step)), log(step, record))
    if fail_at is not None:
        class Failing(type(trainer.train_step)):
            def __call__(self, batches, hooks=None):
                if trainer.state.step == fail_at:
                    raise RuntimeError("injected")
                return super().__call__(batches, hooks)

        trainer.train_step.__class__ = Failing
    finished = False
    try:
        trainer.train()
        finished = True
    except RuntimeError as e:
        assert str(e) == "injected"
    finally:
        trainer.close(finished)
    return read_metrics(str(folder)), written


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        immediate = run(tmp_path_factory.mktemp("immediate"), mp, deferred=False)
        deferred = run(tmp_path_factory.mktemp("deferred"), mp, deferred=True)
        failed = run(tmp_path_factory.mktemp("failed"), mp, deferred=True, fail_at=3)
    finally:
        mp.undo()
    return immediate, deferred, failed


def test_deferred_records_equal_the_immediate_ones(runs):
    (immediate, _), (deferred, _), _ = runs
    assert [r["step"] for r in deferred] == list(range(1, STEPS + 1))
    for a, b in zip(immediate, deferred):
        assert {k: a[k] for k in EXACT} == {k: b[k] for k in EXACT}
        assert a.keys() == b.keys()
        assert b["tokens_per_s_per_device"] > 0 and b["step_time_s"] > 0


def test_records_are_written_one_step_late_only_when_deferred(runs):
    (_, immediate), (_, deferred), _ = runs
    assert immediate == [(s, s) for s in range(1, STEPS + 1)]
    # each record once the next step is queued; the last one when the loop ends
    assert deferred == [(s, s + 1) for s in range(1, STEPS)] + [(STEPS, STEPS)]


def test_a_failed_step_does_not_lose_the_record_before_it(runs):
    _, _, (records, written) = runs
    assert [r["step"] for r in records] == [1, 2]
    assert written[-1] == (2, 3)  # pending when step 3 failed: written as the trainer closed


def test_only_cuda_defers_and_never_with_a_reason():
    assert defers_log(torch.device("cuda"), [])
    assert not defers_log(torch.device("cuda"), ["verdict"])
    assert not defers_log(torch.device("cpu"), [])


def test_host_values_pass_through_on_the_cpu():
    loss, norm, tokens = torch.tensor(2.5), torch.tensor(0.5), torch.tensor(128)
    values = StepValues(StepResult(loss, norm, 1e-3, tokens, True), torch.tensor(1024)).ready()
    assert values.out.loss is loss and values.out.tokens is tokens and values.tokens_seen == 1024
    assert values.out.metrics() == {"loss": 2.5, "grad_norm": 0.5, "lr": 1e-3}


def test_step_time_is_the_devices_where_it_was_measured():
    from torchtrain.components.observability.metrics import ThroughputMeter

    meter = ThroughputMeter(flops_per_token=6, peak_tflops=None, world_size=1)
    meter.add_step(1000, 0.0)
    meter.add_step(1000, 0.0)
    summary = meter.summary(elapsed=0.5)  # two steps in half a second of device time
    assert summary["step_time_s"] == 0.25 and summary["tokens_per_s_per_device"] == 4000
    cpu = StepValues(StepResult(torch.tensor(1.0), torch.tensor(1.0), 0.0, torch.tensor(1), True), torch.tensor(1))
    assert cpu.seconds_after(cpu) is None  # no device clock on a CPU: the wall clock measures the step
