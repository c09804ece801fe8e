"""Qwen3-MoE under expert parallelism (and Qwen3 dense under FSDP x TP) matches one process, step
for step, under real torchrun + gloo in fp32: EP 2; EP 2 x FSDP 2; EP 2 x TP 2; PP 2 x EP 2; CP 2 x EP 2.

Tolerance: relative difference <= 1e-4 per step for 6 steps, loss and gradient norm (the acceptance
bound, as in tests/test_distributed.py). Every layout starts from identical weights (experts included:
the initialisation is keyed by global name and shape, whatever EP splits) and reads the same global
batch of 8 sequences; routing is dropless and computed on each token's own rank, so the only
differences are floating-point summation order (~1e-7 on the loss here). Both balancing modes are on
(the auxiliary loss at Qwen's 0.001 and the routing bias at 0.01), so a wrong aux-loss scale or a
bias update from other counts than one process's would show within a few steps.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, ParitySuite

pytestmark = pytest.mark.dist
RTOL = 1e-4
DATA = ["--training.dataset", "synthetic", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3"]
SHAPE = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "8", "--model.n_kv_heads", "4",
         "--model.head_dim", "16", "--model.vocab_size", "512"]
TINY_MOE = ["--model.name", "qwen3_moe", *SHAPE, "--model.num_experts", "8", "--model.num_experts_per_tok", "2",
            "--model.moe_intermediate_size", "32", "--model.moe_load_balance_coeff", "0.01", *DATA]
TINY_QWEN3 = ["--model.name", "qwen3", *SHAPE, "--model.hidden_dim", "128", *DATA]


EP_LAYOUTS = ["ep2", "ep2_fsdp2", "ep2_tp2", "pp2_ep2", "cp2_ep2"]


@pytest.fixture(scope="module")
def moe_suite(tmp_path_factory):
    """The layouts trained up front: one launch per process count (2, 4)."""
    return ParitySuite(str(tmp_path_factory.mktemp("moe_parity")), TINY_MOE, layouts=EP_LAYOUTS)


@pytest.mark.parametrize("layout", EP_LAYOUTS)
def test_expert_parallel_layouts_match_one_process(moe_suite, layout):
    run, = moe_suite.check([layout], rtol=RTOL)
    assert len(run.records) == 6
    last = run.records[-1]
    assert "moe_aux_loss" in last and "moe_load_max_mean/layers_0-0" in last and "moe_load_max_mean/layers_1-1" in last
    if layout == "ep2":  # the logged expert loads are global: equal to one process's
        base = moe_suite.baseline.records[-1]
        assert last["moe_load_max_mean"] == base["moe_load_max_mean"]
        assert last["moe_aux_loss"] == pytest.approx(base["moe_aux_loss"], rel=1e-5)


def test_qwen3_dense_fsdp2_x_tp2_matches_one_process(tmp_path):
    ParitySuite(str(tmp_path), TINY_QWEN3).check(["fsdp2_tp2"], rtol=RTOL)


def test_expert_weights_initialise_identically_under_expert_parallelism():
    """Experts split over 2 EP ranks and FSDP-sharded over 2 more (2-D DTensors) hold exactly the
    single-process initial values (init keyed by global name and shape, not by the rank's slice)."""
    cmd = [sys.executable, "-m", "torchtrain.launcher", "--nproc_per_node=4", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", os.path.join(REPO, "tests", "scripts", "check_init.py"), *TINY_MOE,
           "--parallelism.expert_parallel_degree", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0 and "INIT-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
