"""Learning-rate schedule: linear warmup, optional stable phase (WSD), decay to a floor.

For step s = 1..T (the step about to be taken), with W = warmup_steps, D = decay steps
(T - W, or round(decay_ratio x T) for warmup-stable-decay) and S = T - W - D stable steps:

    factor(s) = s / W                                  s <= W        (warmup)
              = 1                                      W < s <= W+S  (stable)
              = m + (1 - m) * g(p),  p = (s-W-S) / D   otherwise     (decay, p in (0, 1])

with g(p) = 1 - p (linear), 1 - sqrt(p) (sqrt) or (1 + cos(pi p)) / 2 (cosine), and m = min_lr_factor,
reached at the last step. The lr of step s is optimizer.lr x factor(s).
"""

from __future__ import annotations

import functools
import math

from torch.optim.lr_scheduler import LambdaLR

from torchtrain.components.optim.optimizer import OptimizersContainer
from torchtrain.config.training import LRScheduler as LRConfig


def lr_factor(step: int, total: int, cfg: LRConfig) -> float:
    """factor(step) for 1-based `step` of `total` (see the module docstring)."""
    warmup = cfg.warmup_steps
    if step <= warmup:
        return step / warmup
    decay = total - warmup if cfg.decay_ratio is None else min(round(cfg.decay_ratio * total), total - warmup)
    stable = total - warmup - decay
    if step <= warmup + stable or decay <= 0:
        return 1.0
    p = min(1.0, (step - warmup - stable) / decay)
    if cfg.decay_type == "linear":
        g = 1.0 - p
    elif cfg.decay_type == "sqrt":
        g = 1.0 - math.sqrt(p)
    else:
        g = 0.5 * (1.0 + math.cos(math.pi * p))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * g


def _lambda(index: int, total: int, cfg: LRConfig) -> float:
    # LambdaLR calls with 0 at construction (the lr of step 1), then 1, 2, ... after each step.
    return lr_factor(index + 1, total, cfg)


class LRSchedulersContainer:
    """One LambdaLR per optimizer, stepped together after every optimizer step."""

    def __init__(self, optimizers: OptimizersContainer, cfg: LRConfig, total_steps: int):
        fn = functools.partial(_lambda, total=total_steps, cfg=cfg)
        self.schedulers = [LambdaLR(opt, fn) for opt in optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict:
        """Only the step counter: the lr is a function of it and the config, and a layout-independent
        state resumes under any parallel layout (whose optimizers may hold other parameter groups)."""
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state: dict) -> None:
        epoch = int(state["last_epoch"])
        for s in self.schedulers:
            s.last_epoch, s._step_count = epoch, epoch + 1
            lrs = [base * fn(epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
            for group, lr in zip(s.optimizer.param_groups, lrs):
                group["lr"] = lr
            s._last_lr = lrs
