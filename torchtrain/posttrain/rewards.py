"""Reward functions: a completion's text against the prompt's reference answer -> a number.

    reward(completion) = sum_i w_i f_i(completion, answer, prompt)  (+ `overlong_penalty` of its length)

Built-in functions (`grpo.reward_funcs` by name):

* `exact`: 1 when the completion, stripped of whitespace (and of the end-of-turn text the tokenizer decodes
  its stop token to), equals the answer stripped, else 0;
* `numeric`: 1 when the completion's last number equals the answer's number within 1e-6 relative, else 0
  (a completion without a number scores 0);
* `format`: 1 when the whole completion matches `grpo.format_pattern` (a regular expression), else 0.

Your own: "package.module:function", imported from the Python environment (never from a file that came with
the data), called as function(completion: str, answer: str, prompt: str) and expected to return a finite
number. `check` calls every function once on the first prompt (its answer as the completion) before training:
an import error, a raise or a non-number there stops the launch. During training a raise or a non-number scores
0 and is counted (or stops the run, `grpo.on_reward_error`).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from typing import Callable

import torch

from torchtrain.config.fields import ConfigError

RewardFn = Callable[[str, str, str], float]
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def exact(completion: str, answer: str, prompt: str) -> float:
    return float(completion.strip() == answer.strip())


def numeric(completion: str, answer: str, prompt: str) -> float:
    found, wanted = _NUMBER.findall(completion.replace(",", "")), _NUMBER.findall(answer.replace(",", ""))
    if not found or not wanted:
        return 0.0
    a, b = float(found[-1]), float(wanted[-1])
    return float(abs(a - b) <= 1e-6 * max(abs(a), abs(b)))


def _format(pattern: str) -> RewardFn:
    compiled = re.compile(pattern, re.DOTALL)

    def format_reward(completion: str, answer: str, prompt: str) -> float:
        return float(compiled.fullmatch(completion.strip()) is not None)
    return format_reward


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each completion's reward (`grpo.overlong_buffer_len`): 0 up to
    max_length - buffer tokens, then falling linearly to -factor at max_length, -factor beyond.

        penalty(n) = factor * clamp((max_length - buffer - n) / buffer, -1, 0)
    """
    if buffer == 0:
        return torch.zeros_like(lengths)
    return factor * ((max_length - buffer - lengths) / buffer).clamp(-1.0, 0.0)


class RewardError(Exception):
    """A reward function (`function`, its name) raised or returned something that is not a finite number."""

    def __init__(self, function: str, message: str):
        super().__init__(message)
        self.function = function


def import_function(path: str, key: str) -> Callable:
    """The function "package.module:function" names, imported from the user's environment (a reward function, a
    generator factory); one line naming the config `key` when it cannot be imported or is not callable."""
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"[{key}] cannot import {path!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"[{key}] {path!r} is not a function")
    return fn


class Rewards:
    """The job's reward functions and weights; `score` sums them for one completion."""

    def __init__(self, names: list[str], weights: list[float], format_pattern: str = ""):
        builtin = {"exact": exact, "numeric": numeric}
        self.names = list(names)
        self.fns = [builtin[n] if n in builtin else _format(format_pattern) if n == "format" else import_function(n, "grpo.reward_funcs")
                    for n in names]
        self.weights = list(weights) or [1.0] * len(names)

    def each(self, completion: str, answer: str, prompt: str) -> list[float]:
        """Every function's value (RewardError naming the function when it raises or returns a non-number)."""
        out = []
        for name, fn in zip(self.names, self.fns):
            try:
                value = fn(completion, answer, prompt)
            except Exception as e:  # noqa: BLE001 -- any failure of user code is reported, never a traceback
                raise RewardError(name, f"reward function {name!r} raised {type(e).__name__}: {e}") from None
            if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardError(name, f"reward function {name!r} returned {value!r}, not a finite number")
            out.append(float(value))
        return out

    def score(self, completion: str, answer: str, prompt: str) -> float:
        return sum(w * v for w, v in zip(self.weights, self.each(completion, answer, prompt)))

    def check(self, answer: str, prompt: str, where: str) -> None:
        """Each function called once on a prompt's own answer (module docstring); ConfigError when one fails."""
        try:
            self.each(answer, answer, prompt)
        except RewardError as e:
            raise ConfigError(f"[grpo.reward_funcs] {e} (called on the answer of {where} before training)") from None
