"""The [guard] under real torchrun + gloo (FSDP 2), with a NaN injected into the loss at a chosen step
(debug.inject_nonfinite_loss_steps), plus unit tests of the spike rule and of GC control.

The learning rate is constant after a 2-step warmup (min_lr_factor 1), so a step's update depends on
the weights, the optimizer state, the data and the step count of the optimizer only. That turns the
two policies into exact, bitwise comparisons of deterministic runs:

* `skip` at step 5: the step-5 checkpoint holds exactly the step-4 weights and optimizer state.
* `rollback` at step 5 (checkpoint at step 4): the retried step 5 starts from the step-4 state and
  reads the data that follows the bad window, which is what the `skip` run's step 6 does (it too
  starts from the step-4 state, skipped step 5's update and reads the next window). So the rollback
  run's steps 5, 6, 7 equal the skip run's steps 6, 7, 8 bit for bit; without the data skip they
  would equal the clean run's steps 5, 6, 7 instead.
"""

from __future__ import annotations

import gc
import json
import math
import os

import pytest
import torch
from conftest import TINY_JOB, read_metrics, run_train

from torchtrain.config.operations import Guard
from torchtrain.trainer.gc_control import GarbageCollection
from torchtrain.trainer.guard import NONFINITE, OK, SPIKE, TrainingGuard

STEPS = 8


def job(dump, *extra: str) -> list[str]:
    return [*TINY_JOB, "--training.steps", str(STEPS), "--training.global_batch_size", "4", "--metrics.log_freq", "1",
            "--lr_scheduler.min_lr_factor", "1", "--debug.deterministic", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(dump), *extra]


def run(dump, *extra: str) -> tuple[list[dict], str]:
    out = run_train(job(dump, *extra), nproc=2, env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return read_metrics(str(dump)), out.stdout + out.stderr


def load(checkpoint: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint + ".pt"
    dcp_to_torch_save(checkpoint, target)
    return torch.load(target, weights_only=False)


def flat(tree, prefix="") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in flat(sub, f"{prefix}/{i}").items()}
    return {}


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("skip")
    return dump, *run(dump, "--guard.policy", "skip", "--debug.inject_nonfinite_loss_steps", "5",
                      "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0")


@pytest.mark.dist
def test_skip_policy_skips_the_update_on_every_rank(skip_run):
    dump, records, log = skip_run
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    bad = records[4]
    assert bad["step"] == 5 and math.isnan(bad["loss"]) and bad["step_skipped"] is True
    assert bad["guard_action"] == "skip" and bad["guard_reason"].startswith("non-finite loss")
    assert all(math.isfinite(r["loss"]) for r in records if r["step"] != 5)
    assert records[-1]["guard_bad_steps"] == 1
    assert "guard: step 5 is bad: non-finite loss (nan); the optimizer step is skipped" in log
    # metrics.jsonl is strict JSON: the NaN loss is null plus a flag naming it (read_metrics restores it)
    raw = json.loads((dump / "metrics.jsonl").read_text().splitlines()[4], parse_constant=pytest.fail)
    assert raw["loss"] is None and raw["grad_norm"] is None
    assert raw["non_finite"] == {"loss": "nan", "grad_norm": "nan"}
    # Every rank skipped: the sharded weights and Adam state saved after step 5 are those of step 4.
    before, after = (flat(load(os.path.join(str(dump), "checkpoint", f"step-{s}"))) for s in (4, 5))
    state = [k for k in before if k.startswith(("/model", "/optimizer"))]
    assert len(state) > 20 and all(torch.equal(before[k], after[k]) for k in state)
    third = flat(load(os.path.join(str(dump), "checkpoint", "step-6")))
    assert not torch.equal(third["/model/norm.weight"], after["/model/norm.weight"])  # training goes on


@pytest.mark.dist
def test_rollback_restores_the_checkpoint_and_skips_the_window(skip_run, tmp_path):
    _, skipped, _ = skip_run
    records, log = run(tmp_path, "--guard.policy", "rollback", "--debug.inject_nonfinite_loss_steps", "5",
                       "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    assert records[4]["guard_action"] == "rollback" and math.isnan(records[4]["loss"])
    assert "rolled back from step 5 to step-4" in log
    retried = {r["step"]: r for r in records[5:]}
    by_step = {r["step"]: r for r in skipped}
    for step in (5, 6, 7):
        assert (retried[step]["loss"], retried[step]["grad_norm"]) == \
            (by_step[step + 1]["loss"], by_step[step + 1]["grad_norm"]), step
    assert [r["loss"] for r in records[:4]] == [r["loss"] for r in skipped[:4]]  # same run up to the NaN
    assert all(math.isfinite(r["loss"]) for r in records[5:])


@pytest.mark.dist
def test_abort_policy_exits_nonzero_after_consecutive_bad_steps(tmp_path):
    out = run_train(job(tmp_path, "--guard.policy", "abort", "--guard.max_consecutive_bad_steps", "2",
                        "--debug.inject_nonfinite_loss_steps", "3,4"), nproc=2, env={"OMP_NUM_THREADS": "1"})
    assert out.returncode != 0
    assert "guard: training stopped after 2 consecutive bad step(s)" in out.stderr
    assert "step 3: non-finite loss" in out.stderr and "step 4: non-finite loss" in out.stderr
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["guard_action"] == "skip" and records[3]["guard_action"] == "abort"


def test_rollback_needs_checkpoints():
    from torchtrain.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=r"\[guard.policy\] rollback .* --checkpoint.enable true"):
        parse_args(["--guard.policy", "rollback"])


def test_rollback_replay_replays_a_step_once_then_skips_its_data():
    """guard.rollback_replay: the first rollback from a bad step trains the same data again (a transient fault);
    the same step bad again is rolled back with its data skipped. (End to end, with the run bitwise equal to an
    undisturbed one, in tests/test_chaos.py.)"""
    from torchtrain.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=r"\[guard.rollback_replay\] applies to guard.policy = \"rollback\""):
        parse_args(["--guard.policy", "skip", "--guard.rollback_replay"])
    guard = TrainingGuard(Guard(policy="rollback", rollback_replay=True), [], True, torch.device("cpu"))
    assert guard.replay(7) and not guard.replay(7) and guard.replay(9)
    assert not TrainingGuard(Guard(policy="rollback"), [], True, torch.device("cpu")).replay(7)


