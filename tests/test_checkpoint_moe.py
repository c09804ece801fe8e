"""Checkpoints of an MoE job under EP 2 x FSDP 2 (real torchrun + gloo): the experts are saved with
their global shapes, reshard to one process, and resume exactly.

* exact resume (same layout): per-step losses BITWISE equal to the uninterrupted run (weights, Adam
  moments of the split experts, the routing bias, data position and RNG all restored);
* reshard (EP 2 x FSDP 2 -> one process, same global batch): relative loss difference <= 1e-4 per
  step -- only the summation order of the reductions differs (as in tests/test_checkpoint.py), while a
  wrongly placed expert or a lost bias shows at 1e-2 or worse.
Three runs (two of 4 processes, one of one), ~1.5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_train
from test_checkpoint import ckpt, copy_step, load_all, losses, ok
from test_moe_parity import TINY_MOE

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
RTOL = 1e-4
EP2_FSDP2 = ["--parallelism.expert_parallel_degree", "2"]


def job(dump, *extra: str) -> list[str]:
    # A small bias step (DeepSeek-V3's order): 0.01 flips this tiny model's routing back and forth, so
    # the bias can return to exactly zero; at 0.001 it accumulates.
    return [*TINY_MOE, "--model.moe_load_balance_coeff", "0.001", "--training.steps", "8", "--metrics.log_freq", "1", "--debug.deterministic",
            "--metrics.enable_tensorboard", "false", "--job.print_config", "false", "--checkpoint.enable",
            "--checkpoint.interval", "4", "--job.dump_folder", str(dump), *extra]


@pytest.fixture(scope="module")
def ep_ref(tmp_path_factory):
    """The uninterrupted EP 2 x FSDP 2 run (4 ranks), saving steps 4 and 8."""
    dump = tmp_path_factory.mktemp("ep_ref")
    ok(run_train(job(dump, *EP2_FSDP2), nproc=4))
    return dump


def test_checkpoint_holds_global_expert_tensors_and_the_bias(ep_ref):
    state = load_all(ckpt(ep_ref, 4))
    w1 = state["model.layers.0.feed_forward.experts.w1"]
    assert tuple(w1.shape) == (8, 32, 64)  # (experts, hidden, dim): whole, not one rank's half
    assert tuple(state["optimizer.state.layers.1.feed_forward.experts.w2.exp_avg"].shape) == (8, 64, 32)
    bias = state["model.layers.1.feed_forward.expert_bias"]
    assert bias.abs().sum() > 0 and abs(bias.mean().item()) < 1e-6  # updated 4 times, centred


def test_exact_resume_under_expert_parallelism(ep_ref, tmp_path):
    copy_step(ep_ref, 4, tmp_path)
    out = ok(run_train(job(tmp_path, *EP2_FSDP2), nproc=4))
    assert f"resumed from {ckpt(tmp_path, 4)}" in out.stdout
    ref, got = losses(ep_ref), losses(tmp_path)
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == ref[s] for s in got), (ref, got)


def test_expert_parallel_checkpoint_reshards_to_one_process(ep_ref, tmp_path):
    copy_step(ep_ref, 4, tmp_path)
    out = ok(run_train(job(tmp_path)))  # one process, no torchrun
    assert "resharded" in out.stdout
    ref, got = losses(ep_ref), losses(tmp_path)
    assert sorted(got) == [5, 6, 7, 8]
    for s in got:
        assert abs(got[s] - ref[s]) <= RTOL * abs(ref[s]), (s, ref[s], got[s])
    # the resumed bias is the saved one: the last step's weights agree with the EP run's
    final_ep, final_one = load_all(ckpt(ep_ref, 8)), load_all(ckpt(tmp_path, 8))
    key = "model.layers.0.feed_forward.expert_bias"
    torch.testing.assert_close(final_one[key], final_ep[key], rtol=0, atol=1e-6)


def test_hf_weights_load_into_an_expert_parallel_job(tmp_path):
    """A Hugging Face Qwen3-MoE folder (per-expert tensors) streamed into EP 2 x FSDP 2 (each rank keeps
    its experts' shards) trains exactly like one process that loaded the same folder (1e-4 per step)."""
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    from conftest import ParitySuite

    config = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         norm_topk_prob=True, max_position_embeddings=64, rope_theta=1e6,
                                         initializer_range=0.1)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "hf")
    load = ["--model.hidden_dim", "128", "--checkpoint.enable", "--checkpoint.interval", "100",
            "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"]
    suite = ParitySuite(str(tmp_path / "runs"), TINY_MOE + load, steps=3)
    assert "model weights loaded from the Hugging Face folder" in suite.baseline.log
    run, = suite.check(["ep2_fsdp2"], rtol=RTOL)
    assert "model weights loaded from the Hugging Face folder" in run.log
