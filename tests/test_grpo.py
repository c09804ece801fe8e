"""GRPO ([grpo]): the sampler, the objective's formula, layouts against one process, resume,
and bad input.

* sampling with the key/value cache computes what a full forward over each finished row computes: the sampler's
  log-probs equal the trainer's within 1e-6 relative (fp32, a few ulps of log-probs near -5.6; left-padded prompts
  of several lengths, a sliding window and attention sinks, the scratch slots of a sequence-parallel feed, Qwen3.5's
  linear-attention layers keeping their recurrent state), and a row's samples do not depend on the batch it is
  sampled in (its own generator);
* the clipped objective with the k3 KL term equals its formula token by token (float64), and group advantages are
  centred (and scaled) per group;
* the toy task (`tools/grpo_toy.py`) as README and docs/post_training.md run it: GRPO lifts the SFT model's held-out
  exact match (<= 80 %) to >= 90 % (`check_grpo_recipe`, tests/test_doc_commands.py);
* layouts (`dist`, real torchrun, gloo, fp32; 2 optimizer steps per batch of rollouts x 2 passes, so the ratio moves
  and clips): FSDP 2 and TP 2 sample the same completions (equal rewards) and match one process per step -- loss
  and grad norm within 1e-4 relative or 1e-6 absolute (an on-policy step's loss is a mean of centred advantages,
  ~0 by construction: its relative difference is meaningless); a run resumed from a checkpoint in the middle of an
  iteration (its rollout rows and statistics restored) continues bitwise and logs the same rollout metrics; PP 2 and CP 2 train as one process does with an
  unsharded sampling copy synced from the model (grpo.generator = "copy"); with beta > 0 the KL term to the
  reference -- a frozen copy (also under CP 2), or LoRA's adapters off -- matches too; the first step of an
  iteration has ratio 1 within 1e-6 (sampler = trainer), and exactly 1 with grpo.old_logps = "trainer";
* bad input: a prompt without an answer, a prompt longer than the budget, a reward function that raises or
  returns a non-number, and pipeline parallelism with the in-place sampler are one line naming the file:line, the
  function or the key, exit 2 before training; during training a failing reward is scored 0 and counted
  (grpo/reward_errors), or stops the run on every rank (exit 2).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import PLUGINS, ParitySuite, assert_no_traceback, read_metrics, run_train

RTOL, ATOL, STEPS = 1e-4, 1e-6, 4
MODEL = ["--model.name", "llama3", "--model.flavor", "debugmodel", "--model.dim", "64", "--model.n_layers", "2",
         "--model.n_heads", "4", "--model.vocab_size", "264"]
CKPT = ("--checkpoint.interval", "2")
KL = ("--grpo.beta", "0.05")
COPY = ("--grpo.generator", "copy")
OLD = ("--grpo.old_logps", "trainer")
KL_CP = (*COPY, *KL, *OLD)  # CP 2: the reference's and the trainer's scoring of each rank's chunks
SEQ = (*COPY, "--grpo.importance_sampling_level", "sequence", "--grpo.loss_type", "grpo")  # GSPO, completion means
DR = ("--grpo.loss_type", "dr_grpo", "--grpo.scale_rewards", "false")  # Dr. GRPO
DYN = ("--grpo.dynamic_sampling", "--grpo.max_sampling_rounds", "3", "--grpo.overlong_buffer_len", "2")  # DAPO's
OWN = ("--grpo.generator", "own_generator:build")  # a generator of the tests' own (tests/plugins/own_generator.py)
TIS = (*OWN, *OLD, "--grpo.importance_sampling_cap", "2")  # the sampler-mismatch weight, through the whole run
# two turns of the model, the environment's between (tests/plugins/toy_environments.py)
ENV = ("--grpo.environment", "toy_environments:again", "--grpo.max_turns", "2", "--grpo.reward_funcs", "",
       "--training.seq_len", "80", *CKPT)
ONE_STEP = ("--grpo.steps_per_generation", "1", "--grpo.num_iterations", "1")  # an iteration a step
SYNC = (*COPY, *OLD, "--grpo.importance_sampling_cap", "2", *ONE_STEP, "--checkpoint.interval", "2")
AHEAD = (*SYNC, "--grpo.max_staleness", "1")  # the next iteration sampled in the background (posttrain/ahead.py)
# two iterations of two passes each: the trainer's log-probs beside the sampler's, a checkpoint after every step
TWO_PASSES = (*COPY, *OLD, "--grpo.importance_sampling_cap", "2", "--grpo.steps_per_generation", "1",
              "--grpo.num_iterations", "2", "--checkpoint.interval", "1")
APART = "4 --parallelism.data_parallel_shard_degree 2 --grpo.generator_ranks 2"  # FSDP 2 trainers + 2 generators
LORA_KL = ("--lora.enable", "--lora.rank", "4", "--lora.target_modules", "*.attention.wq,*.attention.wv", *KL)


def sft(root: str, steps: int = 100) -> str:
    """The toy's data, and its format-only fine-tuning; returns the checkpoint to start GRPO from."""
    from torchtrain.tools.grpo_toy import write

    write(root, prompts=2000, seed=1)
    out = os.path.join(root, "sft")
    proc = run_train([*MODEL, "--model.hf_assets_path", os.path.join(root, "tokenizer"), "--training.dataset", "chat",
                      "--training.dataset_path", os.path.join(root, "sft.jsonl"), "--training.seq_len", "128",
                      "--training.local_batch_size", "8", "--training.steps", str(steps), "--optimizer.lr", "3e-3",
                      "--lr_scheduler.warmup_steps", "10", "--checkpoint.enable", "--checkpoint.interval",
                      str(steps), "--job.dump_folder", out, "--job.print_config", "false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return os.path.join(out, "checkpoint", f"step-{steps}")


def reward_model(root: str, steps: int = 120) -> tuple[str, list[dict]]:
    """A reward model of the toy, trained by the engine on its preference pairs (right digit chosen:
    dpo.loss_type = "bradley_terry"); returns its checkpoint folder and its step records. Each step's 16 pairs are new
    to it (one pass over the toy's 2000), so each step's accuracy is measured on pairs it has not trained on."""
    out = os.path.join(root, "reward_model")
    proc = run_train([*MODEL, "--model.hf_assets_path", os.path.join(root, "tokenizer"), "--training.dataset",
                      "preference", "--training.dataset_path", os.path.join(root, "preferences.jsonl"),
                      "--training.seq_len", "128", "--training.local_batch_size", "16", "--training.steps", str(steps),
                      "--dpo.enable", "--dpo.loss_type", "bradley_terry", "--optimizer.lr", "3e-3",
                      "--lr_scheduler.warmup_steps", "5", "--checkpoint.enable", "--checkpoint.interval", str(steps),
                      "--job.dump_folder", out, "--job.print_config", "false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return os.path.join(out, "checkpoint"), read_metrics(out)


def job(root: str, start: str | None) -> list[str]:
    """The GRPO job on the toy's prompts, from the `start` checkpoint (None: from initialisation)."""
    begin = ["--checkpoint.enable", "--checkpoint.initial_load_path", start] if start else []
    return [*MODEL, "--model.hf_assets_path", os.path.join(root, "tokenizer"), "--training.dataset", "prompts",
            "--training.dataset_path", os.path.join(root, "prompts.jsonl"), "--training.seq_len", "48",
            "--grpo.enable", "--grpo.num_generations", "4", "--grpo.max_completion_length", "4",
            "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "0", *begin, "--job.print_config", "false"]


class Sampler:
    """A rollout `Generator` (posttrain/rollout.py) made of a sampling function, with no weights to sync."""

    def __init__(self, sample):
        self.sample = sample

    def __call__(self, rows, sampling, generators):
        return self.sample(rows, sampling, generators)

    def sync_weights(self) -> tuple[float, int]:
        return 0.0, 0


def tiny_model(name: str, **overrides):
    from torchtrain.distributed.param_init import init_model_weights
    from torchtrain.models.registry import get_model_spec

    spec = get_model_spec(name)
    args = spec.flavors["debugmodel"].replace(**{"n_layers": 2, "max_seq_len": 64, **overrides})
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    init_model_weights(model, 0)
    return model.eval()


# ------------------------------------------------------------------ the sampler
@pytest.mark.parametrize("name,multiple", [("llama3", 1), ("llama3", 2), ("gpt_oss", 1), ("qwen3_5", 2)],
                         ids=["llama3", "llama3_scratch_slots", "gpt_oss_window_sinks", "qwen3_5_linear_state"])
def test_sampler_log_probs_equal_the_trainers_within_1e6(name, multiple):
    from torchtrain.posttrain.decoding import Sampling, sample
    from torchtrain.posttrain.policy_loss import PolicyLoss

    layers = {"n_layers": 4} if name == "qwen3_5" else {}  # three linear-attention layers and a full one
    model = tiny_model(name, vocab_size=264, **({"sliding_window": 4} if name == "gpt_oss" else {}), **layers)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 12, 13]]  # left-padded to 10
    generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    out = sample(model, prompts, 12, Sampling(temperature=0.7), generators, multiple=multiple)
    loss = PolicyLoss.__new__(PolicyLoss)
    loss.temperature = 0.7
    worst = 0.0
    with torch.no_grad():
        for prompt, tokens, logps in zip(prompts, out.tokens, out.logps):
            row = torch.tensor([prompt + tokens])
            labels = torch.full_like(row, -100)
            labels[0, len(prompt) - 1:-1] = torch.tensor(tokens)
            trainer = loss.logps(model(row), labels)[0, len(prompt) - 1:-1]
            sampled = torch.tensor(logps)
            worst = max(worst, ((trainer - sampled).abs() / sampled.abs().clamp(min=1)).max().item())
    assert all(len(t) == 12 for t in out.tokens)
    assert worst <= 1e-6, worst  # relative (log-probs near -5.6 = log 1/264: one float32 ulp is 4.8e-7)


def test_a_rows_samples_do_not_depend_on_its_batch():
    from torchtrain.posttrain.decoding import Sampling, sample

    model = tiny_model("llama3")
    prompts = [[5, 6, 7], [11, 12, 13, 14, 15], [3, 4]]
    together = sample(model, prompts, 8, Sampling(1.0), [torch.Generator().manual_seed(i) for i in range(3)])
    alone = sample(model, prompts[2:], 8, Sampling(1.0), [torch.Generator().manual_seed(2)])
    assert together.tokens[2] == alone.tokens[0]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_sampling_copy_syncs_bitwise_and_later_only_what_training_changes(lora):
    """`SamplerCopy.sync` (`TrainedWeights`): after each sync the copy's tensors equal the trained model's bitwise; the first sync
    moves every tensor, later ones the trained parameters and the buffers -- under LoRA the adapters, not the
    frozen base weights -- and each reports the bytes it moved."""
    from torchtrain.config.lora import Lora
    from torchtrain.models.converters.lora import apply_lora
    from torchtrain.models.registry import get_model_spec
    from torchtrain.posttrain.sampling_layout import SamplerCopy, TrainedWeights, build_whole

    adapters = Lora(enable=True, rank=4, target_modules=["*.attention.wq", "*.attention.wv"]) if lora else None
    model = tiny_model("llama3")
    if adapters is not None:
        apply_lora(model, adapters)
    spec = get_model_spec("llama3")
    args = spec.flavors["debugmodel"].replace(n_layers=2, max_seq_len=64)
    copy = SamplerCopy(build_whole(spec, args, torch.device("cpu"), adapters), TrainedWeights([model]))
    state = model.state_dict()
    nbytes = {k: v.numel() * v.element_size() for k, v in state.items()}
    changing = {k for k, p in model.named_parameters() if p.requires_grad} | {k for k, _ in model.named_buffers()
                                                                             if k in state}
    for sync in range(3):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))
        seconds, moved = copy.sync()
        assert seconds >= 0 and moved == sum(nbytes[k] for k in (state if sync == 0 else changing))
        assert all(torch.equal(copy.model.state_dict()[k], v) for k, v in model.state_dict().items())
    if lora:
        assert 0 < sum(nbytes[k] for k in changing) < sum(nbytes.values()) / 10
        assert all("lora" in k for k in changing if k in dict(model.named_parameters()))


# ------------------------------------------------------------------ the objective
def test_clipped_objective_and_kl_equal_their_formula():
    from torchtrain.config.grpo import Grpo
    from torchtrain.posttrain.policy_loss import PolicyLoss
    from torchtrain.posttrain.rollout import group_advantages

    g = torch.Generator().manual_seed(0)
    rows, seq, vocab = 3, 6, 11
    logits = torch.randn(rows, seq, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[:, :2] = -100
    logp = torch.log_softmax(logits / 0.5, -1).gather(2, labels.clamp(min=0)[..., None])[..., 0]
    old = logp + 0.4 * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, seq)
    loss = PolicyLoss(Grpo(enable=True, temperature=0.5, beta=0.1, epsilon=0.2, epsilon_high=0.28))
    loss.scale = 0.5
    got = loss(logits, {"labels": labels, "old_logps": old, "advantages": adv, "ref_token_logps": ref})
    expect = 0.0
    for r in range(rows):
        for t in range(2, seq):
            ratio = float(torch.exp(logp[r, t] - old[r, t]))
            a = float(adv[r, t])
            objective = min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
            d = float(ref[r, t] - logp[r, t])
            expect += -(objective - 0.1 * (torch.exp(torch.tensor(d)).item() - d - 1))
    assert got.item() == pytest.approx(0.5 * expect, rel=1e-6)  # (the loss computes in float32)
    assert loss.record(loss.pop_stats(torch.device("cpu")))["grpo/kl"] > 0

    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    scaled, centred = group_advantages(rewards, True), group_advantages(rewards, False)
    assert centred.tolist() == [[0.5, -0.5, 0.5, -0.5], [0.0] * 4]
    std = (1 / 3) ** 0.5  # the unbiased std of two ones and two zeros
    assert scaled[0].tolist() == pytest.approx([x / (std + 1e-4) for x in centred[0].tolist()])
    assert scaled[1].abs().sum() == 0  # a group that agrees teaches nothing


def test_the_sampler_mismatch_weight_equals_its_formula():
    """grpo.importance_sampling_cap: each token's policy term weighted by min(exp(trainer - sampler log-prob), cap)
    (truncated importance sampling), float64 against the formula token by token, the same through the pipeline's
    packed target; refused without the trainer's old log-probs or with a cap below 1."""
    from torchtrain.config import ConfigError
    from torchtrain.config.grpo import Grpo
    from torchtrain.posttrain.policy_loss import PolicyLoss

    g = torch.Generator().manual_seed(1)
    rows, seq, vocab = 3, 6, 11
    logits = torch.randn(rows, seq, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[:, :2] = -100
    logp = torch.log_softmax(logits, -1).gather(2, labels.clamp(min=0)[..., None])[..., 0]
    old = logp + 0.3 * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    sampler = old + 0.8 * torch.randn(rows, seq, generator=g, dtype=torch.float64)  # a mismatched engine
    ref = logp + 0.3 * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, seq)
    grpo = Grpo(enable=True, beta=0.1, old_logps="trainer", importance_sampling_cap=2.0)
    grpo.validate()
    loss = PolicyLoss(grpo)
    batch = {"labels": labels, "old_logps": old, "advantages": adv, "ref_token_logps": ref, "sampler_logps": sampler}
    got = loss(logits, batch)
    expect, capped = 0.0, 0
    for r in range(rows):
        for t in range(2, seq):
            ratio, a = float(torch.exp(logp[r, t] - old[r, t])), float(adv[r, t])
            w = min(float(torch.exp(old[r, t] - sampler[r, t])), 2.0)
            capped += w == 2.0
            d = float(ref[r, t] - logp[r, t])
            expect += -(w * min(ratio * a, min(max(ratio, 0.8), 1.2) * a) - 0.1 * (math.exp(d) - d - 1))
    assert got.item() == pytest.approx(expect, rel=1e-6)
    assert loss.from_target(logits, PolicyLoss.pipeline_target(None, batch, rows)).item() == pytest.approx(expect,
                                                                                                         rel=1e-6)
    record = loss.record(loss.pop_stats(torch.device("cpu")))
    assert 0 < capped < rows * (seq - 2) and record["grpo/sampler_capped"] == pytest.approx(capped / (rows * (seq - 2)))
    for bad in (dict(importance_sampling_cap=2.0), dict(importance_sampling_cap=0.5, old_logps="trainer")):
        with pytest.raises(ConfigError, match=r"\[grpo.importance_sampling_cap\]"):
            Grpo(enable=True, **bad).validate()


@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "token"), ("dr_grpo", "token"),
                                             ("grpo", "sequence"), ("dapo", "sequence")],
                         ids=["dapo", "grpo", "dr_grpo", "gspo", "gspo_token_mean"])
