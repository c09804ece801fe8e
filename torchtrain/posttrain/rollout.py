"""GRPO's rollouts as the trainer's data: sample, reward, normalise, then hand the rows out as micro-batches.

One iteration on data-parallel rank r of dp, with b rows per step on each rank (local batch x gradient
accumulation), G = grpo.num_generations, S = grpo.steps_per_generation, mu = grpo.num_iterations:

1. prompts: step s of the iteration (s < S) trains on the global prompts c + s (dp P) + [0, dp P), P = b / G whole
   groups per rank, of which rank r takes c + s (dp P) + j dp + r (j < P) -- a step's prompts are the same under
   any layout, as the data loader's windows are (`data/loader.py`); c then advances by S dp P;
2. sampling: G completions of each prompt by the model being trained (`posttrain/decoding.py`), in its
   layout, by an unsharded copy synced from it (on every rank, or on ranks apart: `generator_ranks.py`), or by a
   generator of your own (a `Generator`,
   `posttrain/generators.py`), row (k, g) drawing its random numbers from its own generator seeded by (debug.seed,
   k, g): what prompt k's completions are does not depend on the layout, the batch it is sampled
   in, or a restart;
3. rewards: each completion decoded (without its stop token) and scored (`posttrain/rewards.py`), plus a reward
   model's score of its tokens (grpo.reward_model: `posttrain/reward_model.py`), plus DAPO's overlong penalty on
   its token count when grpo.overlong_buffer_len is set;
   advantages A = (R - mean over the group) / (std over the group + 1e-4) (without the division when
   grpo.scale_rewards is false);
4. rows: the prompt and the completion in one row of training.seq_len, labels on the completion's tokens only,
   with the sampler's log-probs (`old_logps`), A (`advantages`) and, with grpo.beta > 0, the reference's
   log-probs (`ref_token_logps`, scored once per iteration) on the same positions;
5. the S steps take their rows in order, and the whole pass repeats mu times (`posttrain/policy_loss.py`).

The state saved in checkpoints (per data rank, as the loader's) is the prompt counter c, the micro-batches handed
out of the current iteration and its rows themselves: a run resumed mid-iteration trains on the very rows it
would have, and the next iteration's samples are those of an uninterrupted run (their random numbers depend on
(seed, k, g) only).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist

from torchtrain.config.fields import ConfigError
from torchtrain.config.grpo import Grpo
from torchtrain.data.prompts import PromptStream
from torchtrain.distributed.utils import all_reduce
from torchtrain.posttrain.ahead import Ahead
from torchtrain.posttrain.decoding import Sampling
from torchtrain.posttrain.environments import play
from torchtrain.posttrain.generators import Generator, check_completions
from torchtrain.posttrain.rewards import RewardError, Rewards, overlong_penalty
from torchtrain.posttrain.rollout_scoring import score_rows, trainer_scoring
from torchtrain.posttrain.timeline import Iteration, TimelineWriter
from torchtrain.utils.json_tensor import tensor_from_json, tensor_to_json
from torchtrain.utils.logging import logger
from torchtrain.utils.token_loss import IGNORE_INDEX

ROLLOUT_STATS = ("completions", "reward", "reward_sq", "length", "stopped", "errors", "rounds", "dropped", "seconds",
                 "sync_seconds", "sync_bytes", "model_score", "waited", "lag", "idle", "logp_gap")


class Group(NamedTuple):
    """One prompt's sampled group: its global index (the data order), its tokens, and per completion the tokens,
    the sampler's log-probs, whether it stopped, its reward, and the reward model's part of it (its score, when the job
    has one)."""

    index: int
    prompt: list[int]
    tokens: list[list[int]]
    logps: list[list[float]]
    stopped: list[bool]
    rewards: list[float]
    scores: tuple[float, ...] = ()
    sampled: tuple[tuple[bool, ...], ...] = ()
    """With an environment, which of each completion's tokens the model sampled (the rest are context)."""


