"""The GPU kit's measurement protocol and its steadiness verdict, on the CPU: the window timed between two
device synchronisations on each side (torchtrain's step wrapped in the kit's process, torchtitan's
Trainer class patched in its own), the device's readings parsed from nvidia-smi's output, and a verdict
that names what it saw -- a clock drop is the device's, a lone slow step with the clocks steady is not."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks", "gpu"))
import device_watch  # noqa: E402
import protocol  # noqa: E402
import steadiness  # noqa: E402
import titan_window  # noqa: E402

sys.path.remove(os.path.join(REPO, "benchmarks", "gpu"))


class FakeClock:
    """A host clock and a device synchronisation that the test drives."""

    def __init__(self):
        self.now, self.syncs = 0.0, []

    def sync(self) -> None:
        self.syncs.append(self.now)
        self.now += 0.5  # the device finishes what was queued: the host waits

    def __call__(self) -> float:
        return self.now


def test_the_window_is_timed_between_two_device_synchronisations(tmp_path):
    clock = FakeClock()
    window = protocol.StepWindow(2, 3, str(tmp_path / "window.json"), sync=clock.sync, clock=clock)
    for step in range(1, 5):
        window.before(step)
        clock.now += 1.0  # the host queues the step
        window.after(step)
    assert clock.syncs == [1.0, 3.5]  # before step 2, after step 3: nowhere else
    assert window.result["seconds"] == pytest.approx(2.5) and window.result["steps"] == 2
    # each step's time from the marks at its boundaries (call to next call, the last to its return)
    assert window.result["step_times"] == pytest.approx([1.0, 1.0]) and window.result["clock"] == "host"
    assert json.load(open(tmp_path / "window.json"))["seconds"] == pytest.approx(2.5)
    assert protocol.window_tokens_per_s(window.result, 1000) == pytest.approx(800)
    assert protocol.window_tokens_per_s(None, 1000) is None


def test_torchtrains_step_and_torchtitans_trainer_are_timed_alike(tmp_path, monkeypatch):
    clock = FakeClock()
    state = {"step": 0}

    class Step:
        pipeline = "kept"

        def __call__(self, batches):
            clock.now += 1.0
            return batches

    ours = protocol.StepWindow(2, 2, str(tmp_path / "ours.json"), sync=clock.sync, clock=clock)
    step = protocol.WindowedStep(Step(), ours, lambda: state["step"])
    for state["step"] in (1, 2, 3):
        assert step("batch") == "batch"
    assert step.pipeline == "kept" and ours.result["seconds"] == pytest.approx(1.5)

    class Trainer:  # torchtitan's: `step` advanced before each train_step
        step = 0

        def train_step(self, data):
            clock.now += 1.0

    theirs = protocol.StepWindow(2, 2, str(tmp_path / "theirs.json"), sync=clock.sync, clock=clock)
    titan_window.install(Trainer, theirs)
    trainer = Trainer()
    for trainer.step in (1, 2, 3):
        trainer.train_step(None)
    assert theirs.result["seconds"] == ours.result["seconds"]
    # in torchtitan's process the window comes from the environment; a malformed one is a clear error
    monkeypatch.setenv(protocol.WINDOW_ENV, "4:15")
    with pytest.raises(ValueError, match="must be first:last:path"):
        titan_window.install_from_env()
    monkeypatch.setenv(protocol.WINDOW_ENV, f"4:15:{tmp_path / 'w.json'}")
    monkeypatch.setitem(sys.modules, "__main__", type(sys)("__main__"))
    with pytest.raises(RuntimeError, match="no torchtitan Trainer is loaded"):
        titan_window.install_from_env()
    sys.modules["__main__"].Trainer = Trainer
    assert titan_window.install_from_env()


def test_protocol_states_itself_and_refuses_nonsense():
    p = protocol.Protocol(warmup=3, window=12)
    assert (p.first, p.last, p.steps) == (4, 15, 15)
    assert p.describe().startswith("protocol: steps 4-15 (N = 12 after 3 warm-up) timed on each side between "
                                   "two device synchronisations")
    # by default neither side logs inside the window: the cadence lands past its last step
    assert p.cadence == 16 and "neither side logs inside the window (log_freq 16" in p.describe()
    assert protocol.Protocol(log_freq=1).cadence == 1 and "both sides log every 1 step;" in \
        protocol.Protocol(log_freq=1).describe()
    assert p.env("/out") == {protocol.WINDOW_ENV: "4:15:/out/window.json"}
    counted = protocol.Protocol(count_syncs=True)
    assert counted.env("/out") == {protocol.WINDOW_ENV: "4:15:/out/window.json:count"}
    assert protocol.parse_window_env(counted.env("/out")[protocol.WINDOW_ENV]).count_syncs
    with pytest.raises(ValueError, match="must be >= 1"):
        protocol.Protocol(window=0)


def test_the_window_counts_the_host_syncs_inside_it_and_nowhere_else(tmp_path):
    """A dry run's check of equal host work: `.item()`, `bool()` and `.tolist()` of a tensor inside the
    window are counted, the same reads before or after it are not."""
    import torch

    window = protocol.StepWindow(2, 3, str(tmp_path / "window.json"), count_syncs=True)
    x = torch.ones(3)
    for step in range(1, 5):
        window.before(step)
        y = (x * step).sum()
        y.item()  # a logged loss: one sync a step, steps 2 and 3 inside the window
        if step == 3:
            bool(y > 0), torch.nonzero(x)
        window.after(step)
    assert window.result["host_syncs"] == 4
    assert window.result["host_sync_ops"] == {"_local_scalar_dense": 3, "nonzero": 1}
    assert len(window.result["step_times"]) == 2


def test_nvidia_smi_output_reads_into_samples():
    with_units = "1980 MHz, 1980 MHz, 38, 412.71 W\n"
    assert device_watch.parse_samples(with_units, 5.0) == [device_watch.Sample(5.0, 1980, 1980, 38, 412.71)]
    assert device_watch.parse_samples("1755, 1980, 87, [N/A]", 1.0)[0].power_w is None
    assert device_watch.parse_samples("", 1.0) == [] and device_watch.parse_samples("[N/A], 1980, 40, 1", 1.0) == []
    sampler = device_watch.DeviceSampler(command=["echo", "1410 MHz, 1980 MHz, 88, 699.1 W"])
    assert sampler.available and sampler.read()[0].sm_mhz == 1410
    assert not device_watch.DeviceSampler(command=["no-such-nvidia-smi"]).available
    samples = [device_watch.Sample(t, 1980, 1980, 40, 300) for t in (9.0, 10.0, 11.0, 20.0)]
    assert [s.t for s in device_watch.within(samples, {"start_unix": 10.0, "end_unix": 11.0})] == [10.0, 11.0]


def _samples(clocks, temp=40.0):
    return [device_watch.Sample(float(i), c, 1980, temp, 400.0) for i, c in enumerate(clocks)]


def test_a_clock_drop_is_named_as_the_device_moving():
    verdict = steadiness.judge(_samples([1980, 1980, 1410, 1980]), [0.25] * 6 + [0.35] * 6)
    assert not verdict.steady and verdict.device_moved
    assert verdict.cause.startswith("device moved: the SM clock fell from 1980 to 1410 MHz")
    hot = steadiness.judge(_samples([1980] * 4, temp=88), [0.25] * 12)
    assert not hot.steady and hot.device_moved and "88 C" in hot.cause


def test_a_slow_step_with_steady_clocks_is_not_a_device_change():
    times = [0.25] * 11 + [0.40]
    verdict = steadiness.judge(_samples([1980] * 5), times)
    assert verdict.steady and not verdict.device_moved
    assert "one outlier step" in verdict.cause and "not a device change" in verdict.cause
    spread = steadiness.judge(_samples([1980] * 5), [0.25] * 8 + [0.35, 0.4, 0.2, 0.45])
    assert not spread.steady and not spread.device_moved and "step times spread" in spread.cause
    assert "device steady" in spread.cause
    assert steadiness.judge([], [0.25] * 12, sampled=False).cause.startswith("device not read")
