"""A model family from outside the package (tests/plugins/toy_decoder.py: the package's attention block beside
a squared-ReLU feed-forward of its own, one `register_decoder` call) trains under FSDP 2, TP 2 and CP 2 like
one process, and the planner plans it -- with no file of the package naming it.

Tolerance: relative difference <= 1e-4 per step for loss and gradient norm (tests/test_distributed.py's
bound): the layouts differ in summation order only; a wrong TP plan for the new block kind (a missing
all-reduce, a sequence shard read as the whole) moves the loss by 1e-2 or more from the first step.
The planner: it traces the family's step on every layout (tests/test_planner_accuracy.py holds the trace to
real training), the contract counts the module's parameters, and the analytic estimate, which reads the new
feed-forward's memory from its declaration (`Block.feed_forward`), is within 10% of the trace (observed 4-6%;
the package's Llama 3 at this size: 3-5%)."""

from __future__ import annotations

import pathlib

import pytest
from conftest import PLUGINS, REPO, ParitySuite

PLUGIN = ["--job.custom_imports", "toy_decoder", "--model.name", "toy_decoder", "--model.flavor", "small"]
JOB = PLUGIN + ["--training.dataset", "synthetic", "--training.seq_len", "64", "--training.local_batch_size", "2",
                "--training.global_batch_size", "4", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
                "--job.print_config", "false"]
LAYOUTS = ["fsdp2", "tp2", "cp2"]
STEPS = 4


def test_no_package_file_names_the_plugin():
    package = pathlib.Path(REPO, "torchtrain")
    naming = [str(f.relative_to(REPO)) for f in package.rglob("*") if f.is_file() and f.suffix in (".py", ".md", ".toml")
              and "toy_decoder" in f.read_text(errors="replace")]
    assert not naming, naming


@pytest.mark.dist
def test_a_family_from_outside_the_package_trains_under_fsdp_tp_and_cp(tmp_path):
    ParitySuite(str(tmp_path), JOB, STEPS, layouts=LAYOUTS).check(LAYOUTS)


@pytest.mark.parametrize("layout", [[], ["--parallelism.tensor_parallel_degree", "2"],
                                    ["--parallelism.context_parallel_degree", "2"]], ids=["fsdp2", "tp2", "cp2"])
def test_the_planner_plans_it(monkeypatch, layout):
    from torchtrain.models.registry import get_model_spec
    from torchtrain.planner.core import load_job, plan_from_flags

    monkeypatch.syspath_prepend(PLUGINS)
    job = load_job(JOB + layout)
    model = get_model_spec("toy_decoder").model_cls(job.args)
    assert job.args.num_params() == sum(p.numel() for p in model.parameters())
    plan = plan_from_flags(job, 2, "cpu", {})
    rank0 = plan.ranks[0]
    assert plan.valid and rank0.trace is not None and rank0.trace.skipped is None, rank0.trace
    assert abs(rank0.analytic.peak - rank0.traced_peak) <= 0.10 * rank0.traced_peak, (
        rank0.analytic.peak, rank0.traced_peak)
