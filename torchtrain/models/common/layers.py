"""Layers common to decoder-only transformers: RMSNorm, the SwiGLU feed-forward, and one linear map over
several weights concatenated (`concat_linear`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a parameter that expert or tensor parallelism split into a DTensor (stacked
    experts, per-head vectors: `models/common/tp.py::LocalShards`); `t` otherwise."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back: torch's fused
    `rms_norm` (one kernel forward and one backward on CUDA). `zero_centered`: the scale is 1 + weight
    (the weight starts at zero: Qwen3.5, Qwen3-Next)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1.0 if self.zero_centered else self.weight
        return F.rms_norm(x, self.weight.shape, weight, self.eps)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _ConcatLinear(torch.autograd.Function):
    """y = x @ cat(weights)^T as one GEMM; backward rebuilds the concatenation instead of keeping it, so
    it holds what separate layers would (x and the weights themselves): grad_x = grad @ cat(weights), and
    each weight's gradient is its rows of grad^T @ x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grad_x = grad.matmul(torch.cat(weights)) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[1:]):
            return grad_x, *[None] * len(weights)
        grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return grad_x, *grad_w.split([w.shape[0] for w in weights])


def concat_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x (..., in) -> (..., sum of the weights' rows): the linear layers (no bias) of `weights`, which share
    their input, as one GEMM -- the same values up to that GEMM's rounding, each weight's gradient its own
    slice of one weight-gradient GEMM, and one input-gradient GEMM instead of several summed."""
    return _ConcatLinear.apply(x, *weights)
