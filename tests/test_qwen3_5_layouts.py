"""Qwen3.5 (hybrid linear/full attention) under every layout matches one process step for step (real
torchrun + gloo, fp32). The model: four blocks, linear attention in blocks 0, 1 and 3 and full attention in
block 2; 64-token sequences of packed documents (block-causal: the recurrent state and the convolutions reset
at each document start, and every layout must agree on where).

* dense: FSDP 2; TP 2 with sequence parallelism (linear heads split with their convolution channels and
  decay parameters); PP 2 (stages of two blocks: one all linear, one mixing both kinds); full activation
  checkpointing; CP 2 with the load-balanced split (four chunks of 16 tokens: every linear layer receives
  the recurrent state and the convolution context across three chunk boundaries, two of them between
  ranks) and with the contiguous split; TP 2 x CP 2 on 4 ranks, FSDP sharding over the two CP ranks (FSDP's
  mesh is dp_shard x cp); and the FSDP run resumed from its
  step-2 checkpoint, bitwise;
* MoE (four experts, a gated shared expert): EP 2, and EP 2 x TP 2.

Tolerance: relative difference <= 1e-4 per step for 4 steps, loss and gradient norm (the acceptance bound
of tests/test_distributed.py): layouts differ in summation order only (~1e-7 on the loss here); a state or
a convolution tap lost at a chunk boundary moves the loss by 1e-3 or more from the first step.
"""

from __future__ import annotations

import pytest
from conftest import ParitySuite

pytestmark = pytest.mark.dist
RTOL = 1e-4
P = "--parallelism."
SHAPE = ["--model.name", "qwen3_5", "--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.head_dim", "16", "--model.vocab_size", "512",
         "--model.full_attention_interval", "3", "--model.linear_num_key_heads", "2",
         "--model.linear_num_value_heads", "4", "--model.linear_key_head_dim", "16", "--model.linear_value_head_dim",
         "16", "--model.linear_attn_chunk_size", "8", "--model.attention_mask", "block_causal",
         "--training.dataset", "synthetic", "--training.seq_len", "64",
         "--training.local_batch_size", "2", "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2",
         "--optimizer.lr", "3e-3"]
DENSE = [*SHAPE, "--model.flavor", "debugmodel", "--model.hidden_dim", "128"]
MOE = ("--model.flavor", "debugmodel_moe", "--model.num_experts", "4", "--model.num_experts_per_tok", "2",
       "--model.moe_intermediate_size", "32")  # the MoE flavor: a variant of the dense job, in the same launches
CP_CONTIGUOUS = f"2 {P}context_parallel_degree 2 {P}context_parallel_load_balancer none"
FSDP_TP_CP = f"4 {P}tensor_parallel_degree 2 {P}context_parallel_degree 2"  # FSDP shards over the CP ranks
DENSE_LAYOUTS = ["tp2", "pp2_1f1b", "ac_full", "cp2", CP_CONTIGUOUS, FSDP_TP_CP]
STEPS = 4
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]
EP_TP = f"4 {P}tensor_parallel_degree 2 {P}expert_parallel_degree 2"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return ParitySuite(str(tmp_path_factory.mktemp("qwen3_5_dense")), DENSE, STEPS,
                       layouts=[("fsdp2", CKPT), *DENSE_LAYOUTS, ("single", MOE), ("ep2", MOE), (EP_TP, MOE)])


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_dense_layout_matches_one_process(dense, layout):
    run, = dense.check([layout], rtol=RTOL)
    assert len(run.records) == STEPS


def test_fsdp_matches_one_process_and_resumes_bitwise(dense):
    dense.check_resumes_bitwise("fsdp2", 2, CKPT, rtol=RTOL)


def test_moe_under_expert_parallelism(dense):
    dense.check(["ep2", EP_TP], rtol=RTOL, extra=MOE)