def test_each_loss_type_and_ratio_level_equals_its_formula(loss_type, level):
    """GRPO, Dr. GRPO, DAPO and GSPO: the loss (as the step scales it, scale = R / U) and its gradient against a
    float64 computation written from the papers' formulas, token by token, within 1e-6 relative."""
    from torchtrain.config.grpo import Grpo
    from torchtrain.posttrain.policy_loss import PolicyLoss

    g = torch.Generator().manual_seed(1)
    rows, seq, vocab, longest = 4, 9, 13, 8
    logits = torch.randn(rows, seq, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    for r, (start, end) in enumerate([(1, 9), (3, 6), (2, 3), (4, 8)]):  # completions of 8, 3, 1 and 4 tokens
        labels[r, :start], labels[r, end:] = -100, -100
    mask = labels != -100
    logp = torch.log_softmax(logits, -1).gather(2, labels.clamp(min=0)[..., None])[..., 0]
    old = logp + 0.3 * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, seq)
    grpo = Grpo(enable=True, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type, importance_sampling_level=level,
                max_completion_length=longest)
    loss = PolicyLoss(grpo)
    batch = {"labels": labels, "old_logps": old, "advantages": adv}
    units = int(loss.count(batch)) if loss.units != "tokens" else int(mask.sum())
    assert units == {"dapo": 16, "grpo": 4, "dr_grpo": 4 * longest}[loss_type]
    loss.scale = 2 / units  # R = 2 ranks, this one holding the whole batch: twice the global mean
    x = logits.clone().requires_grad_()
    got = loss(x, batch)
    got.backward()

    def reference(z):
        lp = torch.log_softmax(z, -1).gather(2, labels.clamp(min=0)[..., None])[..., 0]
        total = z.new_zeros(())
        for r in range(rows):
            tokens = [t for t in range(seq) if mask[r, t]]
            n, a = len(tokens), float(adv[r, 0])
            seq_ratio = torch.exp(sum(lp[r, t] - old[r, t] for t in tokens) / n)  # GSPO's geometric mean
            for t in tokens:
                ratio = seq_ratio if level == "sequence" else torch.exp(lp[r, t] - old[r, t])
                objective = torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
                total = total - objective / {"dapo": 16, "grpo": 4 * n, "dr_grpo": 4 * longest}[loss_type]
        return 2 * total

    y = logits.clone().requires_grad_()
    expect = reference(y)
    expect.backward()
    assert got.item() == pytest.approx(expect.item(), rel=1e-6)
    assert torch.allclose(x.grad, y.grad, rtol=1e-6, atol=1e-9), (x.grad - y.grad).abs().max()


