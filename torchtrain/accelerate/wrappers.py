"""What `Accelerator.prepare` returns for an optimizer and a learning-rate scheduler.

Both follow Accelerate's meaning: under gradient accumulation (`Accelerator.accumulate`) the
optimizer's `step` and `zero_grad` and the scheduler's `step` act only on the micro-step that ends an
accumulation cycle (`sync_gradients`); otherwise they are the user's own objects' methods. The
optimizer's parameters are the model's parallelised ones (`rebind_parameters`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from torchtrain.config.fields import ConfigError


def parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def rebind_parameters(optimizer: torch.optim.Optimizer, before: dict[int, str], model: nn.Module) -> None:
    """Point the optimizer's parameter groups at the model's parameters after parallelisation (FSDP and
    TP replace them with DTensors), matching them by name."""
    if any(optimizer.state.values()):
        raise ConfigError("the optimizer already has state (it has stepped): prepare the model and the optimizer "
                          "before training")
    after = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        new = []
        for p in group["params"]:
            name = before.get(id(p))
            if name is None:
                raise ConfigError("the optimizer holds a parameter that is not the prepared model's; build the "
                                  "optimizer from model.parameters() and prepare both in one call")
            new.append(after[name])
        group["params"] = new


class AcceleratedOptimizer(torch.optim.Optimizer):
    """The user's optimizer; step/zero_grad skipped on accumulation micro-steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, sync: Callable[[], bool]):
        self.optimizer, self._sync = optimizer, sync  # (no Optimizer.__init__: everything is the wrapped one's)

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.optimizer.param_groups = groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    def step(self, closure=None):
        if self._sync():
            return self.optimizer.step(closure)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._sync():
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """The user's LR scheduler, stepped once per optimizer step (not on accumulation micro-steps); without
    split_batches it steps once per data-parallel rank, as Accelerate does (each step consumed that many
    batches)."""

    def __init__(self, scheduler, sync: Callable[[], bool], steps_per_step: int):
        self.scheduler, self._sync, self._n = scheduler, sync, steps_per_step

    def step(self, *args, **kwargs) -> None:
        if self._sync():
            for _ in range(self._n):
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name):
        return getattr(self.__dict__["scheduler"], name)
