"""One train step for training, the dry run and the planner's trace (trainer/step_factory.py), and its
typed result.

* the package constructs `TrainStep` in exactly one place, and the trainer, the dry run and the
  planner's trace all build their step through `build_train_step`;
* the dry run's and the trace's steps carry what the job asks of the step: the z-loss, the MoE
  balancer and the model's extra losses (multi-token prediction), with and without pipelining;
* `StepResult.metrics` is the step's part of the metrics record.
"""

from __future__ import annotations

import ast
import os

import pytest
import torch
from conftest import REPO

import torchtrain.trainer.step_factory as step_factory
from torchtrain.trainer.step import StepResult

PACKAGE = os.path.join(REPO, "torchtrain")
# DeepSeek-V3's debug model (MoE blocks) with multi-token prediction and the z-loss, small
MOE_MTP_JOB = ["--job.config_file", f"{REPO}/train_configs/deepseek_v3_debug.toml", "--training.z_loss", "1e-4",
               "--model.mtp_depth", "1", "--training.seq_len", "64", "--training.local_batch_size", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]


def _calls(name: str) -> list[str]:
    """Package files (relative paths) with a call of `name` (as a bare name or an attribute)."""
    out = []
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Call):
                    func = node.func
                    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                    if called == name:
                        out.append(os.path.relpath(path, REPO))
    return out


def test_train_step_is_constructed_in_one_place_that_every_runner_calls():
    assert _calls("TrainStep") == ["torchtrain/trainer/step_factory.py"]
    assert sorted(_calls("build_train_step")) == ["torchtrain/planner/trace.py", "torchtrain/simulation/dry_run.py",
                                                  "torchtrain/trainer/trainer.py"]


@pytest.fixture
def built(monkeypatch):
    """Every step `build_train_step` builds (the callers import it when they run)."""
    steps = []
    original = step_factory.build_train_step

    def spy(*args, **kwargs):
        steps.append(original(*args, **kwargs))
        return steps[-1]

    monkeypatch.setattr(step_factory, "build_train_step", spy)
    return steps


def _carries_the_jobs_step_options(step, extra_losses: bool = True) -> None:
    assert step.loss_fn.z_weight == pytest.approx(1e-4)
    assert step.moe is not None and step.max_norm == 1.0
    assert (step.extra_losses is not None) == extra_losses


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [False, True], ids=["whole", "pp2"])
def test_the_dry_run_steps_with_the_jobs_z_loss_moe_and_extra_losses(built, pipeline):
    from torchtrain.simulation.dry_run import dry_run

    result = dry_run(MOE_MTP_JOB + (PP2 if pipeline else []), world=2, ranks=[0, 1], steps=1, device_type="cpu")
    assert len(built) == 2 and all(run.steps == 1 for run in result.ranks)
    if pipeline:  # rank 0 runs the first stage, rank 1 the last (which holds the MTP block)
        assert [type(s.pipeline).__name__ for s in built] == ["StagePipeline"] * 2
        _carries_the_jobs_step_options(built[0], extra_losses=False)
        _carries_the_jobs_step_options(built[1])
        assert built[1].tied is not None  # the embedding both stages hold (distributed/tied_stages.py)
    else:
        for step in built:
            _carries_the_jobs_step_options(step)


@pytest.mark.parametrize("pipeline", [False, True], ids=["whole", "pp2"])
def test_the_planners_trace_steps_with_the_jobs_z_loss_moe_and_extra_losses(built, pipeline):
    from torchtrain.planner.core import load_job, make_plan
    from torchtrain.planner.from_job import inputs_from_config

    job = load_job(MOE_MTP_JOB)
    flags = {"pp": 2, "pp_microbatch_size": 1} if pipeline else {}
    plan = make_plan(job, inputs_from_config(job.cfg, job.args, 2, "cpu", None, flags))
    assert all(rank.trace.skipped is None for rank in plan.ranks)
    assert built and built[-1].loss_fn.z_weight == pytest.approx(1e-4) and built[-1].moe is not None
    assert any(step.extra_losses is not None for step in built)


def test_step_result_metrics():
    result = StepResult(torch.tensor(2.5), torch.tensor(0.5), 1e-3, torch.tensor(64), True)
    assert result.metrics() == {"loss": 2.5, "grad_norm": 0.5, "lr": 1e-3}
    full = StepResult(torch.tensor(2.5), torch.tensor(0.5), 1e-3, torch.tensor(64), False, "rollback",
                      z_loss=torch.tensor(0.25), moe=torch.ones(2), extra_losses=torch.tensor([0.75]),
                      moe_record=lambda stats: {"moe_load_max_mean": float(stats.sum())},
                      extra_record=lambda stats: {"mtp_loss": float(stats[0])})
    assert list(full.metrics().items()) == [("loss", 2.5), ("grad_norm", 0.5), ("lr", 1e-3),
                                            ("moe_load_max_mean", 2.0), ("z_loss", 0.25), ("mtp_loss", 0.75)]