def test_builtin_rewards():
    from torchtrain.posttrain.rewards import Rewards, exact, numeric

    assert exact(" 1\n", "1", "") == 1.0 and exact("10", "1", "") == 0.0
    assert numeric("so the answer is 42.0", "42", "") == 1.0 and numeric("41 or 42", "41", "") == 0.0
    assert numeric("no number", "3", "") == 0.0
    rewards = Rewards(["exact", "format"], [1.0, 0.5], r"\d")
    assert rewards.score("7", "7", "") == 1.5 and rewards.score("ab", "7", "") == 0.0


def test_overlong_shaping_equals_its_formula_and_reaches_the_advantages():
    """DAPO's soft overlong punishment (grpo.overlong_buffer_len): nothing up to max - buffer tokens, then linear
    down to -factor at the limit -- against the hand-computed values, and added to the rewards the rollout turns
    into advantages (a group whose answers are all right differs only by its lengths)."""
    from types import SimpleNamespace

    from torchtrain.config import ConfigError
    from torchtrain.config.grpo import Grpo
    from torchtrain.posttrain.rewards import Rewards, overlong_penalty
    from torchtrain.posttrain.rollout import RolloutLoader, group_advantages

    lengths = torch.tensor([1.0, 4.0, 5.0, 6.0, 8.0], dtype=torch.float64)
    assert overlong_penalty(lengths, 8, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, 8, 0, 1.0).tolist() == [0.0] * 5  # off
    with pytest.raises(ConfigError, match=r"overlong_buffer_len.*max_completion_length"):
        Grpo(enable=True, max_completion_length=4, overlong_buffer_len=5).validate()

    sizes = [3, 5, 6, 8]
    stream = SimpleNamespace(at=lambda k: SimpleNamespace(ids=[1, 2], answer="a", text="p", where=f"prompts:{k}"))
    generator = lambda rows, sampling, generators: SimpleNamespace(  # noqa: E731
        tokens=[[3] * n for n in sizes], stopped=[True] * 4, logps=[[-1.0] * n for n in sizes])
    grpo = Grpo(enable=True, num_generations=4, max_completion_length=8, overlong_buffer_len=4)
    loader = RolloutLoader(stream, grpo, Rewards(["exact"], []), SimpleNamespace(decode=lambda ids: "a"), 16, 4, 1,
                           0, 1, 0)
    loader.attach(None, None, Sampler(generator))
    next(iter(loader))
    rewards = 1.0 + torch.tensor([0.0, -0.25, -0.5, -1.0], dtype=torch.float64)
    expect = group_advantages(rewards.view(1, 4), True).reshape(-1).float()
    got = torch.stack([row[labels != -100][0] for row, labels in zip(loader.rows["advantages"], loader.rows["labels"])])
    assert torch.equal(got, expect), (got, expect)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    """DAPO's dynamic sampling: groups whose completions all score the same give way to the next prompts' groups,
    round by round, the prompt counter moving as many rounds on; after max_sampling_rounds agreeing groups fill in."""
    from types import SimpleNamespace

    from torchtrain.config.grpo import Grpo
    from torchtrain.posttrain.rewards import Rewards
    from torchtrain.posttrain.rollout import ROLLOUT_STATS, RolloutLoader

    def rollout(all_right: set[int], dynamic: bool = True, rounds: int = 4) -> RolloutLoader:
        """Two prompts (groups of 4) a round; completion m of prompt k decodes to "a" (right) when k is in
        `all_right` or m > 0, else "b": the groups of `all_right` agree, the others differ."""
        stream = SimpleNamespace(at=lambda k: SimpleNamespace(ids=[k], answer="a", text="p", where=f"prompts:{k}"))
        sampler = lambda rows, sampling, gens: SimpleNamespace(  # noqa: E731
            tokens=[[100 + 10 * row[0] + i % 4, 3] for i, row in enumerate(rows)], stopped=[True] * len(rows),
            logps=[[-1.0, -1.0]] * len(rows))
        decode = lambda ids: "a" if (ids[0] - 100) // 10 in all_right or ids[0] % 10 else "b"  # noqa: E731
        grpo = Grpo(enable=True, num_generations=4, max_completion_length=4, dynamic_sampling=dynamic,
                    max_sampling_rounds=rounds)
        loader = RolloutLoader(stream, grpo, Rewards(["exact"], []), SimpleNamespace(decode=decode), 8, 8, 1, 0, 1, 0)
        loader.attach(None, None, Sampler(sampler))
        next(iter(loader))
        return loader

    def trained(loader: RolloutLoader) -> tuple[list[int], dict[str, float]]:
        return loader.rows["input_ids"][::4, 0].tolist(), dict(zip(ROLLOUT_STATS, loader._stats.tolist()))

    plain = rollout({1}, dynamic=False)
    assert trained(plain)[0] == [0, 1] and plain.consumed == 2
    found = rollout({1})  # round 1: prompts 0 (differs) and 1 (agrees); round 2: prompts 2 and 3, both differ
    prompts, stats = trained(found)
    assert prompts == [0, 2] and found.consumed == 4 and stats["rounds"] == 2 and stats["dropped"] == 2
    assert found.rows["advantages"].abs().sum() > 0 and stats["completions"] == 8
    capped = rollout({0, 1, 2, 3}, rounds=2)  # nothing differs: two rounds, then the first agreeing groups
    prompts, stats = trained(capped)
    assert prompts == [0, 1] and capped.consumed == 4 and stats["rounds"] == 2
    assert torch.equal(capped.rows["advantages"], torch.zeros_like(capped.rows["advantages"]))


