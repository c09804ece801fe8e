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
    """loss_fn(logits, labels) = cross_entropy_sum * scale; the trainer sets `scale` every step.

    `ce_sum` may be a compiled version of `cross_entropy_sum`. Under loss parallel (vocabulary-sharded
    DTensor logits) the result is a replicated DTensor; `local_value` turns it into a plain tensor.
    """

    def __init__(self, ce_sum=cross_entropy_sum) -> None:
        self.ce_sum = ce_sum
        self.scale: torch.Tensor | float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.ce_sum(logits, labels) * self.scale


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A (replicated) DTensor loss as a plain tensor; plain tensors unchanged."""
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss
