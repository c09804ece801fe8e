"""In-loop evaluation and Muon under real torchrun + gloo, one launch per layout shared by every check:

Every run trains the same tiny job (8 steps, global batch 4, Muon, z-loss 1e-4) with two named
validation sets and the built-in tasks (50 items each) evaluated at step 4 and after the last step,
checkpoints after every step (one process, FSDP 2, TP 2). Against the one-process run:

* FSDP 2, TP 2 (loss parallel), PP 2 and CP 2 make exactly the same choice on every item (hence the
  same acc and acc_norm); their per-choice log-likelihoods agree within 1e-4 absolute (the weights
  differ by float summation order only; the smallest gap between an item's two best choices is far
  larger, checked too, so equal choices are not luck);
* training with Muon and z-loss matches one process within 1e-5 relative per step in loss, gradient
  norm and z-loss under all four layouts; on FSDP 2 and TP 2 (sharded DTensor parameters, gathered
  for Newton-Schulz) the weights after every step agree within 1e-5 absolute (observed ~1e-7);
* the named validation sets are logged separately (validation/<name>/loss, perplexity: console,
  metrics.jsonl, TensorBoard, as the eval metrics) with values that do not depend on the layout
  (relative 1e-5);
* a resumed run (from step 4's checkpoint) repeats steps 5-8 bitwise: Muon's state is checkpointed;
* expert parallelism (Qwen3-MoE, EP 2; Muon on expert weights without a gather) runs and logs every
  metric (a smoke check);
* the last step's checkpoint exported to Hugging Face and scored item by item with transformers'
  LlamaForCausalLM gives the same choice on every item and the same accuracy (log-likelihoods within
  1e-4 absolute: the same fp32 weights, RoPE computed in another precision).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest
import torch
from conftest import REPO, TINY_JOB, read_metrics, run_train

pytestmark = pytest.mark.dist
STEPS = 8
TASKS = ("copy", "keywords")
ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "LOG_RANK": "0"}


def job(dump, held_out: str, val_batch: int, *extra: str) -> list[str]:
    return [*TINY_JOB, "--training.steps", str(STEPS), "--training.global_batch_size", "4", "--metrics.log_freq", "1",
            "--debug.deterministic", "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump),
            "--optimizer.name", "Muon", "--training.z_loss", "1e-4",
            "--validation.enable", "--validation.freq", "4", "--validation.steps", "2",
            "--validation.local_batch_size", str(val_batch), "--validation.sets", f"synth=synthetic,text=files:{held_out}",
            "--eval.enable", "--eval.freq", "4", "--eval.tasks", ",".join(TASKS), "--eval.limit", "50",
            "--eval.local_batch_size", "16", "--eval.save_samples",
            "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0", *extra]


LAYOUTS = {  # name: (processes, validation batch per rank for a global validation batch of 4, overrides)
    "single": (None, 4, ("--metrics.enable_tensorboard", "true")),
    "fsdp2": (2, 2, ()),
    "tp2": (2, 4, ("--parallelism.tensor_parallel_degree", "2")),
    "pp2": (2, 4, ("--parallelism.pipeline_parallel_degree", "2", "--checkpoint.enable", "false")),
    "cp2": (2, 4, ("--parallelism.context_parallel_degree", "2", "--checkpoint.enable", "false")),
}


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("held_out") / "held_out.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(200)))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, held_out):
    """name -> dump folder, one launch per layout (its console output in `console.log` there)."""
    out = {}
    for name, (nproc, val_batch, extra) in LAYOUTS.items():
        dump = tmp_path_factory.mktemp(name)
        proc = run_train(job(dump, held_out, val_batch, *extra), nproc=nproc, env=ENV)
        assert proc.returncode == 0, (name, (proc.stdout + proc.stderr)[-4000:])
        (dump / "console.log").write_text(proc.stdout + proc.stderr)
        out[name] = str(dump)
    return out


def samples(dump: str, task: str, step: int = STEPS) -> list[dict]:
    with open(os.path.join(dump, "eval", task, f"step-{step}.jsonl")) as f:
        return [json.loads(line) for line in f]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "pp2", "cp2"])
def test_eval_choices_equal_one_process(runs, layout):
    ref, got = read_metrics(runs["single"]), read_metrics(runs[layout])
    for step in (4, STEPS):
        for task in TASKS:
            a, b = samples(runs["single"], task, step), samples(runs[layout], task, step)
            assert [(s["pred"], s["pred_norm"]) for s in a] == [(s["pred"], s["pred_norm"]) for s in b], (task, step)
            gaps = [sorted(s["loglikelihoods"])[-1] - sorted(s["loglikelihoods"])[-2] for s in a]
            diffs = [abs(x - y) for s, t in zip(a, b) for x, y in zip(s["loglikelihoods"], t["loglikelihoods"])]
            assert max(diffs) <= 1e-4 < min(gaps), (task, step, max(diffs), min(gaps))
            for metric in ("acc", "acc_norm"):
                key = f"eval/{task}/{metric}"
                assert ref[step - 1][key] == got[step - 1][key]
    assert all(k not in ref[i] for i in (0, 1, 2, 4) for k in ("eval/copy/acc", "validation/synth/loss"))


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "pp2", "cp2"])
def test_muon_and_z_loss_match_one_process(runs, layout):
    ref, got = read_metrics(runs["single"]), read_metrics(runs[layout])
    assert len(ref) == len(got) == STEPS
    for a, b in zip(ref, got):
        for key in ("loss", "grad_norm", "z_loss"):
            assert rel(a[key], b[key]) <= 1e-5, (layout, a["step"], key, a[key], b[key])
    if layout in ("fsdp2", "tp2"):  # Muon on sharded DTensor parameters: the weights after every step
        for step in range(1, STEPS + 1):
            mine, theirs = (model_weights(os.path.join(runs[n], "checkpoint", f"step-{step}"))
                            for n in ("single", layout))
            worst = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
            assert worst <= 1e-5, (layout, step, worst)


def model_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    """The unsharded weights of a DCP checkpoint of any layout."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = checkpoint + ".pt"
    if not os.path.exists(path):
        dcp_to_torch_save(checkpoint, path)
    return torch.load(path, weights_only=False)["model"]