# ------------------------------------------------------------------ layouts (torchrun)
@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("grpo"))
    start = sft(root, steps=40)
    scorer, records = reward_model(root)
    rm = ("--grpo.reward_model", scorer, "--grpo.reward_funcs", "")  # the reward model's score alone
    overrides = job(root, start) + ["--training.local_batch_size", "8", "--training.global_batch_size",
                                                  "16", "--grpo.steps_per_generation", "2", "--grpo.num_iterations",
                                                  "2", "--checkpoint.interval", "1000"]
    suite = ParitySuite(root, overrides, STEPS, layouts=[("fsdp2", CKPT), "tp2", ("pp2_1f1b", COPY), ("cp2", COPY),
                                                       ("single", KL), ("fsdp2", KL), ("single", LORA_KL),
                                                       ("fsdp2", LORA_KL), ("single", KL_CP), ("cp2", KL_CP),
                                                       ("single", SEQ), ("cp2", SEQ), ("single", DR), ("fsdp2", DR),
                                                       ("single", DYN), ("fsdp2", DYN), ("single", OWN),
                                                       ("fsdp2", OWN), ("single", TIS), ("single", rm),
                                                       ("fsdp2", rm), ("tp2", rm), ("single", ENV), ("fsdp2", ENV),
                                                       ("tp2", ENV), ("single", SYNC), ("single", AHEAD),
                                                       ("fsdp2", AHEAD), ("single", TWO_PASSES),
                                                       ("fsdp2", TWO_PASSES)])
    suite.reward_model, suite.reward_model_records = rm, records
    return suite


@pytest.mark.dist
def test_fsdp2_and_tp2_sample_the_same_completions_and_match_one_process(suite):
    runs = suite.check(["tp2"], rtol=RTOL, atol=ATOL)
    straight, resumed = suite.check_resumes_bitwise("fsdp2", 2, CKPT, rtol=RTOL, atol=ATOL)
    def grpo_metrics(run):  # the rollout's statistics resume with its rows: the same metrics at the same steps
        return {r["step"]: {k: v for k, v in r.items() if k.startswith("grpo/")} for r in run.records if r["step"] > 2}
    assert grpo_metrics(resumed) == grpo_metrics(straight) and "grpo/reward" in grpo_metrics(resumed)[3]
    base = suite.baseline.records
    for run in [*runs, suite.results["fsdp2", CKPT]]:
        assert [r["grpo/reward"] for r in run.records] == [r["grpo/reward"] for r in base]
    assert base[0]["grpo/ratio"] == pytest.approx(1.0, abs=1e-6)  # on-policy: sampler = trainer
    assert any(r["grpo/clip_fraction"] > 0 for r in base)  # later passes move the ratio past the clip


@pytest.mark.dist
def test_pipeline_and_context_parallel_training_sample_with_a_synced_copy(suite):
    from torchtrain.planner import grpo
    from torchtrain.planner.core import load_job
    from torchtrain.planner.from_job import inputs_from_config

    planned = load_job([*suite.overrides, *COPY, "--parallelism.pipeline_parallel_degree", "2"])
    sync = grpo.weight_sync(inputs_from_config(planned.cfg, planned.args, 2, "cpu", None, {}), None)
    for layout in ("pp2_1f1b", "cp2"):
        run, = suite.check([layout], rtol=RTOL, atol=ATOL, extra=COPY)
        assert [r["grpo/reward"] for r in run.records] == [r["grpo/reward"] for r in suite.baseline.records]
        # the first sync moves the whole model to every rank: the planner's parameters, plus the persistent buffers
        # it does not count (the RoPE table: under 5 % of this tiny model)
        first = run.records[0]
        assert sync.first_bytes <= first["grpo/weight_sync_bytes"] < 1.05 * sync.first_bytes, (sync, first)
        assert first["grpo/weight_sync_seconds"] > 0


@pytest.mark.dist
def test_a_generator_of_ones_own_plugs_in_by_its_factory(suite):
    """`grpo.generator = "package.module:function"` (posttrain/generators.py): the factory's generator, fed the trained
    weights through `GeneratorContext.weights` (gathered from FSDP's shards under FSDP 2), samples what the model
    itself samples and trains as one process does; its sync is logged."""
    single = suite.results["single", OWN]
    assert [r["grpo/reward"] for r in single.records] == [r["grpo/reward"] for r in suite.baseline.records]
    assert single.records[0]["grpo/weight_sync_bytes"] > 0
    run, = suite.check(["fsdp2"], rtol=RTOL, atol=ATOL, extra=OWN)
    assert [r["grpo/reward"] for r in run.records] == [r["grpo/reward"] for r in single.records]
    # its log-probs are the trainer's up to float rounding, so the sampler-mismatch weight is 1 (none truncated)
    # and the run trains as the model sampling itself
    weighted = suite.results["single", TIS].records
    assert all(r["grpo/sampler_weight"] == pytest.approx(1.0, abs=1e-5) and r["grpo/sampler_capped"] == 0
               for r in weighted)
    for got, want in zip(weighted, suite.baseline.records):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL, abs=ATOL)


