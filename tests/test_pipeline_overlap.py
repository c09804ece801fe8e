"""DualPipeV with concurrently run forward/backward pairs (`parallelism.expert_parallel_overlap_f_b`;
real torchrun + gloo, fp32, 4 ranks: PP 2 x EP 2, the dense weights FSDP-sharded over the 2 data ranks).

The overlapped run matches one process step for step over 6 steps, with activation checkpointing (so
recomputed forwards, inside the concurrent backward, issue all-to-alls too), and resumes exactly.
Tolerance: relative difference <= 1e-4 per step, loss and gradient norm (the acceptance bound of
tests/test_moe_parity.py): only the summation order of the data-parallel reduction differs (~1e-7
here). Exact resume: the run saves step 3, a second run resumes from it; its steps 4-6 are BITWISE
the first run's.
"""

from __future__ import annotations

import pytest
from conftest import ParitySuite
from test_moe_parity import SHAPE

pytestmark = [pytest.mark.dist, pytest.mark.slow]
RTOL = 1e-4
P = "--parallelism."
# 4 layers for DualPipeV's 4 stages; local batch 4 = 4 micro-batches (DualPipeV needs >= 4)
MOE = ["--model.name", "qwen3_moe", *SHAPE, "--model.n_layers", "4", "--model.num_experts", "8",
       "--model.num_experts_per_tok", "2", "--model.moe_intermediate_size", "32", "--model.moe_load_balance_coeff",
       "0.01", "--training.dataset", "synthetic", "--training.seq_len", "64", "--training.local_batch_size", "4",
       "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
       "--activation_checkpoint.mode", "full"]
OVERLAP = (f"4 {P}pipeline_parallel_degree 2 {P}expert_parallel_degree 2 {P}pipeline_parallel_schedule DualPipeV "
           f"{P}expert_parallel_overlap_f_b true")
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, the overlapped layout (saving step 3), then the overlapped layout resumed from step 3."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # the one-process run with one thread, as torchrun's workers have
        suite = ParitySuite(str(tmp_path_factory.mktemp("pipeline_overlap")), MOE, layouts=[(OVERLAP, CKPT)])
    first, = suite.check([OVERLAP], rtol=RTOL, extra=CKPT)
    return first, suite.resume(OVERLAP, 3, CKPT)


def test_overlapped_pairs_run_concurrently_and_match_one_process(runs):
    first, _ = runs
    assert len(first.records) == 6
    assert "forward/backward pairs ran concurrently in the first step" in first.log, first.log[-3000:]


def test_overlapped_run_resumes_exactly(runs):
    first, resumed = runs
    assert [r["step"] for r in resumed.records] == [4, 5, 6]
    for a, b in zip(first.records[3:], resumed.records):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a["step"], a, b)
