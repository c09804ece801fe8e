"""The fake-backend dry run (python -m torchtrain.dryrun, docs/dry_run.md): the trainer's build and step for
ranks of a large world, in this one process, with every collective's shapes checked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import REPO

from torchtrain.dryrun import main
from torchtrain.simulation.collective_log import CollectiveLog, CollectiveMismatch
from torchtrain.simulation.dry_run import dry_run
from torchtrain.simulation.fake_world import fake_world

# Llama 3 8B's shapes (2 of its 32 blocks, a shorter sequence: the per-block work is what is checked) at
# 64 ranks: FSDP 8 x TP 8, float8 with float8 all-gather (torchtitan's 405B recipe), checked for CUDA.
JOB_8B_64 = ["--job.config_file", f"{REPO}/train_configs/llama3_8b.toml", "--model.n_layers", "2",
             "--training.seq_len", "256", "--parallelism.tensor_parallel_degree", "8", "--model.converters", "float8",
             "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
             "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true",
             "--quantize.linear.float8.filter_fqns", "output"]


@pytest.mark.slow
def test_dry_run_of_8b_at_64_ranks():
    result = dry_run(JOB_8B_64, world=64, steps=1)
    first, last = result.ranks
    assert (first.rank, last.rank) == (0, 63) and last.coords == {"dp_shard": 7, "tp": 7}
    assert first.collectives == last.collectives and len(first.collectives) > 20
    ops = {(c.group, c.op) for c in first.collectives}
    assert ("dp_shard", "_allgather_base_") in ops and ("dp_shard", "_reduce_scatter_base_") in ops  # FSDP
    assert any(group == "tp" for group, _ in ops)  # TP's functional collectives
    assert "float8" in result.description and "dp_shard 8 x tp 8" in result.description
    assert not dist.is_initialized()  # the fake world is gone


def test_a_collective_with_inconsistent_shapes_is_caught():
    with fake_world(4, rank=0):
        log = CollectiveLog()
        with log, pytest.raises(CollectiveMismatch, match="is not 4 x"):
            dist.all_gather_into_tensor(torch.empty(12), torch.empty(4))
        assert log.records[-1].op == "_allgather_base_" and log.records[-1].group == "4 ranks"


def test_cli_reports_a_bad_job_in_one_line(capsys):
    assert main(["--world-size", "6", "--job.config_file", f"{REPO}/train_configs/llama3_8b.toml",
                 "--parallelism.tensor_parallel_degree", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchtrain: config error:") and err.count("\n") == 1
