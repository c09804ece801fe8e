"""The GPU kit's measurement protocol and its steadiness verdict, on the CPU: the window timed between two
device synchronisations on each side (torchtrain's step wrapped in the kit's process, torchtitan's
Trainer class patched in its own), the device's readings parsed from nvidia-smi's output, and a verdict
that names what it saw -- a pace that moves with the clock is the device's, a clock that moves while the
pace holds (a GPU at its power limit) and a lone slow step are not -- and a committed set judged again."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks", "gpu"))
import device_watch  # noqa: E402
import protocol  # noqa: E402
import rejudge  # noqa: E402
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


def test_a_clock_drop_that_slows_the_pace_is_named_as_the_device_moving():
    verdict = steadiness.judge(_samples([1980, 1980, 1410, 1980]), [0.25] * 6 + [0.35] * 6)
    assert not verdict.steady and verdict.device_moved
    assert verdict.cause.startswith("device moved: the window's pace slowed 40.0% from its first to its last third")
    assert "SM 1410-1980 MHz" in verdict.cause
    hot = steadiness.judge(_samples([1980] * 4, temp=88), [0.25] * 12)
    assert not hot.steady and hot.device_moved and "88 C" in hot.cause


def test_a_power_capped_clock_with_a_steady_pace_is_steady():
    """An H200 at its 700 W limit reads SM clocks from 1290 to 1980 MHz within one window while its steps
    keep one pace (the 2026-12-04 set's compiled batch-8 run: 0.237-0.262 s): steady, the clock's range named.
    The same pace drift without any clock change is the run's own, not the device's."""
    steps = [0.239, 0.262, 0.245, 0.240, 0.237, 0.250, 0.249, 0.241, 0.239, 0.247, 0.251, 0.241]
    capped = steadiness.judge(_samples([1980, 1395, 1650, 1440, 1980, 1500]), steps)
    assert capped.steady and not capped.device_moved
    assert "device clock moving, as at a power limit" in capped.cause and "steps within 10%" in capped.cause and "SM 1395-1980 MHz" in capped.cause
    quicker = steadiness.judge(_samples([1980, 1800, 1980, 1850]), [0.12] * 6 + [0.10] * 6)  # H200, eager batch 2
    assert not quicker.steady and not quicker.device_moved and quicker.cause.startswith("the window's pace quickened")
    own = steadiness.judge(_samples([1980] * 6), [0.25] * 6 + [0.28] * 6)
    assert not own.steady and not own.device_moved and own.cause.startswith("the window's pace slowed 12.0%")
    assert steadiness.drift([0.25] * 5) is None and abs(steadiness.drift([0.2] * 3 + [0.3] * 3) - 0.5) < 1e-12


def test_a_slow_step_with_steady_clocks_is_not_a_device_change():
    times = [0.25] * 11 + [0.40]
    verdict = steadiness.judge(_samples([1980] * 5), times)
    assert verdict.steady and not verdict.device_moved
    assert "one outlier step" in verdict.cause and "not a device change" in verdict.cause
    spread = steadiness.judge(_samples([1980] * 5), [0.25] * 8 + [0.35, 0.4, 0.2, 0.45])
    assert not spread.steady and not spread.device_moved and "step times spread" in spread.cause
    assert "device steady" in spread.cause
    assert steadiness.judge([], [0.25] * 12, sampled=False).cause.startswith("device not read")


H200_SET = os.path.join(REPO, "benchmarks", "gpu", "results", "2026-12-04-h200-6a34a3a")


def test_a_committed_set_judged_again_gives_the_verdicts_it_holds(tmp_path):
    """The H200 set, judged again from its windows: the batch-8 and 8B pairs are steady, the batch-2 pairs
    not (their steps spread); judging it once more changes nothing; torchtitan's runs are found by the
    folder their windows went to. A run's device readings round-trip through its folder."""
    import shutil

    copy = str(tmp_path / "set")
    shutil.copytree(H200_SET, copy)
    assert rejudge.window_folder("d/torchtitan_8B_b2_compiled") == "d/torchtitan/out_8B_compiled_b2"
    assert rejudge.window_folder("c/b8_compile") == "c/b8_compile"
    assert rejudge.verdict(copy, "c/b8_compile").steady and rejudge.verdict(copy, "d/torchtitan_b8_compiled").steady
    assert not rejudge.verdict(copy, "c/b2_eager").steady and rejudge.verdict(copy, "c/missing") is None
    assert rejudge.rejudge(copy) == ["c", "d", "g", "i"]
    for part in ("c", "d", "g", "i"):
        with open(os.path.join(copy, f"{part}.json")) as f, open(os.path.join(H200_SET, f"{part}.json")) as g:
            assert json.load(f) == json.load(g), part
    with open(os.path.join(copy, "d.json")) as f:
        ratios = {(r[0], r[1]): r[4] for r in json.load(f)["rows"]}
    assert ratios[(8, "compiled")] == "1.18" and ratios[(2, "eager")].endswith("(unsteady)")
    readings = [device_watch.Sample(1.0, 1395.0, 1980.0, 60.0, 690.0), device_watch.Sample(1.25, 1980.0, 1980.0, 61.0, None)]
    device_watch.save_readings(str(tmp_path), readings)
    assert device_watch.load_readings(str(tmp_path)) == readings and device_watch.load_readings(copy) == []
