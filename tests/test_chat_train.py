"""Fine-tuning on chat data end to end (real torchrun): a synthetic chat set whose user turns are
random letters and whose answers follow a fixed rule (scripts/synthetic_chat.py).

* Only the answers count: the logged loss falls far below log(26) ~ 3.26 nats, the entropy of each
  user letter, which a loss that counted the user turns could never go under.
* FSDP over 2 ranks matches one process step by step within 1e-4 relative (the project's parity
  tolerance: only the order of float32 summations differs), and both log the same answer-token
  counts (the loss is normalised by the answer tokens of the whole global batch); the same for LoRA
  (frozen and trainable parameters sharded together), which also learns.
* Full fine-tuning under tensor parallelism (2 ranks) and pipeline parallelism (2 stages, 4
  micro-batches) matches one process the same way: packed rows with per-conversation positions and
  answer-only labels go through every layout.

One launch per layout, shared by the module."""

from __future__ import annotations

import math
import os
import sys

import pytest
from conftest import TINY_MODEL, read_metrics, run_train

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from synthetic_chat import write_task  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # six short launches (~35 s together)
STEPS = 25
LORA_STEPS = 10
JOB = TINY_MODEL + ["--model.attention_mask", "block_causal", "--training.dataset", "chat",
                    "--training.seq_len", "128", "--training.global_batch_size", "4", "--training.steps", str(STEPS),
                    "--lr_scheduler.warmup_steps", "3", "--optimizer.lr", "1e-2", "--metrics.log_freq", "1",
                    "--job.print_config", "false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    data = str(root / "task.jsonl")
    write_task(data, 400, seed=1)
    held_out = str(root / "held_out.jsonl")
    write_task(held_out, 60, seed=2)
    validation = ["--validation.enable", "true", "--validation.dataset", "chat", "--validation.dataset_path", held_out,
                  "--validation.freq", str(STEPS)]
    out = {}
    lora = ["--lora.enable", "true", "--training.steps", str(LORA_STEPS), "--lora.target_modules",
            "*.attention.wq,*.attention.wv,*.feed_forward.w2"]
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
    for name, nproc, local, extra in (("single", None, "4", validation), ("fsdp2", 2, "2", validation),
                                      ("lora_single", None, "4", lora), ("lora_fsdp2", 2, "2", lora),
                                      ("tp2", 2, "4", tp), ("pp2", 2, "4", pp)):
        folder = str(root / name)
        proc = run_train([*JOB, "--training.dataset_path", data, "--training.local_batch_size", local,
                          "--job.dump_folder", folder, *extra], nproc=nproc, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out[name] = (read_metrics(folder), proc.stdout + proc.stderr)
    return out


def test_loss_on_answers_only_falls_below_the_user_turns_entropy(runs):
    metrics, log = runs["single"]
    losses = [m["loss"] for m in metrics]
    assert len(losses) == STEPS and losses[0] > math.log(26)
    assert sum(losses[-5:]) / 5 < 0.4 * math.log(26), losses
    assert all(m["answer_tokens"] > 0 for m in metrics)
    held_out = metrics[-1]["validation_loss"]  # a held-out chat set, answers only, packed the same way
    assert held_out < 0.4 * math.log(26)
    assert runs["fsdp2"][0][-1]["validation_loss"] == pytest.approx(held_out, rel=1e-4)
    assert "packing efficiency" in log and "answer tokens per epoch" in log


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_match_one_process(runs, layout):
    single, other = runs["single"][0], runs[layout][0]
    assert [m["answer_tokens"] for m in single] == [m["answer_tokens"] for m in other]
    for a, b in zip(single, other, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (layout, a["step"], a["loss"], b["loss"])


@pytest.mark.parametrize("prefix", ["", "lora_"])
def test_fsdp_matches_one_process(runs, prefix):
    single, fsdp = runs[prefix + "single"][0], runs[prefix + "fsdp2"][0]
    assert [m["answer_tokens"] for m in single] == [m["answer_tokens"] for m in fsdp]
    for a, b in zip(single, fsdp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])


def test_lora_learns_and_differs_from_full_fine_tuning(runs):
    lora, full = runs["lora_single"][0], runs["single"][0]
    assert lora[0]["loss"] == pytest.approx(full[0]["loss"], rel=1e-6)  # B = 0: the base model at step 1
    assert lora[-1]["loss"] < lora[0]["loss"] - 0.2
    assert lora[-1]["loss"] != pytest.approx(full[LORA_STEPS - 1]["loss"], rel=1e-3)
