"""The run's operations plugged into every train step: phase timing, fault injection, the guard, the silent
data corruption check's re-execution.

`TrainStep` (trainer/step.py) knows nothing about them; it calls these `StepHooks` at its phase
boundaries, after backward, and before the optimizer step ([profiling] phase timing, [guard],
`debug.inject_nonfinite_*`, [fault] sdc_check_freq).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.components.fault.replica_check import Reexecution, ReplicaCheck
from torchtrain.components.observability.phases import PhaseTimer
from torchtrain.trainer.guard import TrainingGuard
from torchtrain.trainer.state import TrainState
from torchtrain.trainer.step import StepHooks
from torchtrain.utils import extensions
from torchtrain.utils.logging import logger


class OperationsHooks(StepHooks):
    def __init__(self, phases: PhaseTimer, guard: TrainingGuard, state: TrainState,
                 inject_nonfinite_grad_step: int | None, sdc: ReplicaCheck):
        self.phases, self.guard, self.state, self.sdc = phases, guard, state, sdc
        self.inject_grad_step = inject_nonfinite_grad_step

    def phase(self, name: str | None) -> None:
        if name is None:
            self.phases.pause()
        else:
            self.phases.enter(name)

    def loss_multiplier(self) -> float | None:
        """debug.inject_nonfinite_loss_steps: NaN on the listed steps (each once)."""
        return float("nan") if self.guard.inject_nan(self.state.step) else None

    def reads_gradients(self) -> bool:
        """A "gradients" extension is registered, or a gradient is poisoned this step."""
        return extensions.registered("gradients") or self.state.step == self.inject_grad_step

    def after_backward(self, model_parts: list[nn.Module]) -> None:
        """The "gradients" extension point (utils/extensions.py); then debug.inject_nonfinite_grad_step:
        poison one gradient with +inf (fault injection)."""
        extensions.call("gradients", step=self.state.step, model_parts=model_parts)
        if self.state.step != self.inject_grad_step:
            return
        from torch.distributed.tensor import DTensor

        grad = next(p.grad for part in model_parts for p in part.parameters() if p.grad is not None)
        (grad.to_local() if isinstance(grad, DTensor) else grad).fill_(float("inf"))
        logger.warning("step %d: injected +inf into a gradient (debug.inject_nonfinite_grad_step)", self.state.step)

    def verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> str | None:
        return self.guard.check(self.state.step, loss, grad_norm)

    def output_check(self) -> Reexecution | None:
        return self.sdc.output_check(self.state.step)