@pytest.mark.dist
@pytest.mark.parametrize("variant,layout", [(KL, "fsdp2"), (LORA_KL, "fsdp2"), (KL_CP, "cp2")],
                         ids=["frozen_copy", "lora_adapters_off", "frozen_copy_cp2"])
def test_the_kl_penalty_to_the_reference_matches_one_process(suite, variant, layout):
    single = suite.results["single", variant]
    assert ("LoRA adapters off; no copy: 0 MiB" if variant == LORA_KL else "sharded like the model") in single.log
    assert all(r["grpo/kl"] >= 0 for r in single.records) and single.records[-1]["grpo/kl"] > 0
    suite.check([layout], rtol=RTOL, atol=ATOL, extra=variant)


@pytest.mark.dist
def test_a_reward_model_trained_by_the_engine_scores_rollouts_in_every_data_and_tensor_layout(suite):
    """The toy's reward model (`reward_model`) learns the preference on pairs it has not seen; read where a sampled
    completion ends (the position predicting its stop token), it ranks the right digit above the wrong one on
    held-out prompts rendered as GRPO samples them; as GRPO's only reward, sharded like the policy under FSDP 2 and
    TP 2, it gives every completion the score one process gives it (equal rewards) and the same losses."""
    from torchtrain.data.prompts import read_prompts
    from torchtrain.data.tokenizer import stop_ids
    from torchtrain.inference.generation import load
    from torchtrain.posttrain.reward_model import answer_ends, answer_scores

    accuracy = [r["dpo/accuracy"] for r in suite.reward_model_records]
    assert accuracy[0] < 0.9 and min(accuracy[-5:]) >= 0.95, accuracy  # (logged every 10 steps)
    path = suite.reward_model[1]
    scorer = load(path, None, [], torch.device("cpu"), torch.float32)
    stops, end = torch.tensor(stop_ids(scorer.tokenizer)), scorer.tokenizer.token_id("<|im_end|>")
    prompts, _ = read_prompts(os.path.join(suite.workdir, "heldout.jsonl"), scorer.tokenizer, 48, 4, False)
    ranked = 0
    for prompt in prompts:
        scores = []
        for digit in ("0", "1"):  # the completion a stopped sample is: the digit, then the end of the turn
            row = list(prompt.ids) + scorer.tokenizer.encode(digit, bos=False, eos=False) + [end]
            labels = torch.tensor([[-100] * (len(prompt.ids) - 1) + row[len(prompt.ids):]])
            with torch.no_grad():
                logits = scorer.model(torch.tensor([row[:-1]]))
            scores.append(answer_scores(logits, answer_ends(labels, (labels >= 0).long() - 1, 1, stops)).item())
        ranked += scores[int(prompt.answer)] > scores[1 - int(prompt.answer)]
    assert ranked >= 0.95 * len(prompts), (ranked, len(prompts))
    single = suite.results["single", suite.reward_model]
    assert "reward model" in single.log and single.records[0]["grpo/reward"] == single.records[0][
        "grpo/reward_model_score"]
    for run in suite.check(["fsdp2", "tp2"], rtol=RTOL, atol=ATOL, extra=suite.reward_model):
        assert [r["grpo/reward"] for r in run.records] == pytest.approx([r["grpo/reward"] for r in single.records],
                                                                         rel=1e-6, abs=1e-9), run.layout.name


@pytest.mark.dist
def test_multi_turn_episodes_match_one_process_in_every_data_and_tensor_layout(suite):
    """With an environment every episode is two turns of the model around the environment's; FSDP 2 and TP 2 (whose
    ranks sample each turn together) give every episode the reward one process gives it, and the same losses; a run
    resumed mid-iteration continues bitwise."""
    single = suite.results["single", ENV]
    assert "environment toy_environments:again" in single.log
    # the model's tokens of both turns: twice a one-turn completion's (a digit and the end of the turn)
    assert [r["grpo/completion_length"] for r in single.records] == [
        2 * r["grpo/completion_length"] for r in suite.baseline.records]
    for run in suite.check(["tp2"], rtol=RTOL, atol=ATOL, extra=ENV):
        assert [r["grpo/reward"] for r in run.records] == [r["grpo/reward"] for r in single.records], run.layout.name
    # resumed mid-iteration: the rows (the environment's tokens unlabelled) come back from the checkpoint
    straight, _ = suite.check_resumes_bitwise("fsdp2", 2, ENV, rtol=RTOL, atol=ATOL)
    assert [r["grpo/reward"] for r in straight.records] == [r["grpo/reward"] for r in single.records]


