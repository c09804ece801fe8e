"""transformers models trained by the engine under real torchrun (gloo, CPU), one launch per process count
shared by the module (tests/scripts/parity_runs.py runs its jobs one after another):

* Mistral (sliding window shorter than the sequence), from its config alone (the model's own
  initialisation, keyed by module name): FSDP2 per decoder layer, DDP, ZeRO-1, ZeRO-2, TP 2 (the declared plan,
  with sequence parallelism) and FSDP2 x TP2 equal one process step by step; an FSDP2 run resumed from
  its step-2 checkpoint repeats its last steps bitwise; the FSDP2 x TP2 run's checkpoint exports to a
  folder that transformers loads with the logits of the torchtrain model;
* Qwen2, Phi-3, Gemma 3 and OLMo 2 from their own weights: FSDP2, TP 2 and FSDP2 x TP2 equal one process;
  Qwen2 also under PP 2 (stages cut by decoder layers) and PP 2 x FSDP 2;
* Granite, a model type no torchtrain code names (embedding, residual and logit multipliers of its own):
  FSDP2 and TP2 equal one process from its declared plan alone;
* Mixtral loaded from its folder (stored one tensor per expert): FSDP2 with its MoE blocks as they are, and
  expert parallelism (EP 2 x FSDP 2, its MoE blocks run as torchtrain's MoE layer) equal one process;
* gpt-oss from its own weights (attention sinks, sliding windows, biased clamped-SwiGLU experts): FSDP2
  and TP 2 (attention heads with their sinks split, the MoE blocks swapped for the engine's layer with
  expert parallelism over the TP ranks) equal one process;
* Qwen3.5 from its own weights, its Gated DeltaNet layers run as the engine's: TP 2 (heads split, sequence
  parallelism) and CP 2 (the recurrent state passed between ranks) equal one process;
* LoRA fine-tuning of Mistral's own weights on chat data with the folder's tokenizer (its default), the
  attention mask block-causal by default, an adapter-only checkpoint that `peft` loads.

Tolerance: relative loss and gradient-norm differences <= 1e-4 per step (the project's parity bound:
layouts differ in float32 summation order only); the resume is compared bitwise."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import REPO, read_metrics, run_together
from transformers_folders import hf_folder, transformers

from torchtrain.tools.parity import ParityCase, RunResult, compare, format_table

pytestmark = [pytest.mark.dist, pytest.mark.slow]
STEPS = 4
TOL = 1e-4
BASE = ["--model.name", "transformers", "--training.dataset", "synthetic", "--training.seq_len", "32",
        "--training.global_batch_size", "4", "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "1",
        "--optimizer.lr", "3e-3", "--metrics.log_freq", "1", "--debug.deterministic", "true",
        "--metrics.enable_tensorboard", "false", "--job.print_config", "false"]
P = "--parallelism."
ARCHITECTURES = ("qwen2", "phi3", "gemma3", "olmo2")
"""Trained under every sharding layout besides Mistral (Gemma 3 untied: TP does not take tied embeddings)."""


def _jobs(root) -> list[tuple[str, int, list[str]]]:
    """(name, processes, trainer arguments) of every run (a global batch of 4 sequences: the local batch is 4
    over the data-parallel degree); runs of one process count share a launch, in order."""
    mistral = hf_folder(root / "mistral", "mistral", weights=False)
    granite = hf_folder(root / "granite", "granite", weights=False)
    mixtral = hf_folder(root / "mixtral", "mixtral")
    gpt_oss = hf_folder(root / "gpt_oss", "gpt_oss")
    qwen3_5 = hf_folder(root / "qwen3_5", "qwen3_5")
    chat_model = hf_folder(root / "mistral_tok", "mistral", tokenizer=True)
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from synthetic_chat import write_task

    write_task(str(root / "chat.jsonl"), 60, seed=1)
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    fsdp2_step2 = str(root / "mistral_fsdp2" / "checkpoint" / "step-2")
    lora = ["--model.hf_path", chat_model, "--training.dataset", "chat", "--training.dataset_path",
            str(root / "chat.jsonl"), "--training.seq_len", "64", "--lora.enable", "true", "--lora.rank", "4",
            "--lora.target_modules", "q_proj,*.mlp.down_proj", "--lora.save_adapter_only", "true", *ckpt]
    runs = [("mistral_single", 1, 4, ["--model.hf_path", mistral]),
            ("granite_single", 1, 4, ["--model.hf_path", granite]),
            ("mixtral_single", 1, 4, ["--model.hf_path", mixtral]),
            ("lora_chat", 1, 4, lora),
            ("gpt_oss_single", 1, 4, ["--model.hf_path", gpt_oss]),
            ("gpt_oss_fsdp2", 2, 2, ["--model.hf_path", gpt_oss]),
            ("gpt_oss_tp2", 2, 4, ["--model.hf_path", gpt_oss, P + "tensor_parallel_degree", "2",
                                   P + "expert_parallel_degree", "2"]),
            ("qwen3_5_single", 1, 4, ["--model.hf_path", qwen3_5]),
            ("qwen3_5_tp2", 2, 4, ["--model.hf_path", qwen3_5, P + "tensor_parallel_degree", "2"]),
            ("qwen3_5_cp2", 2, 4, ["--model.hf_path", qwen3_5, P + "context_parallel_degree", "2"]),
            ("mistral_fsdp2", 2, 2, ["--model.hf_path", mistral, *ckpt]),
            ("mistral_resumed", 2, 2, ["--model.hf_path", mistral, "--checkpoint.enable", "true",
                                       "--checkpoint.initial_load_path", fsdp2_step2,
                                       "--checkpoint.initial_load_model_only", "false"]),  # after mistral_fsdp2
            ("mistral_ddp2", 2, 2, ["--model.hf_path", mistral, P + "data_parallel_strategy", "ddp"]),
            ("mistral_zero1", 2, 2, ["--model.hf_path", mistral, P + "data_parallel_strategy", "zero1"]),
            ("mistral_zero2", 2, 2, ["--model.hf_path", mistral, P + "data_parallel_strategy", "zero2"]),
            ("mistral_tp2", 2, 4, ["--model.hf_path", mistral, P + "tensor_parallel_degree", "2"]),
            ("granite_fsdp2", 2, 2, ["--model.hf_path", granite]),
            ("granite_tp2", 2, 4, ["--model.hf_path", granite, P + "tensor_parallel_degree", "2"]),
            ("mixtral_fsdp2", 2, 2, ["--model.hf_path", mixtral]),
            ("mistral_fsdp2_tp2", 4, 2, ["--model.hf_path", mistral, P + "tensor_parallel_degree", "2",
                                         "--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS)]),
            ("mixtral_ep2_fsdp2", 4, 1, ["--model.hf_path", mixtral, P + "expert_parallel_degree", "2"])]
    for kind in ARCHITECTURES:  # each architecture from its own weights: one process, FSDP2, TP2, FSDP2 x TP2
        folder = hf_folder(root / kind, kind, **({"tie_word_embeddings": False} if kind == "gemma3" else {}))
        tp = [P + "tensor_parallel_degree", "2"]
        runs += [(f"{kind}_single", 1, 4, ["--model.hf_path", folder]),
                 (f"{kind}_fsdp2", 2, 2, ["--model.hf_path", folder]),
                 (f"{kind}_tp2", 2, 4, ["--model.hf_path", folder, *tp]),
                 (f"{kind}_fsdp2_tp2", 4, 2, ["--model.hf_path", folder, *tp])]
        if kind == "qwen2":  # pipeline stages cut by decoder layers, alone and with FSDP
            pp = [P + "pipeline_parallel_degree", "2"]
            runs += [("qwen2_pp2", 2, 4, ["--model.hf_path", folder, *pp]),
                     ("qwen2_pp2_fsdp2", 4, 2, ["--model.hf_path", folder, *pp])]
    return [(name, n, [*BASE, "--training.local_batch_size", str(local), "--job.dump_folder", str(root / name), *extra])
            for name, n, local, extra in runs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("transformers")
    jobs = _jobs(root)
    out = {}
    for nproc in (1, 2, 4):
        group = [(name, argv) for name, n, argv in jobs if n == nproc]
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OMP_NUM_THREADS", "1")
            outcomes = run_together([argv for _, argv in group], nproc, str(root / f"launch{nproc}"), timeout=900)
        for (name, argv), (rc, log) in zip(group, outcomes):
            dump = argv[argv.index("--job.dump_folder") + 1]
            records = read_metrics(dump) if os.path.exists(os.path.join(dump, "metrics.jsonl")) else []
            out[name] = RunResult(ParityCase(name, nproc), records, rc, log)
    out["root"] = root
    return out


def check(runs, baseline: str, candidates: list[str]) -> None:
    comparisons = [compare(runs[baseline], runs[c], STEPS, TOL) for c in candidates]
    table = format_table(runs[baseline], comparisons, TOL)
    print(table)
    assert all(c.ok for c in comparisons), table


def test_every_layout_of_a_dense_model_equals_one_process(runs):
    check(runs, "mistral_single", ["mistral_fsdp2", "mistral_ddp2", "mistral_zero1", "mistral_zero2", "mistral_tp2",
                                   "mistral_fsdp2_tp2"])
    assert "with sequence parallelism" in runs["mistral_tp2"].log


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_each_architecture_equals_one_process_under_fsdp2_tp2_and_both(runs, kind):
    check(runs, f"{kind}_single", [f"{kind}_fsdp2", f"{kind}_tp2", f"{kind}_fsdp2_tp2"])
    assert "initial load: model weights loaded from the Hugging Face folder" in runs[f"{kind}_single"].log


def test_pipeline_stages_alone_and_with_fsdp_equal_one_process(runs):
    check(runs, "qwen2_single", ["qwen2_pp2", "qwen2_pp2_fsdp2"])


def test_a_resumed_run_repeats_the_steps_bitwise(runs):
    resumed, first = runs["mistral_resumed"], runs["mistral_fsdp2"]
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert [r["step"] for r in resumed.records] == [3, 4]
    for a, b in zip(resumed.records, first.records[2:]):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_a_model_type_no_code_names_trains_from_its_declared_plan(runs):
    check(runs, "granite_single", ["granite_fsdp2", "granite_tp2"])


def test_moe_blocks_train_as_they_are_under_fsdp_and_swapped_under_expert_parallelism(runs):
    check(runs, "mixtral_single", ["mixtral_fsdp2", "mixtral_ep2_fsdp2"])
    assert "initial load: model weights loaded from the Hugging Face folder" in runs["mixtral_single"].log


def test_attention_sinks_and_sliding_windows_train_under_fsdp_and_tp(runs):
    """gpt-oss: its sinks (`s_aux`) and sliding windows go through the engine's attention; under TP its
    heads and sinks split (the plan transformers no longer declares completed) and its MoE blocks run as
    the engine's layer."""
    check(runs, "gpt_oss_single", ["gpt_oss_fsdp2", "gpt_oss_tp2"])
    assert "model type gpt_oss from its declared plan, with sequence parallelism" in runs["gpt_oss_tp2"].log