def test_named_validation_sets_are_logged_separately(runs):
    by_layout = {name: {r["step"]: r for r in read_metrics(dump)} for name, dump in runs.items()}
    ref = by_layout["single"]
    for step in (4, STEPS):
        r = ref[step]
        assert r["validation/synth/tokens"] == r["validation/text/tokens"] == 2 * 4 * 64
        assert r["validation/synth/loss"] != r["validation/text/loss"]
        for name in ("synth", "text"):
            assert math.isclose(r[f"validation/{name}/perplexity"], math.exp(r[f"validation/{name}/loss"]))
            for layout, records in by_layout.items():
                assert rel(records[step][f"validation/{name}/loss"], r[f"validation/{name}/loss"]) <= 1e-5, layout
        assert "validation_loss" not in r  # the single-set names only without [[validation.sets]]
    console = open(os.path.join(runs["single"], "console.log")).read()
    assert "step     4 | validation synth loss" in console and "step     4 | validation text loss" in console
    assert "step     8 | eval copy acc" in console and "| z-loss " in console
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(os.path.join(runs["single"], "tb"))
    tb.Reload()
    for key in ("validation/synth/loss", "validation/text/perplexity", "eval/copy/acc", "eval/keywords/acc_norm"):
        assert [e.step for e in tb.Scalars(key)] == [4, STEPS], key


def test_resume_with_muon_is_exact(runs, held_out, tmp_path):
    dump = tmp_path / "resumed"
    shutil.copytree(os.path.join(runs["single"], "checkpoint", "step-4"), dump / "checkpoint" / "step-4")
    proc = run_train(job(dump, held_out, 4), env=ENV)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "resumed from" in proc.stdout + proc.stderr
    keys = ("step", "loss", "grad_norm", "z_loss", "eval/copy/acc", "validation/synth/loss")
    ref = [[r.get(k) for k in keys] for r in read_metrics(runs["single"])[4:]]
    assert [[r.get(k) for k in keys] for r in read_metrics(str(dump))] == ref
    assert samples(str(dump), "copy") == samples(runs["single"], "copy")


@pytest.mark.slow
def test_expert_parallel_smoke(tmp_path, held_out):
    moe = ["--model.name", "qwen3_moe", "--model.head_dim", "16", "--model.num_experts", "4",
           "--model.num_experts_per_tok", "2", "--model.moe_intermediate_size", "32"]
    proc = run_train(job(tmp_path, held_out, 2, *moe, "--parallelism.expert_parallel_degree", "2",
                         "--checkpoint.enable", "false", "--training.steps", "4"), nproc=2, env=ENV)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    last = read_metrics(str(tmp_path))[-1]
    for task in TASKS:
        assert 0 <= last[f"eval/{task}/acc"] <= 1 and 0 <= last[f"eval/{task}/acc_norm"] <= 1
    assert all(math.isfinite(last[k]) for k in ("loss", "z_loss", "validation/text/loss", "validation/synth/loss"))


@pytest.mark.slow
def test_scores_agree_with_transformers(runs, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import convert_dcp_to_hf

    from torchtrain.components.evaluation.builtin import builtin_items
    from torchtrain.components.evaluation.requests import build_requests
    from torchtrain.components.evaluation.scorer import choose
    from torchtrain.data.tokenizer import ByteTokenizer

    hf_dir = str(tmp_path / "hf")
    assert convert_dcp_to_hf.main([os.path.join(runs["single"], "checkpoint", f"step-{STEPS}"), hf_dir]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).float().eval()
    for task in TASKS:
        items = builtin_items(task)[:50]
        ours = samples(runs["single"], task)
        lls: dict[tuple[int, int], float] = {}
        with torch.no_grad():
            for r in build_requests(task, items, ByteTokenizer(), seq_len=64):
                t = torch.tensor([r.tokens])
                logp = torch.log_softmax(hf(t[:, :-1]).logits[0].double(), dim=-1)
                lls[r.item, r.choice] = sum(logp[p, r.tokens[p + 1]].item()
                                            for p in range(len(r.tokens) - 1 - r.n_cont, len(r.tokens) - 1))
        acc = 0
        for i, (item, mine) in enumerate(zip(items, ours)):
            theirs = [lls[i, c] for c in range(len(item.choices))]
            assert max(abs(a - b) for a, b in zip(mine["loglikelihoods"], theirs)) <= 1e-4, (task, i)
            assert choose(theirs, [len(c) for c in item.choices]) == (mine["pred"], mine["pred_norm"]), (task, i)
            acc += mine["pred"] == item.gold
        assert read_metrics(runs["single"])[-1][f"eval/{task}/acc"] == acc / len(items)
