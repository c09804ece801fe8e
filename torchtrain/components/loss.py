"""Token-mean cross-entropy that is exact under any data-parallel layout and accumulation.

A step's loss is the mean over every valid target token of the global batch:

    L = (1 / N) * sum over all dp ranks r, micro-batches m, tokens t of CE(r, m, t)

where N, the global count of valid tokens, is all-reduced before the step. Each micro-batch's
backward uses  sum_t CE(r, m, t) * scale  with  scale = dp / N.  Data-parallel gradient reduction
(FSDP, HSDP, DDP) averages over the dp ranks, dividing by dp again, so the final gradient is exactly
dL/dθ, whatever the number of ranks or micro-batches (up to floating-point summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy in float32 (positions labelled IGNORE_INDEX excluded)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


class ScaledTokenLoss:
    """loss_fn(logits, labels) = cross_entropy_sum * scale; the trainer sets `scale` every step."""

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(logits, labels) * self.scale
