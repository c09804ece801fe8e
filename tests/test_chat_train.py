"""Fine-tuning on chat data end to end (real torchrun): a synthetic chat set whose user turns are
random letters and whose answers follow a fixed rule (scripts/synthetic_chat.py).

* Only the answers count: the logged loss falls far below log(26) ~ 3.26 nats, the entropy of each
  user letter, which a loss that counted the user turns could never go under.
* FSDP over 2 ranks matches one process step by step within 1e-4 relative (the project's parity
  tolerance: only the order of float32 summations differs), and both log the same answer-token
  counts (the loss is normalised by the answer tokens of the whole global batch) and the same
  held-out loss. LoRA learns.
* Full fine-tuning under tensor parallelism and pipeline parallelism (one launch: TP 2 x PP 2, 2
  stages, 4 micro-batches) matches one process the same way over its first steps: packed rows with per-conversation
  positions and answer-only labels go through every layout.
* Every layout matches one process the same way, the remaining ones composed in 4-rank launches:
  full fine-tuning and LoRA under HSDP with context parallelism (2 replicas x CP 2, FSDP over the CP
  ranks: for LoRA, frozen and trainable parameters sharded together); LoRA under TP 2 x PP 2 with full
  activation checkpointing (adapters sharded with the column- and row-parallel base weights, frozen
  inputs to checkpointed blocks); and, on a Qwen3-MoE model (adapters on the attention, experts
  frozen), EP 2 against its own one-process run. (Full fine-tuning under EP is the pre-training path:
  tests/test_moe_parity.py.)
* Adapter-only checkpoints (`lora.save_adapter_only`): a LoRA run starts from the last checkpoint of
  the full fine-tuning run (a checkpoint without adapters: base weights loaded, adapters fresh), saves
  the adapters alone, and a resume from them (base weights from the initial load again) continues
  with exactly the losses of the uninterrupted run.

One launch per process count (its jobs one after another), shared by the module."""

from __future__ import annotations

import math
import os
import shutil
import sys

import pytest
from conftest import TINY_MODEL, read_metrics, run_together, run_train

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from synthetic_chat import write_task  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # four launches: one per process count, and a resume
STEPS = 25
LORA_STEPS = 10
PARITY_STEPS = 6  # the 4-rank full fine-tuning layouts: parity shows from step 1, against single's first steps
JOB = TINY_MODEL + ["--model.attention_mask", "block_causal", "--training.dataset", "chat",
                    "--training.seq_len", "128", "--training.global_batch_size", "4", "--training.steps", str(STEPS),
                    "--lr_scheduler.warmup_steps", "3", "--lr_scheduler.decay_ratio", "0.7", "--optimizer.lr", "1e-2", "--metrics.log_freq", "1",
                    "--job.print_config", "false"]


MOE = ["--model.name", "qwen3_moe", "--model.head_dim", "16", "--model.vocab_size", "512", "--model.num_experts", "8",
       "--model.num_experts_per_tok", "2", "--model.moe_intermediate_size", "32"]
