"""The planner on float16 jobs: the traced step runs the trainer's dynamic loss scaling
(trainer/precision.py) on fake tensors, which hold no value to read back -- neither the scale nor the
found-inf flags -- with the fused optimizers (which take the flags as tensors) and the others.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_JOB
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtrain.planner import trace
from torchtrain.planner.core import load_job, plan_from_flags, trace_job
from torchtrain.planner.from_job import inputs_from_config
from torchtrain.trainer.precision import LossScaler

FP16_JOB = list(TINY_JOB) + ["--model.n_layers", "4", "--training.local_batch_size", "4",
                             "--training.mixed_precision_param", "float16"]


@pytest.mark.parametrize("world", [1, 2])  # torch's GradScaler; FSDP's sharded one
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_float16_jobs_are_planned_with_a_traced_step(impl, world):
    job = load_job(FP16_JOB + ["--optimizer.implementation", impl])
    plan = plan_from_flags(job, world, "h100", {})
    assert plan.valid and not plan.blockers, plan.problems + plan.blockers
    assert plan.inputs.param_dtype == "float16" and plan.inputs.optimizer_impl == impl
    rank = plan.ranks[0]
    assert rank.trace.skipped is None, rank.trace.skipped
    assert rank.traced_peak > 0 and plan.throughput.step_s > 0


def test_float16_fake_tensors_measure_what_real_tensors_use():
    job = load_job(FP16_JOB)
    p = inputs_from_config(job.cfg, job.args, 2, "cpu", None, {})
    cfg = trace_job(p)
    fake, real = trace.trace_rank(p, cfg), trace.trace_rank(p, cfg, fake=False)
    assert real.skipped is None and fake.skipped is None
    assert (fake.backward, fake.optimizer) == (real.backward, real.optimizer)


@pytest.mark.parametrize("fused", [True, False])
def test_a_scaler_that_reads_nothing_back_steps_fake_tensors(fused):
    scaler = LossScaler(True, sharded=False, device=torch.device("cpu"))
    scaler.reads_back = False
    with FakeTensorMode():
        model = nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters(), fused=fused, foreach=not fused)
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        assert scaler.factor == 2.0**16  # the scale is a tensor now: its initial value, not read
        scaler.unscale_([opt])
        assert scaler.step([opt]) is True
    assert all("exp_avg" in opt.state[q] for q in model.parameters())  # the optimizer stepped
    assert scaler.skipped_steps == 0
