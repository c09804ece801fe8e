"""Qwen3.5 with its vision encoder under every layout matches one process step for step (real torchrun +
gloo, fp32), on image chat data: pictures of different sizes (16 to 64 patches each, 4 to 16 decoder tokens)
packed with their conversations into 128-token rows (block-causal, positions restarting per conversation).

* dense: FSDP 2 (and resumed from its step-2 checkpoint mid-epoch, bitwise); TP 2 with sequence
  parallelism (the encoder's heads and MLP split, the embedded text whole until the images join it);
  PP 2 (the encoder on the first stage); CP 2 (the images scattered before the sequence is cut, every
  rank's encoder gradients summed); FSDP 2 x TP 2 on 4 ranks;
* MoE: EP 2.

Tolerance: relative difference <= 1e-4 per step for 4 steps, loss and gradient norm (the acceptance bound
of tests/test_distributed.py): layouts differ in summation order only; a feature scattered into the wrong
placeholder, a lost image gradient or a position off by one moves the loss by 1e-3 or more.
"""

from __future__ import annotations

import os

import pytest
from conftest import ParitySuite
from vlm_assets import MODEL, write_tokenizer

pytest.importorskip("PIL", reason="Pillow not installed (pip install -e .[vision])")
pytestmark = pytest.mark.dist
RTOL = 1e-4
STEPS = 4
P = "--parallelism."
DENSE_LAYOUTS = ["tp2", "pp2_1f1b", "cp2", f"4 {P}tensor_parallel_degree 2"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]
MOE = ("--model.flavor", "debugmodel_moe_vl", "--model.num_experts", "4", "--model.num_experts_per_tok", "2",
       "--model.moe_intermediate_size", "32")  # the MoE flavor: a variant of the dense job, in the same launches


def job(root: str) -> list[str]:
    from torchtrain.tools.shapes import write

    write(root, train=96, test=0, seed=3)
    write_tokenizer(os.path.join(root, "tokenizer"))
    return [*MODEL, "--model.hf_assets_path", os.path.join(root, "tokenizer"), "--training.dataset", "chat",
            "--training.dataset_path", os.path.join(root, "train.jsonl"), "--training.seq_len", "128",
            "--training.local_batch_size", "2", "--training.global_batch_size", "8",
            "--images.min_pixels", "1024", "--images.max_pixels", "4096", "--lr_scheduler.warmup_steps", "2",
            "--optimizer.lr", "3e-3"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vlm"))
    return ParitySuite(root, job(root), STEPS, layouts=[("fsdp2", CKPT), *DENSE_LAYOUTS, ("single", MOE), ("ep2", MOE)])


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_layout_matches_one_process(dense, layout):
    run, = dense.check([layout], rtol=RTOL)
    assert len(run.records) == STEPS


def test_fsdp_matches_one_process_and_resumes_mid_epoch_bitwise(dense):
    dense.check_resumes_bitwise("fsdp2", 2, CKPT, rtol=RTOL)


def test_moe_under_expert_parallelism(dense):
    dense.check(["ep2"], rtol=RTOL, extra=MOE)
