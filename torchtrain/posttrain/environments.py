"""Multi-turn rollouts: the model talks with an environment (a tool, a game, a checker) before its episode ends.

`grpo.environment = "package.module:function"` names a factory (imported from your environment, never from a data
file) called with no arguments once per completion; the object it returns has

    reset(prompt: str, answer: str) -> str                      the text put before the model's first turn ("": none)
    step(text: str) -> (observation: str, reward: float, done: bool)

An episode (one of a prompt's G completions): the prompt, then turns of the model's sampled text (up to
grpo.max_completion_length tokens, ended by a stop token) each followed by `step(that text without its stop
token)`; while not done, the observation's tokens (the text tokenized as is, special tokens included: write it as
your chat template's next turn, e.g. `"\\n<|im_start|>user\\n=4<|im_end|>\\n<|im_start|>assistant\\n"`) are appended
and the model samples again. It ends when `step` says done, after grpo.max_turns turns, or when another turn would
not fit training.seq_len. Its reward is the sum of the rewards `step` returned, plus the reward functions
(`grpo.reward_funcs`, may be empty) of the model's last turn.

In the rollout row the environment's tokens are context only: no label, so no loss, no log-prob and no advantage
(`rollout.py`). Sampling: each turn every rank samples all its rows again as one batch (an episode that has
ended rides along on its prompt, its tokens dropped), until no episode of any rank is running, so that
generators sampling in the training layout run their collectives together; row i keeps drawing from its own
generator, so an episode's text does not depend on the layout. A factory, `reset` or `step` that raises, or a `step` that does not return
(str, finite number, bool): before training (each called once on the first prompt) one line naming the key and
function, exit 2; during training as a failing reward function (`grpo.on_reward_error`: the episode ends, scored 0
and counted, or the run stops on every rank).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from torchtrain.config.fields import ConfigError
from torchtrain.posttrain.decoding import Completions
from torchtrain.posttrain.rewards import RewardError
from torchtrain.posttrain.sampling_layout import all_ranks_done

KEY = "grpo.environment"


class Environments:
    """The job's environment factory (`path` names it)."""

    def __init__(self, factory: Callable[[], Any], path: str):
        self.factory, self.path = factory, path

    def _call(self, what: str, fn: Callable, *args: Any) -> Any:
        """fn(*args), a failure in it a RewardError naming the environment and `what` failed."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 -- the user's code: any failure is reported, never a traceback
            raise RewardError(self.path, f"environment {self.path!r}: {what} raised {type(e).__name__}: {e}") from None

    def new(self) -> Any:
        return self._call("its factory", self.factory)

    def reset(self, env: Any, prompt: str, answer: str) -> str:
        first = self._call("reset", lambda: env.reset(prompt, answer))
        if not isinstance(first, str):
            raise RewardError(self.path, f"environment {self.path!r}: reset returned {first!r}, not a str")
        return first

    def step(self, env: Any, text: str) -> tuple[str, float, bool]:
        out = self._call("step", lambda: env.step(text))
        ok = isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], str) and \
            isinstance(out[1], numbers.Real) and math.isfinite(float(out[1])) and isinstance(out[2], bool)
        if not ok:
            raise RewardError(self.path, f"environment {self.path!r}: step returned {out!r}, not (observation: str, "
                                         f"reward: a finite number, done: bool)")
        return out[0], float(out[1]), out[2]

    def check(self, prompt: str, answer: str, where: str) -> None:
        """The factory, `reset` and one `step` (the answer as the model's text) called once before training;
        ConfigError naming the key when one fails."""
        try:
            env = self.new()
            self.reset(env, prompt, answer)
            self.step(env, answer)
        except RewardError as e:
            raise ConfigError(f"[{KEY}] {e} (called on {where} before training)") from None


@dataclass
class Episodes:
    """One round's episodes, a row each: the tokens after the prompt (the model's and the environment's), which of
    them the model sampled, the sampler's log-prob of each (0 for the environment's), the last turn's tokens and
    whether it stopped, the environment's reward, and the failures (`RewardError`s, with the row)."""

    tokens: list[list[int]]
    sampled: list[list[bool]]
    logps: list[list[float]]
    last: list[list[int]]
    stopped: list[bool]
    rewards: list[float]
    errors: list[tuple[int, RewardError]] = field(default_factory=list)


def run_episodes(envs: Environments, generate: Callable[[list[list[int]]], Completions], prompts: list[list[int]],
                 questions: list[tuple[str, str]], encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 seq_len: int, max_new: int, max_turns: int, heartbeat: Callable[[], None] | None = None) -> Episodes:
    """The episodes of `prompts` (module doc): `generate(contexts)` samples one turn of every row, `questions` are
    each row's (prompt text, answer), `encode` tokenizes an observation, `decode` the model's text."""
    n = len(prompts)
    out = Episodes([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)],
                   [False] * n, [0.0] * n)
    envs_ = [None] * n
    running = [True] * n
    for i, (prompt, answer) in enumerate(questions):
        try:
            envs_[i] = envs.new()
            _extend(out, i, encode(envs.reset(envs_[i], prompt, answer)))
        except RewardError as e:
            out.errors.append((i, e))
            running[i] = False
    for turn in range(max_turns):
        if all_ranks_done(not any(running)):
            break
        # an ended episode rides along on its prompt alone (its tokens dropped): no context grows past a running one's
        sampled = generate([prompts[i] + out.tokens[i] if running[i] else prompts[i] for i in range(n)])
        for i in range(n):
            if not running[i]:
                continue
            tokens, stopped = sampled.tokens[i], sampled.stopped[i]
            out.tokens[i] += tokens
            out.sampled[i] += [True] * len(tokens)
            out.logps[i] += list(sampled.logps[i])
            out.last[i], out.stopped[i] = list(tokens), stopped
            if heartbeat is not None:
                heartbeat()
            try:
                observation, reward, done = envs.step(envs_[i], decode(tokens[:-1] if stopped else tokens))
            except RewardError as e:
                out.errors.append((i, e))
                running[i] = False
                continue
            out.rewards[i] += reward
            more = encode(observation) if not done else []
            if done or turn == max_turns - 1 or len(prompts[i]) + len(out.tokens[i]) + len(more) + max_new > seq_len:
                running[i] = False
                continue
            _extend(out, i, more)
    return out


def play(envs: Environments | None, generate: Callable[[list[list[int]]], Completions], prompts: list[list[int]],
         questions: list[tuple[str, str]], tokenizer, seq_len: int, max_new: int, max_turns: int,
         heartbeat: Callable[[], None] | None = None) -> Episodes:
    """Every row's completion as `Episodes`: one turn of `generate` without an environment, else an episode
    (`run_episodes`, observations tokenized as is by `tokenizer`)."""
    if envs is None:
        out = generate(prompts)
        return Episodes(out.tokens, [[True] * len(t) for t in out.tokens], out.logps, out.tokens, list(out.stopped),
                        [0.0] * len(prompts))
    return run_episodes(envs, generate, prompts, questions, lambda text: tokenizer.encode(text, bos=False, eos=False),
                        tokenizer.decode, seq_len, max_new, max_turns, heartbeat)


def _extend(out: Episodes, i: int, tokens: list[int]) -> None:
    """The environment's `tokens` after row i's: context only."""
    out.tokens[i] += tokens
    out.sampled[i] += [False] * len(tokens)
    out.logps[i] += [0.0] * len(tokens)