# ------------------------------------------------------------------------------------- unit tests
def test_spike_rule_uses_the_window_of_good_steps():
    guard = TrainingGuard(Guard(policy="skip", spike_zscore=3.0, spike_window=4), [], True, torch.device("cpu"))
    for loss in (2.0, 2.1, 1.9, 2.0):
        assert guard.check(1, torch.tensor(loss), torch.tensor(1.0)) is None
    # mean 2.0, population std ~0.0707: 2.2 is 2.8 sigma (fine), 2.3 is 4.2 sigma (a spike)
    assert guard.classify(2.2, 1.0)[0] == OK
    code, reason = guard.classify(2.3, 1.0)
    assert code == SPIKE and "standard deviations above the mean" in reason
    assert guard.classify(0.5, 1.0)[0] == OK  # a sudden drop is not a failure
    assert guard.classify(2.0, float("inf"))[0] == NONFINITE
    assert guard.check(6, torch.tensor(2.3), torch.tensor(1.0)) == "skip"
    assert list(guard.window) == pytest.approx([2.0, 2.1, 1.9, 2.0])  # the spike does not enter the window
    assert guard.record()["guard_bad_steps"] == 1


def test_fp16_guard_leaves_gradient_overflow_to_the_scaler():
    guard = TrainingGuard(Guard(policy="skip"), [], check_grad_norm=False, device=torch.device("cpu"))
    assert guard.classify(2.0, float("inf"))[0] == OK


def test_gc_runs_only_at_step_boundaries():
    was = gc.isenabled()
    full = gc.get_stats()[2]["collections"]
    control = GarbageCollection(3)
    assert gc.get_stats()[2]["collections"] == full  # start-up collects the young generations, not the whole heap
    try:
        assert not gc.isenabled()
        before = gc.get_stats()[1]["collections"]
        for step in range(1, 8):
            control.step(step)
        assert control.collections == 2  # before steps 3 and 6
        assert gc.get_stats()[1]["collections"] - before == 2
        full = gc.get_stats()[2]["collections"]
    finally:
        control.close()
    assert gc.isenabled() == was
    assert gc.get_stats()[2]["collections"] == full  # no last full pass over the heap at close
    GarbageCollection(0).step(3)  # gc_freq 0: Python's automatic collection, nothing at boundaries