class RewardStop(ConfigError):
    """grpo.on_reward_error = "stop": a reward function failed during training (the message names it)."""


def stop_together(message: str | None) -> None:
    """Every rank raises RewardStop, with the first failing rank's message, when any rank has one (one all-reduce;
    the messages gathered only then), so the run stops cleanly everywhere at the same point."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if message:
            raise RewardStop(message)
        return
    flag = torch.tensor([0 if message is None else 1], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag)
    if flag.item():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
        raise RewardStop(next(m for m in messages if m))


def row_seed(seed: int, prompt: int, member: int) -> int:
    """The seed of completion `member` of global prompt `prompt`'s group."""
    return int.from_bytes(hashlib.sha256(f"rollout|{seed}|{prompt}|{member}".encode()).digest()[:8], "little") >> 1


def group_advantages(rewards: torch.Tensor, scale: bool) -> torch.Tensor:
    """(groups, G) rewards -> advantages: centred on each group's mean, divided by its std (+1e-4) when `scale`."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, keepdim=True) + 1e-4) if scale else centred


class RolloutLoader:
    """This rank's micro-batches of rollouts (module docstring); `attach` gives it the train step to sample with."""

    def __init__(self, stream: PromptStream, grpo: Grpo, rewards: Rewards, tokenizer, seq_len: int,
                 local_batch_size: int, grad_accum: int, data_rank: int, data_degree: int, seed: int,
                 reward_model=None, environments=None):
        rows = local_batch_size * grad_accum
        if rows % grpo.num_generations:
            raise ConfigError(f"[grpo.num_generations] each rank's step holds local_batch_size x gradient accumulation "
                              f"= {rows} rows, not a multiple of the {grpo.num_generations} completions of a prompt: "
                              f"choose num_generations dividing {rows}, or a larger batch")
        self.stream, self.grpo, self.rewards, self.tokenizer = stream, grpo, rewards, tokenizer
        self.reward_model = reward_model  # (`reward_model.py::RewardModel`, or None)
        self.environments = environments  # (`environments.py::Environments`, or None: one turn per completion)
        self.ahead = Ahead() if grpo.max_staleness else None  # (`ahead.py`: the next iteration sampled meanwhile)
        self._last: tuple[float, float] | None = None  # (start, seconds waited) of the previous iteration
        self.timeline = TimelineWriter(None)  # (`timeline.py`: where the iterations' times go; none by default)
        self.seq_len, self.local_batch_size, self.grad_accum = seq_len, local_batch_size, grad_accum
        self.rank, self.degree, self.seed = data_rank, data_degree, seed
        self.prompts_per_step = rows // grpo.num_generations  # per rank
        self.micro_per_pass = grad_accum * grpo.steps_per_generation
        self.consumed = 0
        self.position = 0
        self.rows: dict[str, torch.Tensor] | None = None
        self.step = self.reference = self.generator = self.heartbeat = None
        self.iterations = 0
        self._stats: torch.Tensor | None = None
        self._warned: set[str] = set()

    def attach(self, step, reference, generator: Generator, heartbeat: Callable[[], None] | None = None) -> None:
        """The train step (its layout and context), the reference (None: beta = 0), where completions come from, and
        what tells the hang monitor the rollout makes progress."""
        self.step, self.reference, self.generator, self.heartbeat = step, reference, generator, heartbeat

    # ------------------------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            if self.rows is None or self.position >= self.micro_per_pass * self.grpo.num_iterations:
                self._iteration()
            start = (self.position % self.micro_per_pass) * self.local_batch_size
            self.position += 1
            yield {k: v[start:start + self.local_batch_size] for k, v in self.rows.items()}

    def global_prompts(self) -> list[int]:
        """The global indices of this rank's prompts of the next iteration, step by step (module docstring)."""
        per_step = self.prompts_per_step * self.degree
        return [self.consumed + s * per_step + j * self.degree + self.rank
                for s in range(self.grpo.steps_per_generation) for j in range(self.prompts_per_step)]

    def _iteration(self) -> None:
        grpo = self.grpo
        start, wall = time.perf_counter(), time.time()
        if self.ahead is None:
            (sync_seconds, sync_bytes), lag = self.generator.sync_weights(), 0
            mine, rounds, seconds, errors, dropped = self._collect()
        else:
            (mine, seconds, errors, fatal), (sync_seconds, sync_bytes), lag = self.ahead.take(self)
            rounds, dropped = 1, 0
            if grpo.on_reward_error == "stop":
                stop_together(fatal)
        waited = time.perf_counter() - start  # the trainer idle: sampling, or waiting for the background's rows
        idle = self._last[1] / (start - self._last[0]) if self._last is not None else -1.0
        self._last = (start, waited)
        self._build(mine, rounds, seconds, errors, dropped, sync_seconds, sync_bytes, [waited, float(lag), idle])
        self.timeline.write(Iteration(self.iterations - 1, wall, waited, sync_seconds, seconds, lag))

    def _collect(self) -> tuple[list[Group], int, float, int, int]:
        """The iteration's groups of this rank, sampled now (one round, or DAPO's rounds): (groups, rounds, sampling
        seconds, reward errors, groups dropped)."""
        grpo = self.grpo
        kept, agreeing, rounds, seconds, errors = [], [], 0, 0.0, 0
        need = self.prompts_per_step * grpo.steps_per_generation * self.degree  # the iteration's groups, all ranks
        while True:  # one round without grpo.dynamic_sampling
            groups, spent, failed = self._sample_round()
            rounds, seconds, errors = rounds + 1, seconds + spent, errors + failed
            if not grpo.dynamic_sampling:
                mine, dropped = groups, 0
                break
            for group in sorted(self._everyones(groups)):  # every rank's groups, in the data order
                (kept if len(set(group.rewards)) > 1 else agreeing).append(group)
            if len(kept) >= need or rounds >= grpo.max_sampling_rounds:
                chosen = (kept + agreeing)[:need]  # still short after the last round: agreeing groups fill in
                per_step = self.prompts_per_step * self.degree  # dealt as global_prompts deals a round
                mine = [chosen[s * per_step + j * self.degree + self.rank]
                        for s in range(grpo.steps_per_generation) for j in range(self.prompts_per_step)]
                dropped = len(kept) + len(agreeing) - need
                break
        return mine, rounds, seconds, errors, dropped

    def _build(self, mine: list[Group], rounds: int, seconds: float, errors: int, dropped: int, sync_seconds: float,
               sync_bytes: int, timing: list[float]) -> None:
        """The iteration's rows from its groups (module docstring, 3-4), and its statistics."""
        g, grpo = self.grpo.num_generations, self.grpo
        rows = [list(group.prompt) for group in mine for _ in range(g)]
        tokens = [t for group in mine for t in group.tokens]
        logps = [lp for group in mine for lp in group.logps]
        sampled = [list(m) for group in mine for m in group.sampled] if self.environments is not None else None
        stopped = sum(sum(group.stopped) for group in mine)
        reward = torch.tensor([r for group in mine for r in group.rewards], dtype=torch.float64)
        advantage = group_advantages(reward.view(-1, g), grpo.scale_rewards).reshape(-1)
        self.rows = self._rows(rows, tokens, logps, advantage, sampled)
        gap = -1.0  # max over sampled tokens of |trainer - sampler| / max(|trainer|, 1) (pipeline: the last stage's)
        if grpo.old_logps == "trainer":
            sampler = self.rows["old_logps"]
            if grpo.importance_sampling_cap:  # the sampler's, kept for the mismatch weight (`policy_loss.py`)
                self.rows["sampler_logps"] = sampler
            self.rows["old_logps"] = self._trainer_logps()
            if not self.step.layout.dims.pp_enabled:
                trainer = self.rows["old_logps"]
                gap = ((trainer - sampler).abs() / trainer.abs().clamp(min=1) * (self.rows["labels"] != IGNORE_INDEX)
                       ).max().item()
        if self.reference is not None:
            self.rows["ref_token_logps"] = self._reference_logps()
        self.position = 0
        self.iterations += 1
        lengths = torch.tensor([sum(m) for m in sampled] if sampled is not None else [len(t) for t in tokens],
                               dtype=torch.float64)
        model_score = sum(s for group in mine for s in group.scores)
        first = float(self.rank == 0)  # the job's rounds and dropped groups, counted once in the sum over data ranks
        self._stats = torch.tensor([float(len(rows)), reward.sum().item(), reward.square().sum().item(),
                                    lengths.sum().item(), float(stopped), float(errors), first * rounds,
                                    first * dropped, seconds, sync_seconds, float(sync_bytes), model_score, *timing,
                                    gap],
                                   dtype=torch.float64)

    def _everyones(self, groups: list[Group]) -> list[Group]:
        """The groups of every data-parallel rank (one all-gather of their completions over the data-parallel mesh):
        dynamic sampling chooses among them as one process would, whatever the data-parallel degree."""
        if self.degree == 1:
            return groups
        mesh = self.step.layout.dims.dp_mesh
        gathered = [None] * mesh.size()
        dist.all_gather_object(gathered, groups, group=mesh.get_group())
        return [group for part in gathered for group in part]

    def _sample_round(self) -> tuple[list[Group], float, int]:
        """Sample and score the next prompts of this rank (`global_prompts`): their groups, the sampling seconds and
        the reward errors (a reward failure that stops the run stops every rank here)."""
        groups, seconds, errors, fatal = self.sample_prompts(self.next_prompts())
        if self.grpo.on_reward_error == "stop":
            stop_together(fatal)
        return groups, seconds, errors

    def next_prompts(self) -> list[int]:
        """This rank's prompts of the next round (`global_prompts`), counted as consumed."""
        indices = self.global_prompts()
        self.consumed += self.prompts_per_step * self.degree * self.grpo.steps_per_generation
        return indices

    def sample_prompts(self, indices: list[int]) -> tuple[list[Group], float, int, str | None]:
        """Sample and score the prompts `indices`: their groups, the sampling seconds, the reward errors and the first
        failure that stops the run (grpo.on_reward_error = "stop"; None). No collective of its own with the sampling
        copy, so it may run in the background (`ahead.py`)."""
        g, grpo = self.grpo.num_generations, self.grpo
        prompts = [self.stream.at(k) for k in indices]
        rows = [list(p.ids) for p in prompts for _ in range(g)]
        generators = [torch.Generator().manual_seed(row_seed(self.seed, k, m)) for k in indices for m in range(g)]
        start = time.perf_counter()
        sampling = Sampling(grpo.temperature, grpo.top_k, grpo.top_p)

        def generate(contexts: list[list[int]]):
            out = self.generator(contexts, sampling, generators)
            check_completions(out, len(contexts), grpo.generator)
            return out
        ep = play(self.environments, generate, rows, [(p.text, p.answer) for p in prompts for _ in range(g)],
                  self.tokenizer, self.seq_len, grpo.max_completion_length, grpo.max_turns, self.heartbeat)
        tokens, logps, stopped, last, sampled, failed = ep.tokens, ep.logps, ep.stopped, ep.last, ep.sampled, \
            dict(ep.errors)
        seconds = time.perf_counter() - start
        rewards, errors, fatal = [], 0, None
        for i, (turn, stop) in enumerate(zip(last, stopped)):
            prompt = prompts[i // g]
            text = self.tokenizer.decode(turn[:-1] if stop else turn)
            if self.heartbeat is not None:  # (a reward function may be slow: running code, say)
                self.heartbeat()
            try:
                if i in failed:
                    raise failed[i]
                rewards.append(ep.rewards[i] + self.rewards.score(text, prompt.answer, prompt.text))
            except RewardError as e:
                if grpo.on_reward_error == "stop":
                    fatal = fatal or f"[grpo.on_reward_error] {e} on a completion of {prompt.where}"
                    rewards.append(0.0)
                    continue
                errors += 1
                rewards.append(0.0)
                if e.function not in self._warned:
                    self._warned.add(e.function)
                    logger.warning("grpo: %s on a completion of %s: scored 0 and counted in grpo/reward_errors "
                                   "(grpo.on_reward_error)", e, prompt.where)
        lengths = torch.tensor([sum(mask) for mask in sampled], dtype=torch.float64)
        scores = torch.zeros(len(rows), dtype=torch.float64)
        if self.reward_model is not None:  # every rank the same number of forwards (as many rows); the last turn read
            final = [[False] * (len(t) - len(turn)) + [True] * len(turn) for t, turn in zip(tokens, last)]
            scores = self.reward_model.scores(self.step, self._rows(rows, tokens, logps, scores, final),
                                              self.local_batch_size)
        shaped = (torch.tensor(rewards, dtype=torch.float64) + grpo.reward_model_weight * scores + overlong_penalty(
            lengths, grpo.max_completion_length, grpo.overlong_buffer_len, grpo.overlong_penalty_factor)).tolist()
        mine = scores.tolist() if self.reward_model is not None else []
        groups = [Group(k, list(p.ids), tokens[i * g:(i + 1) * g], logps[i * g:(i + 1) * g],
                        list(stopped[i * g:(i + 1) * g]), shaped[i * g:(i + 1) * g], tuple(mine[i * g:(i + 1) * g]),
                        tuple(tuple(m) for m in sampled[i * g:(i + 1) * g]) if self.environments is not None else ())
                  for i, (p, k) in enumerate(zip(prompts, indices))]
        return groups, seconds, errors, fatal

    def _rows(self, prompts: list[list[int]], completions: list[list[int]], logps: list[list[float]],
              advantage: torch.Tensor, sampled: list[list[bool]] | None = None) -> dict[str, torch.Tensor]:
        """The rollout rows (module docstring, 4): (rows, seq_len) each; with `sampled`, only the tokens the model
        sampled are labelled (an environment's are context)."""
        n, seq = len(prompts), self.seq_len
        ids = torch.zeros(n, seq, dtype=torch.long)
        labels = torch.full((n, seq), IGNORE_INDEX, dtype=torch.long)
        old = torch.zeros(n, seq, dtype=torch.float32)
        adv = torch.zeros(n, seq, dtype=torch.float32)
        for i, (prompt, tokens, lp) in enumerate(zip(prompts, completions, logps)):
            if not tokens:
                continue
            row = prompt + tokens
            length, first = len(row) - 1, len(prompt) - 1  # inputs, and the position predicting the first token
            ids[i, :length] = torch.tensor(row[:-1])
            mine = torch.tensor(sampled[i], dtype=torch.bool) if sampled is not None else torch.ones(len(tokens),
                                                                                                      dtype=torch.bool)
            labels[i, first:length] = torch.where(mine, torch.tensor(tokens), IGNORE_INDEX)
            old[i, first:length] = torch.tensor(lp, dtype=torch.float32) * mine
            adv[i, first:length] = float(advantage[i]) * mine
        return {"input_ids": ids, "labels": labels, "old_logps": old, "advantages": adv}

    def _reference_logps(self) -> torch.Tensor:
        """The reference's log-probs of every row's labels at the sampling temperature, (rows, seq_len)."""
        return score_rows(self.step, self.rows, self.local_batch_size, self.grpo.temperature,
                          self.reference.scoring(self.step), self.reference.logits)

    def _trainer_logps(self) -> torch.Tensor:
        """The model's own log-probs of every row's labels by the train step's forward (grpo.old_logps = "trainer")."""
        return score_rows(self.step, self.rows, self.local_batch_size, self.grpo.temperature,
                          trainer_scoring(self.step), lambda step, batch: step.forward(batch))

    # ------------------------------------------------------------------------------------ the log
    def record(self) -> dict[str, float]:
        """The latest iteration's rollout metrics over all data ranks (one all-reduce; {} before the first)."""
        if self._stats is None:
            return {}
        mesh = self.step.layout.dims.dp_mesh if self.step.layout.dims.dp > 1 else None
        stats = self._stats.to(self.step.device)
        total = all_reduce(stats.clone(), mesh) if mesh is not None else stats
        s, mine = dict(zip(ROLLOUT_STATS, total.tolist())), dict(zip(ROLLOUT_STATS, self._stats.tolist()))
        gap = all_reduce(stats[-1:].clone(), mesh, dist.ReduceOp.MAX).item() if mine["logp_gap"] >= 0 else -1.0
        n = max(s["completions"], 1.0)
        mean = s["reward"] / n
        return {"grpo/reward": mean, "grpo/reward_std": max(s["reward_sq"] / n - mean * mean, 0.0) ** 0.5,
                "grpo/completion_length": s["length"] / n, "grpo/stopped": s["stopped"] / n,
                "grpo/reward_errors": s["errors"], "grpo/iteration": float(self.iterations),
                "grpo/generation_tokens_per_s": s["length"] / max(mine["seconds"], 1e-9),
                **({"grpo/weight_sync_seconds": mine["sync_seconds"], "grpo/weight_sync_bytes": mine["sync_bytes"]}
                   if self.grpo.generator != "trainer" else {}),
                **({"grpo/reward_model_score": s["model_score"] / n} if self.grpo.reward_model else {}),
                "grpo/rollout_wait_seconds": mine["waited"], "grpo/staleness": mine["lag"],
                **({"grpo/idle_fraction": mine["idle"]} if mine["idle"] >= 0 else {}),
                **({"grpo/sampler_logp_rel_diff": gap} if gap >= 0 else {}),
                **({"grpo/sampling_rounds": s["rounds"], "grpo/groups_dropped": s["dropped"]}
                   if self.grpo.dynamic_sampling else {})}

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        rows = None if self.rows is None else {k: tensor_to_json(v) for k, v in self.rows.items()}
        stats = None if self._stats is None else self._stats.tolist()  # the iteration's metrics, logged after a resume
        ahead = self.ahead.state() if self.ahead is not None else None  # (waits for the background's rows)
        return {"prompts": self.consumed, "position": self.position, "iterations": self.iterations, "rows": rows,
                "stats": stats, "data_degree": self.degree, "fingerprint": self.stream.fingerprint(), "ahead": ahead}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "prompts" not in state:
            raise ValueError(f"rollout state lacks 'prompts' (got keys {sorted(state)}): saved by another loader")
        self.consumed, self.position = int(state["prompts"]), int(state["position"])
        self.iterations = int(state.get("iterations", 0))
        self.rows = None if state.get("rows") is None else {k: tensor_from_json(v) for k, v in state["rows"].items()}
        stats = state.get("stats")  # (a checkpoint from before a statistic was added: that iteration's are not logged)
        self._stats = None if stats is None or len(stats) != len(ROLLOUT_STATS) else torch.tensor(stats,
                                                                                                   dtype=torch.float64)
        if self.ahead is not None:
            self.ahead.load(state.get("ahead"), Group)
        if state.get("data_degree", self.degree) != self.degree and self.rows is not None:
            logger.warning("grpo: the checkpoint's rollouts were dealt over %d data-parallel ranks, this run has %d: "
                           "the rest of that iteration is skipped and sampling starts again at its next prompts",
                           state["data_degree"], self.degree)
            self.rows, self.position, self._stats = None, 0, None
            if self.ahead is not None:
                self.ahead.load(None, Group)