def test_an_episode_alternates_the_models_turns_with_the_environments(monkeypatch):
    """`run_episodes`: the model's turns (sampled, with their log-probs) and the environment's (context: log-prob 0),
    the reward of the last step, the end at done, at max_turns or where another turn would not fit seq_len; a raising
    environment ends its episode with the error kept; the rollout rows label the model's tokens only."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(PLUGINS)
    from toy_environments import AGAIN, again, broken

    from torchtrain.posttrain.decoding import Completions
    from torchtrain.posttrain.environments import Environments, run_episodes
    from torchtrain.posttrain.rollout import RolloutLoader

    encode = lambda text: [ord(c) % 50 for c in text]  # noqa: E731
    turns = iter([[[7, 9], [1, 9]], [[5, 9], [8, 9]]])  # row 0 answers 7 then 5, row 1 answers 1 then 8

    def generate(contexts):
        tokens = next(turns)
        return Completions(tokens, [[-0.5, -0.25]] * len(tokens), [True] * len(tokens))
    decode = lambda ids: "".join(str(i) for i in ids)  # noqa: E731
    ep = run_episodes(Environments(again, "toy_environments:again"), generate, [[3, 3], [4]], [("q", "5"), ("q", "8")],
                      encode, decode, seq_len=100, max_new=2, max_turns=2)
    obs = encode(AGAIN)
    assert ep.tokens == [[7, 9, *obs, 5, 9], [1, 9, *obs, 8, 9]] and ep.last == [[5, 9], [8, 9]]
    assert ep.sampled[0] == [True, True] + [False] * len(obs) + [True, True]
    assert ep.logps[0] == [-0.5, -0.25] + [0.0] * len(obs) + [-0.5, -0.25]
    assert ep.rewards == [1.0, 1.0] and ep.stopped == [True, True] and not ep.errors
    turns = iter([[[7, 9], [1, 9]]])  # no room for a second turn: the episode ends after the first
    short = run_episodes(Environments(again, "toy_environments:again"), generate, [[3, 3], [4]], [("q", "5")] * 2,
                         encode, decode, seq_len=len(obs) + 4, max_new=2, max_turns=2)
    assert short.tokens == [[7, 9], [1, 9]] and short.rewards == [0.0, 0.0]
    failed = run_episodes(Environments(broken, "toy_environments:broken"), generate, [[3]], [("q", "5")], encode,
                          decode, seq_len=100, max_new=2, max_turns=2)
    assert failed.tokens == [[]] and "the sandbox is down" in str(failed.errors[0][1])
    rows = RolloutLoader._rows(SimpleNamespace(seq_len=80), [[3, 3]], ep.tokens[:1], ep.logps[:1], torch.ones(1),
                               ep.sampled[:1])
    labelled = rows["labels"][0][rows["labels"][0] >= 0].tolist()
    assert labelled == [7, 9, 5, 9] and rows["advantages"][0].count_nonzero() == 4


@pytest.mark.slow
def test_tool_use_rises_under_rl_with_a_calculator_environment(tmp_path):
    """The tool toy (`tools/tool_toy.py`): after fine-tuning on conversations that call the calculator half the time,
    sampled episodes on held-out questions succeed about half the time; 20 GRPO steps with the calculator as the
    environment (its reward the only one) raise that by at least 0.15 (0.57 -> 0.90 measured on torch 2.11, 2.13 and 2.14).
    The rate warms up over 5 steps: Adam's first steps move every weight by about the full rate, and at 1.5e-3
    without a warm-up, from a fine-tuned model that was only a little different, the first step alone took the
    training reward from 0.59 to 0.11 (0.60 held-out after 20 steps, 0.31 after 40)."""
    from torchtrain.tools.tool_toy import write

    root = str(tmp_path)
    write(root, prompts=2000, seed=1)
    tok = ["--model.hf_assets_path", os.path.join(root, "tokenizer"), "--job.print_config", "false"]
    sft, rl = os.path.join(root, "sft"), os.path.join(root, "rl")
    proc = run_train([*MODEL, *tok, "--training.dataset", "chat", "--training.dataset_path",
                      os.path.join(root, "sft.jsonl"), "--training.seq_len", "128", "--training.local_batch_size", "16",
                      "--training.steps", "300", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "10",
                      "--checkpoint.enable", "--checkpoint.interval", "300", "--job.dump_folder", sft])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_train([*MODEL, *tok, "--training.dataset", "prompts", "--training.dataset_path",
                      os.path.join(root, "prompts.jsonl"), "--training.seq_len", "80", "--training.local_batch_size",
                      "64", "--training.steps", "20", "--grpo.enable", "--grpo.num_generations", "4",
                      "--grpo.max_completion_length", "6", "--grpo.max_turns", "2", "--grpo.reward_funcs", "",
                      "--grpo.environment", "torchtrain.tools.tool_toy:calculator", "--optimizer.lr", "1e-3",
                      "--lr_scheduler.warmup_steps", "5", "--checkpoint.enable", "--checkpoint.interval", "20",
                      "--checkpoint.initial_load_path", os.path.join(sft, "checkpoint"), "--job.dump_folder", rl])
    assert proc.returncode == 0, proc.stderr[-3000:]

    def success(folder: str) -> float:
        out = subprocess.run([sys.executable, "-m", "torchtrain.score", "--checkpoint", folder, "--prompts",
                              os.path.join(root, "heldout.jsonl"), "--environment",
                              "torchtrain.tools.tool_toy:calculator", "--reward-funcs", "--max-new-tokens", "6",
                              "--max-turns", "2", "--temperature", "1", "--samples", "4", "--json"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)["mean_reward"]
    before, after = success(sft), success(rl)
    print(f"tool toy: held-out success {before:.3f} after SFT, {after:.3f} after 20 GRPO steps")
    assert after >= before + 0.15, (before, after)


@pytest.mark.dist
def test_rollouts_sampled_a_version_ahead_lag_by_one_match_one_process_and_resume_bitwise(suite):
    """grpo.max_staleness = 1: iteration 0 trains on rows of the initial weights, as the synchronous run does (the same
    first loss), every later one on rows the sampling copy drew in the background during the iteration before (lag 1,
    logged), corrected by decoupled PPO; the trainer's idle share is logged; FSDP 2 (its collectives on the main
    thread beside the background sampling) matches one process, and a run resumed from a checkpoint -- which holds the
    background's rows -- continues bitwise."""
    sync, ahead = suite.results["single", SYNC].records, suite.results["single", AHEAD].records
    assert [r["grpo/staleness"] for r in ahead] == [0, 1, 1, 1] and all(r["grpo/staleness"] == 0 for r in sync)
    assert ahead[0]["loss"] == sync[0]["loss"] and ahead[1]["loss"] != sync[1]["loss"]
    assert all(0 <= r["grpo/idle_fraction"] < 1 for r in ahead[1:])
    suite.check_resumes_bitwise("fsdp2", 2, AHEAD, rtol=RTOL, atol=ATOL)


@pytest.mark.dist
def test_generators_apart_sample_as_the_colocated_copy_and_resume_bitwise(suite):
    """grpo.generator_ranks = 2 (posttrain/generator_ranks.py): 2 FSDP trainer ranks and 2 generator ranks reproduce
    the colocated copy's run (FSDP 2, each rank sampling its own rows) step by step within 1e-6 -- the same rows,
    sampled by the same code with the same RNG states; the trainer's log-probs equal the generators' within 1e-6
    (relative) after every sync; the sync is logged; a run resumed mid-iteration continues bitwise (the generators
    hold only weights, re-sent whole at the first sync); a generator split by TP samples the same completions. With
    grpo.max_staleness = 1 the generators sample the next iteration while the trainers train, the run is the
    colocated sampled-ahead one, and it resumes bitwise too."""
    colocated = suite.results["fsdp2", TWO_PASSES].records
    apart, resumed = suite.check_resumes_bitwise(APART, 1, TWO_PASSES, rtol=RTOL, atol=ATOL)
    assert "(+ 2 sampling apart): dp_shard 2" in apart.log
    assert [r["loss"] for r in apart.records] == pytest.approx([r["loss"] for r in colocated], rel=1e-6, abs=1e-6)
    assert [r["grpo/reward"] for r in apart.records] == [r["grpo/reward"] for r in colocated]
    iterations = [r for r in apart.records if r["step"] % 2 == 1]  # each iteration's first step, right after a sync
    assert len(iterations) == 2 and all(r["grpo/sampler_logp_rel_diff"] <= 1e-6 for r in iterations), iterations
    assert all(r["grpo/weight_sync_bytes"] == colocated[0]["grpo/weight_sync_bytes"] > 0 for r in iterations)
    # one generator of 2 ranks under TP 2 (grpo.generator_tensor_parallel_degree): the same completions; its
    # log-probs within 2e-6 (TP splits the head's and the attention's reductions: more float32 rounding)
    split, = suite.check([APART + " --grpo.generator_tensor_parallel_degree 2"], rtol=RTOL, atol=ATOL, extra=TWO_PASSES)
    assert [r["grpo/reward"] for r in split.records] == [r["grpo/reward"] for r in colocated]
    assert all(r["grpo/sampler_logp_rel_diff"] <= 2e-6 for r in split.records if r["step"] % 2 == 1), split.records
    ahead, _ = suite.check_resumes_bitwise(APART, 2, AHEAD, rtol=RTOL, atol=ATOL)  # (the pending rows' version kept)
    assert [r["loss"] for r in ahead.records] == pytest.approx(
        [r["loss"] for r in suite.results["fsdp2", AHEAD].records], rel=1e-6, abs=1e-6)
    assert [r["grpo/staleness"] for r in ahead.records] == [0, 1, 1, 1]
    from torchtrain.posttrain.timeline import read, render
    from torchtrain.tools.parity import layout_dump_folder, parse_layout

    timeline = read(layout_dump_folder(parse_layout(APART), suite.variant_folder(AHEAD)))  # trainer rank 0's
    assert [(it.iteration, it.lag) for it in timeline] == [(0, 0), (1, 1), (2, 1), (3, 1)]
    assert "  sampler |" in render(timeline) and all(it.sync > 0 and it.sampling > 0 for it in timeline)