MOE_STEPS = 5
# one intra-op thread per process, as torchrun gives each worker: on a shared 2-core machine a second
# thread only spins (same results, about half the CPU time of a one-process run)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


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
    full_ac = ["--activation_checkpoint.mode", "full"]
    hsdp_cp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.context_parallel_degree", "2"]
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", str(LORA_STEPS // 2)]
    from_full = [*lora, *ckpt, "--lora.save_adapter_only", "true",
                 "--checkpoint.initial_load_path", str(root / "single" / "checkpoint")]
    moe = [*MOE, "--training.steps", str(MOE_STEPS), "--lora.enable", "true",
           "--lora.target_modules", "*.attention.wq,*.attention.wo"]
    final_save = ["--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS)]
    # the first PARITY_STEPS of the 25-step schedule (warm-up, then the peak lr until step 7), and nothing after
    short = ["--training.steps", str(PARITY_STEPS), "--lr_scheduler.decay_ratio", "0"]
    jobs = (("single", 1, "4", [*validation, *final_save]), ("fsdp2", 2, "2", validation),
            ("lora_single", 1, "4", lora), ("tp2_pp2", 4, "4", [*tp, *pp, *short]),
            ("hsdp_cp", 4, "2", [*hsdp_cp, *short]), ("lora_hsdp_cp", 4, "2", [*lora, *hsdp_cp]),
            ("lora_tp2_pp2", 4, "4", [*lora, *tp, *pp, *full_ac]),
            ("moe_lora_single", 1, "4", moe),
            ("moe_lora_ep2", 2, "2", [*moe, "--parallelism.expert_parallel_degree", "2"]),
            ("lora_from_full", 1, "4", from_full))  # after "single", whose last checkpoint it loads
    for nproc in (1, 2, 4):  # one launch per process count, its jobs one after another
        group = [(name, local, extra) for name, n, local, extra in jobs if n == nproc]
        argvs = [[*JOB, "--training.dataset_path", data, "--training.local_batch_size", local,
                  "--job.dump_folder", str(root / name), *extra] for name, local, extra in group]
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OMP_NUM_THREADS", "1")
            outcomes = run_together(argvs, nproc, str(root / f"launch{nproc}"), timeout=900)
        for (name, _, _), (returncode, log) in zip(group, outcomes):
            assert returncode == 0, log[-5000:]
            out[name] = (read_metrics(str(root / name)), log)
    # resume the adapter-only run from its middle checkpoint: the last one removed, the metrics kept aside
    folder = root / "lora_from_full"
    shutil.rmtree(folder / "checkpoint" / f"step-{LORA_STEPS}")
    os.rename(folder / "metrics.jsonl", root / "lora_from_full.jsonl")
    proc = run_train([*JOB, "--training.dataset_path", data, "--training.local_batch_size", "4",
                      "--job.dump_folder", str(folder), *from_full], timeout=300, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out["lora_resumed"] = (read_metrics(str(folder)), proc.stdout + proc.stderr)
    out["adapter_checkpoint"] = str(folder / "checkpoint" / f"step-{LORA_STEPS // 2}")
    out["lora_job"] = [*JOB, "--training.dataset_path", data, *lora]
    out["full_checkpoint"] = str(root / "single" / "checkpoint")
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


def test_tensor_and_pipeline_parallel_match_one_process(runs):
    same_losses(runs["single"][0][:PARITY_STEPS], runs["tp2_pp2"][0], "tp2_pp2")


def test_fsdp_matches_one_process(runs):
    single, fsdp = runs["single"][0], runs["fsdp2"][0]
    assert [m["answer_tokens"] for m in single] == [m["answer_tokens"] for m in fsdp]
    for a, b in zip(single, fsdp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])


def test_lora_learns_and_differs_from_full_fine_tuning(runs):
    lora, full = runs["lora_single"][0], runs["single"][0]
    assert lora[0]["loss"] == pytest.approx(full[0]["loss"], rel=1e-6)  # B = 0: the base model at step 1
    assert lora[-1]["loss"] < lora[0]["loss"] - 0.2
    assert lora[-1]["loss"] != pytest.approx(full[LORA_STEPS - 1]["loss"], rel=1e-3)


def same_losses(reference: list[dict], other: list[dict], label: str) -> None:
    assert [m["answer_tokens"] for m in reference] == [m["answer_tokens"] for m in other], label
    for a, b in zip(reference, other, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (label, a["step"], a["loss"], b["loss"])


@pytest.mark.parametrize("layout", ["hsdp_cp", "lora_hsdp_cp", "lora_tp2_pp2", "moe_lora_ep2"])
def test_every_layout_matches_one_process(runs, layout):
    reference = {"moe": "moe_lora_single", "lora": "lora_single"}.get(layout.split("_")[0], "single")
    other = runs[layout][0]
    same_losses(runs[reference][0][:len(other)], other, layout)
    assert len(other) == (PARITY_STEPS if reference == "single" else len(runs[reference][0])), layout


def test_lora_learns_on_the_moe_model(runs):
    losses = [m["loss"] for m in runs["moe_lora_single"][0]]
    assert len(losses) == MOE_STEPS and losses[-1] < losses[0] - 0.2, losses


def test_adapter_only_checkpoint_over_a_full_checkpoint_resumes_exactly(runs, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    first, log = runs["lora_from_full"]
    fresh = runs["lora_single"][0]
    # the base weights came from the full fine-tuning run's checkpoint: its answers are already learnt
    assert first[0]["loss"] < 0.5 * fresh[0]["loss"], (first[0]["loss"], fresh[0]["loss"])
    assert "initial load of model" in log
    stored = FileSystemReader(runs["adapter_checkpoint"]).read_metadata().state_dict_metadata
    model_keys = [k for k in stored if k.startswith("model.")]
    assert model_keys and all(".lora_a." in k or ".lora_b." in k for k in model_keys), model_keys[:5]
    assert any(k.startswith("optimizer.") for k in stored)
    resumed, log = runs["lora_resumed"]
    assert "base weights of the adapter-only checkpoint loaded" in log
    assert [m["step"] for m in resumed] == list(range(LORA_STEPS // 2 + 1, LORA_STEPS + 1))
    for a, b in zip(first[LORA_STEPS // 2:], resumed, strict=True):
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])
    # it exports as a PEFT adapter (all PEFT needs); a merged export needs the base weights: one line
    from safetensors.torch import load_file

    from torchtrain.tools.lora_export import main as export

    assert export([runs["adapter_checkpoint"], str(tmp_path / "peft"), "--format", "peft", *runs["lora_job"]]) == 0
    assert len(load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))) == len(model_keys)
    assert export([runs["adapter_checkpoint"], str(tmp_path / "merged"), "--format", "merged", *runs["lora_job"]]) == 2
    # generation puts it over the base weights it was trained on (the job's initial load)
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtrain.inference.generation import load

    job = [*runs["lora_job"], "--checkpoint.initial_load_path", runs["full_checkpoint"]]
    state = load(runs["adapter_checkpoint"], None, job, torch.device("cpu"), torch.float32).model.state_dict()
    base = {"layers.0.attention.wq.weight": torch.empty_like(state["layers.0.attention.wq.weight"])}
    dcp.load({"model": base}, checkpoint_id=os.path.join(runs["full_checkpoint"], f"step-{STEPS}"), no_dist=True)
    assert torch.equal(state["layers.0.attention.wq.weight"], base["layers.0.attention.wq.weight"])
    assert state["layers.0.attention.wq.lora_b.weight"].abs().sum() > 0