def test_linear_attention_layers_split_under_tensor_and_context_parallelism(runs):
    """Qwen3.5's Gated DeltaNet layers, run as the engine's: heads split by TP, the state passed on by CP."""
    check(runs, "qwen3_5_single", ["qwen3_5_tp2", "qwen3_5_cp2"])
    assert "with sequence parallelism" in runs["qwen3_5_tp2"].log


def test_the_checkpoint_of_a_2d_layout_exports_to_a_folder_transformers_loads(runs, tmp_path):
    import torch.distributed.checkpoint as dcp
    from test_transformers import ours, tokens

    step = runs["root"] / "mistral_fsdp2_tp2" / "checkpoint" / f"step-{STEPS}"
    out = str(tmp_path / "hf")
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from convert_dcp_to_hf import main as convert  # the export script, on the checkpoint's complete.json

    assert convert([str(step), out]) == 0
    with open(step / "complete.json") as f:
        folder = json.load(f)["model"]["args"]["hf_path"]
    model = ours(folder, load=False)
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(step), no_dist=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        assert (hf(tokens()).logits - model(tokens())).abs().max().item() <= 1e-5


def test_lora_on_chat_data_with_the_folders_tokenizer_and_a_peft_export(runs, tmp_path):
    peft = pytest.importorskip("peft", reason="peft not installed (pip install -e .[dev])")
    from test_transformers import ours, tokens

    from torchtrain.config.lora import Lora
    from torchtrain.tools.lora_export import load_lora_state, write_peft

    run = runs["lora_chat"]
    assert run.returncode == 0, run.log[-3000:]
    assert "defaults to \"block_causal\"" in run.log and "LoRA: rank-4 adapters" in run.log
    folder = str(runs["root"] / "mistral_tok")
    job = ["--model.name", "transformers", "--model.hf_path", folder, "--lora.enable", "true", "--lora.rank", "4",
           "--lora.target_modules", "q_proj,*.mlp.down_proj"]
    step = str(runs["root"] / "lora_chat" / "checkpoint" / f"step-{STEPS}")
    state, cfg, adapter = load_lora_state(step, job)
    assert state and all(".lora_" in k for k in state)  # an adapter-only checkpoint
    write_peft(str(tmp_path / "peft"), state, cfg, adapter, base=folder)
    model = ours(folder, lora=Lora(enable=True, rank=4, target_modules=["q_proj", "*.mlp.down_proj"]))
    model.load_state_dict(state, strict=False)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        assert (loaded(tokens(258)).logits - model(tokens(258))).abs().max().item() <= 1e-5
