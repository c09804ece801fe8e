"""gpt-oss under every layout matches one process step for step (real torchrun + gloo, fp32): FSDP 2,
TP 2 (with sequence parallelism; the experts over the same two ranks by EP, as an MoE model's TP needs),
EP 2, PP 2 (one block per stage: a sliding-window stage and a full-attention one), CP 2 (each rank a
head and a tail chunk, or one contiguous half: the 24-token sliding window reaches across chunks, and each
query's sink joins its softmax once), and EP 2 x TP 2 on 4 ranks; then the FSDP run resumes bitwise.

Tolerance: relative difference <= 1e-4 per step for 4 steps, loss and gradient norm (the acceptance
bound of tests/test_distributed.py): every layout starts from identical weights and reads the same
global batch; only summation order differs (~1e-7 on the loss here), while a sink counted once per CP
shard, a window cut at a shard edge or a sink taken from another rank's heads moves the loss by 1e-3 or
more. Exact resume: the FSDP 2 run saves step 2; a second run resumes from it and its steps 3-4 are
bitwise the first run's.
"""

from __future__ import annotations

import pytest
from conftest import ParitySuite

pytestmark = pytest.mark.dist
RTOL = 1e-4
P = "--parallelism."
TINY_GPT_OSS = ["--model.name", "gpt_oss", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "8",
                "--model.n_kv_heads", "4", "--model.head_dim", "16", "--model.vocab_size", "512",
                "--model.num_experts", "4", "--model.num_experts_per_tok", "2", "--model.moe_intermediate_size", "32",
                "--model.sliding_window", "24", "--training.dataset", "synthetic", "--training.seq_len", "64",
                "--training.local_batch_size", "2", "--training.global_batch_size", "8",
                "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3"]
TP2 = f"2 {P}tensor_parallel_degree 2 {P}expert_parallel_degree 2"
EP2_TP2 = f"4 {P}tensor_parallel_degree 2 {P}expert_parallel_degree 2"
CP_CONTIGUOUS = f"2 {P}context_parallel_degree 2 {P}context_parallel_load_balancer none"
LAYOUTS = [TP2, "ep2", "pp2_1f1b", "cp2", CP_CONTIGUOUS, EP2_TP2]
STEPS = 4
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """One process and every layout (the FSDP run saving step 2): one launch per process count."""
    return ParitySuite(str(tmp_path_factory.mktemp("gpt_oss_layouts")), TINY_GPT_OSS, STEPS,
                       layouts=[("fsdp2", CKPT), *LAYOUTS])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_process(suite, layout):
    run, = suite.check([layout], rtol=RTOL)
    assert len(run.records) == STEPS


def test_fsdp_matches_one_process_and_resumes_bitwise(suite):
    suite.check_resumes_bitwise("fsdp2", 2, CKPT, rtol=RTOL)
