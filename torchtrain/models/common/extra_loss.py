"""Loss terms a model adds inside its forward (an MoE layer's auxiliary loss, multi-token prediction).

`add_loss_gradient(out, loss, scale)` returns `out` unchanged and, in backward, also sends `scale` as
the gradient of the scalar `loss`. The term so joins the training objective without changing the
model's outputs -- it reaches pipeline stages that do not compute the cross-entropy, and the trainer's
loss stays the cross-entropy alone. The trainer sets `scale` to the scale of the step's loss (dp / N
over the step's N target tokens, x the float16 loss scale), so the term has the same normalisation.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.models.base import forward_is_counted


def first_pass() -> bool:
    """False while activation checkpointing recomputes a forward (inside backward)."""
    if torch.compiler.is_compiling():  # compiled recomputation never reruns Python
        return True
    return torch._C._current_graph_task_id() == -1


def counts_statistics(module: nn.Module, value: torch.Tensor) -> bool:
    """Whether a forward adds to `module`'s step statistics: a training forward, counted
    (`models.base.forward_counting`), not a recomputation, on real tensors (not the planner's meta)."""
    return module.training and forward_is_counted() and first_pass() and not value.is_meta


class _AddLossGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scale,) = ctx.saved_tensors
        return grad, scale.to(torch.float32).reshape(()), None


def add_loss_gradient(out: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`out`, with `loss` (a scalar on the autograd graph) added to the objective times `scale`."""
    return _AddLossGradient.apply(out, loss, scale)


class LoggedLoss(nn.Module):
    """Base of a module that adds a loss term and reports it: the trainer sets `loss_scale` before each
    step (`trainer/extra_losses.py`), and after it logs `loss_name` = the summed term over the
    summed target count of all ranks (a mean per target), then resets both."""

    loss_name = "extra_loss"

    def __init__(self):
        super().__init__()
        self.register_buffer("loss_scale", torch.ones(()), persistent=False)
        self.register_buffer("loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("target_count", torch.zeros(()), persistent=False)

    def count(self, loss_sum: torch.Tensor, targets: int) -> None:
        """Add one training forward's term to the statistics (not a recomputation, not uncounted)."""
        if counts_statistics(self, loss_sum):
            with torch.no_grad():
                self.loss_sum.add_(loss_sum.detach().float())
                self.target_count.add_(targets)

    def reset_statistics(self) -> None:
        self.loss_sum.zero_()
        self.target_count.zero_()

    def init_buffers(self) -> None:
        self.reset_statistics()
        self.loss_scale.fill_(1.0)