def test_a_rollout_timeline_draws_the_waits_the_syncs_and_the_sampling(tmp_path):
    """posttrain/timeline.py on fixed iterations: a synchronous one samples inside its wait, after the sync; one
    sampled ahead was sampled from the end of the previous iteration's wait, while the trainer trained."""
    from torchtrain.posttrain.timeline import Iteration, TimelineWriter, read, render, spans

    its = [Iteration(0, 100.0, 2.0, 1.0, 1.0, 0), Iteration(1, 110.0, 2.0, 1.0, 6.0, 1),
           Iteration(2, 118.0, 2.0, 1.0, 5.0, 1)]
    trainer, sampler = spans(its)
    assert trainer[:3] == [(100.0, 101.0, "sync"), (101.0, 102.0, "wait"), (102.0, 110.0, "train")]
    assert sampler == [(101.0, 102.0), (102.0, 108.0), (112.0, 117.0)]
    picture = render(its, width=20).splitlines()  # one second a column
    assert picture[1] == "  trainer |Sw########Sw######Sw|  S weight sync, w waiting for rows, # training"
    assert picture[2] == "  sampler | sssssss    sssss   |  s sampling"
    assert picture[3] == "  the trainer waited 22% of iterations 0-1"  # (4 s of 18)
    writer = TimelineWriter(str(tmp_path))
    for it in [*its, Iteration(1, 130.0, 1.0, 0.5, 6.0, 1)]:  # (a resumed run writes iteration 1 again)
        writer.write(it)
    assert [it.start for it in read(str(tmp_path))] == [100.0, 130.0, 118.0]


def test_generator_ranks_are_checked_against_the_job_and_routed_by_data_rank():
    """The split (distributed/roles.py) and the routing (posttrain/generator_ranks.py), without a process group:
    the trainer ranks are the job's less the generators, their degrees multiply to them, a generator (the leader of
    its TP group) serves whole data-parallel ranks (a TP group's ranks on one generator), and a split that does not
    fit is one line."""
    from torchtrain.config import ConfigError
    from torchtrain.config.parallelism import Parallelism
    from torchtrain.distributed.parallel_dims import ParallelDims
    from torchtrain.distributed.roles import Roles, check_generators, trainer_world
    from torchtrain.posttrain.generator_ranks import Routing

    roles = [Roles(rank, 6, 2) for rank in range(6)]
    assert [(r.is_generator, r.group_rank, r.group_world) for r in roles] == \
        [(False, 0, 4), (False, 1, 4), (False, 2, 4), (False, 3, 4), (True, 0, 2), (True, 1, 2)]
    routing = Routing(roles[0], [0, 0, 1, 1])  # TP 2 x DP 2: ranks 0 and 1 hold data rank 0
    assert [routing.generator_of(t) for t in range(4)] == [4, 4, 5, 5] and routing.trainers_of(5) == [2, 3]
    split = Routing(Roles(0, 6, 4), [0, 1], tp=2)  # 2 trainers (DP 2), 2 generators of TP 2
    assert [split.generator_of(t) for t in range(2)] == [2, 4] and [split.leader(r) for r in range(2, 6)] == [2, 2, 4, 4]
    assert split.trainers_of(4) == [1] and split.trainers_of(5) == []
    assert ParallelDims.from_config(Parallelism(tensor_parallel_degree=2), 4, 2).dp == 2

    def split_job(ranks, tp):
        return SimpleNamespace(grpo=SimpleNamespace(enable=True, generator_ranks=ranks,
                                                    generator_tensor_parallel_degree=tp))

    check_generators(split_job(2, 2), 1)  # one generator of TP 2 for one data-parallel rank
    from torchtrain.posttrain.generator_ranks import check_transport

    nccl = SimpleNamespace(grpo=SimpleNamespace(generator_transport="nccl"))
    check_transport(nccl, torch.device("cuda", 0))  # (a CUDA job: its GPUs; the test runs nothing on them)
    with pytest.raises(ConfigError, match=r"^\[grpo.generator_transport\] nccl moves the weights between GPUs, and "
                                          r"this job runs on cpu: use gloo$"):
        check_transport(nccl, torch.device("cpu"))
    for call, says in [(lambda: trainer_world(2, 2), "[grpo.generator_ranks] 2 generator ranks of a job of 2 leave "
                                                     "no rank to train"),
                       (lambda: check_generators(split_job(2, 1), 1),
                        "[grpo.generator_ranks] 2 generators for 1 data-parallel ranks of trainers"),
                       (lambda: ParallelDims.from_config(Parallelism(data_parallel_shard_degree=4), 2, 2),
                        "but the world size is 2; make the product equal the number of processes (or set "
                        "data_parallel_shard_degree = -1 to use the remaining ranks) -- the trainer ranks: the job's "
                        "4 less grpo.generator_ranks = 2")]:
        with pytest.raises(ConfigError) as e:
            call()
        assert says in str(e.value)


@pytest.mark.dist
def test_trainer_old_log_probs_make_the_first_ratio_exactly_one(suite):
    for records in (suite.results["cp2", KL_CP].records, suite.results["single", KL_CP].records):
        assert records[0]["grpo/ratio"] == 1.0 and records[0]["grpo/clip_fraction"] == 0.0


@pytest.mark.dist
@pytest.mark.parametrize("variant,layout", [(SEQ, "cp2"), (DR, "fsdp2")], ids=["gspo_cp2", "dr_grpo_fsdp2"])
def test_other_objectives_match_one_process(suite, variant, layout):
    """GSPO's per-completion ratio and GRPO's per-completion mean under context parallelism (each rank holds part of
    every completion: the sums are all-reduced, a completion counted once); Dr. GRPO's constant normaliser under
    FSDP 2."""
    single = suite.results["single", variant]
    assert single.records[0]["grpo/ratio"] == pytest.approx(1.0, abs=1e-6)
    suite.check([layout], rtol=RTOL, atol=ATOL, extra=variant)


@pytest.mark.dist
def test_dynamic_sampling_and_overlong_shaping_match_one_process(suite):
    """DAPO's dynamic sampling chooses among every data-parallel rank's groups (gathered) as one process chooses
    among its own: FSDP 2 trains on the same groups, in the same number of rounds, and matches one process."""
    run, = suite.check(["fsdp2"], rtol=RTOL, atol=ATOL, extra=DYN)
    single = suite.results["single", DYN]
    keys = ("grpo/sampling_rounds", "grpo/groups_dropped")
    assert [[r[k] for k in keys] for r in run.records] == [[r[k] for k in keys] for r in single.records]
    assert sum(r["grpo/groups_dropped"] for r in single.records) > 0  # some groups agreed and were replaced


# ------------------------------------------------------------------ bad input
REWARDS_MODULE = '''
def raises(completion, answer, prompt):
    raise ValueError("no grader for " + answer)

def text(completion, answer, prompt):
    return "yes"

def flaky(completion, answer, prompt):
    if completion == answer:
        return 1.0
    raise KeyError(completion)


def no_engine(ctx):
    raise ImportError("vllm is not installed")


class OneShort:
    def sync_weights(self):
        return 0.0, 0

    def __call__(self, prompts, sampling, generators):
        from torchtrain.posttrain.decoding import Completions
        return Completions([[7]] * (len(prompts) - 1), [[-1.0]] * (len(prompts) - 1), [True] * (len(prompts) - 1))


def one_short(ctx):
    return OneShort()
'''


