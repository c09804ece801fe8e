"""Score a checkpoint on prompts with reference answers: sample completions, reward them, report the mean.

    python -m torchtrain.score --checkpoint outputs/grpo/checkpoint --prompts heldout.jsonl \\
        [--samples 1] [--temperature 0] [--reward-funcs exact ...] [--max-new-tokens N] [--seed 0] [--json]
        [--environment package.module:function] [--max-turns N]

The prompts file is GRPO's (`data/prompts.py`: "prompt" or "messages", and "answer"), rendered with the job's
chat template; the model, tokenizer and defaults come from the job (`inference/generation.py::load`): the reward
functions, completion length and stop tokens of its [grpo] section when it has one. Each prompt gets `--samples`
completions (greedy at temperature 0, one per prompt), sampled in batches with the key/value cache
(`posttrain/decoding.py`); the score is the mean reward over all of them, and its share of exact
(reward 1) completions. What a GRPO run reports as `grpo/reward` is the same quantity on its training prompts at
its sampling temperature. With an environment (`--environment`, default the job's grpo.environment) each completion
is an episode of up to `--max-turns` turns (`posttrain/environments.py`), its reward the environment's plus the
reward functions' of the model's last turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtrain.data.prompts import read_prompts
from torchtrain.posttrain.decoding import Sampling, sample
from torchtrain.posttrain.environments import Environments, play
from torchtrain.posttrain.rewards import RewardError, Rewards


@dataclass
class Score:
    mean_reward: float
    completions: int
    prompts: int
    skipped: int
    """Prompts longer than the model's max_seq_len minus the completion budget, not scored."""
    reward_errors: int


@torch.no_grad()
def score(job, prompts_path: str, rewards: Rewards, max_new_tokens: int, sampling: Sampling, samples: int = 1,
          seed: int = 0, stop_ids: tuple[int, ...] = (), batch: int = 64, environments: Environments | None = None,
          max_turns: int = 1) -> Score:
    """Mean reward of `samples` completions of every prompt at `prompts_path` by the loaded `job`'s model."""
    tok = job.tokenizer
    max_len = job.args.max_seq_len or 1 << 30
    prompts, skipped = read_prompts(prompts_path, tok, max_len, max_new_tokens, skip_long=True, key="--prompts")
    rows = [p for p in prompts for _ in range(samples)]
    generator = torch.Generator().manual_seed(seed)
    total, errors = 0.0, 0
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]

        def generate(contexts: list[list[int]]):
            return sample(job.model, contexts, max_new_tokens, sampling, generator, stop_ids, tok.vocab_size)
        ep = play(environments, generate, [list(p.ids) for p in chunk], [(p.text, p.answer) for p in chunk], tok,
                  max_len, max_new_tokens, max_turns)
        failed = dict(ep.errors)
        for i, (p, tokens, stop) in enumerate(zip(chunk, ep.last, ep.stopped)):
            try:
                if i in failed:
                    raise failed[i]
                total += ep.rewards[i] + rewards.score(tok.decode(tokens[:-1] if stop else tokens), p.answer, p.text)
            except RewardError:
                errors += 1
    return Score(total / len(rows), len(rows), len(prompts), skipped, errors)