BAD_GENERATORS = {  # case: (grpo.generator, what the one line says)
    "generator_not_importable": ("no_such_engine:build", "[grpo.generator] cannot import 'no_such_engine:build'"),
    "generator_raises": ("my_rewards:no_engine",
                         "[grpo.generator] 'my_rewards:no_engine' raised ImportError: vllm is not installed"),
    "generator_one_short": ("my_rewards:one_short", "[grpo.generator] 'my_rewards:one_short' returned 7 completions"),
}


@pytest.mark.parametrize("case", ["no_answer", "too_long", "raises", "not_a_number", "pipeline_in_place",
                                  "reward_model_missing", "reward_model_pipeline", "environment_raises",
                                  "generator_ranks_in_place", "generator_ranks_no_trainer", "generator_ranks_tp",
                                  *BAD_GENERATORS])
def test_bad_input_is_one_line_before_training(tmp_path, case):
    from torchtrain.tools.grpo_toy import write

    root = str(tmp_path)
    write(root, prompts=16)
    with open(os.path.join(root, "my_rewards.py"), "w") as f:
        f.write(REWARDS_MODULE)
    path = os.path.join(root, "prompts.jsonl")
    args = job(root, None) + ["--training.local_batch_size", "8", "--training.steps", "1",
                            "--job.dump_folder", os.path.join(root, "out")]
    if case == "no_answer":
        with open(path, "a") as f:
            f.write('{"prompt": "what is 3 mod 2?"}\n')
        expect = f"{path}:17"
    elif case == "too_long":
        with open(path, "a") as f:
            f.write(json.dumps({"prompt": "what is " + "9" * 40 + " mod 2?", "answer": "1"}) + "\n")
        expect = f"{path}:17"
    elif case == "pipeline_in_place":
        args += ["--parallelism.pipeline_parallel_degree", "2"]
        expect = "[grpo.generator]"
    elif case == "environment_raises":
        args += ["--grpo.environment", "toy_environments:broken"]
        expect = ("[grpo.environment] environment 'toy_environments:broken': reset raised RuntimeError: the sandbox is "
                  "down")
    elif case.startswith("reward_model"):
        args += ["--grpo.reward_model", os.path.join(root, "no_such_checkpoint")]
        if case == "reward_model_pipeline":
            args += [*COPY, "--parallelism.pipeline_parallel_degree", "2"]
        expect = "[grpo.reward_model] " + ("the reward model scores completions in the data-parallel" if
                                           case == "reward_model_pipeline" else f"{root}/no_such_checkpoint does not exist")
    elif case == "generator_ranks_tp":
        args += [*COPY, "--grpo.generator_ranks", "1", "--grpo.generator_tensor_parallel_degree", "2"]
        expect = "[grpo.generator_tensor_parallel_degree] 2 splits each generator over that many of " \
                 "grpo.generator_ranks (1): make it a multiple of 2"
    elif case.startswith("generator_ranks"):
        args += ["--grpo.generator_ranks", "1"] + (list(COPY) if case == "generator_ranks_no_trainer" else [])
        expect = "[grpo.generator_ranks] 1 " + ("generator ranks of a job of 1 leave no rank to train" if
                                                case == "generator_ranks_no_trainer" else
                                                "ranks apart sample with the sampling copy they hold")
    elif case in BAD_GENERATORS:
        factory, expect = BAD_GENERATORS[case]
        args += ["--grpo.generator", factory]
    else:
        args += ["--grpo.reward_funcs", "my_rewards:" + ("raises" if case == "raises" else "text")]
        expect = "'my_rewards:raises' raised ValueError" if case == "raises" else "returned 'yes', not a finite number"
    proc = run_train(args, env={"PYTHONPATH": os.pathsep.join([root, PLUGINS])})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expect in proc.stderr, proc.stderr[-3000:]
    assert_no_traceback(proc.stderr)
    out = os.path.join(root, "out")  # (a generator's wrong answer shows at the first sampling: no step logged)
    assert not os.path.exists(os.path.join(out, "metrics.jsonl")) or (case == "generator_one_short" and
                                                                     not read_metrics(out))


def test_a_reward_failing_during_training_is_scored_zero_and_counted(tmp_path):
    from torchtrain.tools.grpo_toy import write

    root = str(tmp_path)
    write(root, prompts=64)
    with open(os.path.join(root, "my_rewards.py"), "w") as f:
        f.write(REWARDS_MODULE)
    out = os.path.join(root, "out")
    args = job(root, None) + ["--training.local_batch_size", "8", "--training.steps", "2", "--metrics.log_freq", "1",
                            "--grpo.reward_funcs", "my_rewards:flaky", "--job.dump_folder", out]
    proc = run_train(args, env={"PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    assert records[0]["grpo/reward_errors"] > 0 and records[0]["grpo/reward"] == 0.0
    assert proc.stdout.count("reward function 'my_rewards:flaky' raised KeyError") == 1, proc.stdout[-3000:]
    stop = run_train(args + ["--grpo.on_reward_error", "stop", "--job.dump_folder", out + "_stop"],
                     env={"PYTHONPATH": root})
    assert stop.returncode == 2 and "[grpo.on_reward_error]" in stop.stderr, stop.stderr[-3000:]
    assert_no_traceback(stop.stderr)


def test_a_trainer_waiting_for_its_generator_hears_it_sample_and_tells_its_hang_monitor(monkeypatch):
    """posttrain/generator_ranks.py, without processes: a generator sampling for longer than a quarter of the hang
    timeout sends each trainer still waiting for its answer a beat per quarter (none without a hang monitor); the
    trainer passes each to its heartbeat and takes the answer after them."""
    from torchtrain.posttrain import generator_ranks as gr
    from torchtrain.posttrain.decoding import Completions, Sampling

    sent, clock = [], [0.0]
    monkeypatch.setattr(gr.time, "monotonic", lambda: clock[0])
    bridge = SimpleNamespace(send=lambda obj, dst: sent.append((obj, dst)))
    beats = gr.Beats(bridge, 15.0)
    beats.waiting = [0, 1]
    for clock[0] in (5.0, 16.0, 20.0, 31.0):  # token steps at these seconds
        beats()
    assert sent == [(gr.BEAT, 0), (gr.BEAT, 1), (gr.BEAT, 0), (gr.BEAT, 1)]  # at 16 s and 31 s
    quiet = gr.Beats(bridge, None)
    quiet.waiting, clock[0] = [0], 100.0
    quiet()
    assert len(sent) == 4

    answer = (Completions([[5, 1]], [[-0.5, -0.1]], [True]), [torch.Generator().manual_seed(7).get_state()])
    inbox = [gr.BEAT, gr.BEAT, answer]
    remote = gr.RemoteGenerator.__new__(gr.RemoteGenerator)
    remote.bridge = SimpleNamespace(send=lambda obj, dst: None, recv=lambda src: inbox.pop(0))
    remote.peer, beats_heard = 2, []
    remote.heartbeat = lambda: beats_heard.append(1)
    rows = [torch.Generator()]
    out = remote([[3, 4]], Sampling(), rows)
    assert out.tokens == [[5, 1]] and len(beats_heard) == 2
    assert torch.equal(rows[0].get_state(), torch.Generator().manual_seed(7).get_state())
