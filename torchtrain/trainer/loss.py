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

from torchtrain.utils.token_loss import IGNORE_INDEX, cross_entropy_sum, local_value

__all__ = ["IGNORE_INDEX", "ScaledTokenLoss", "cross_entropy_sum", "local_value", "z_loss_sum"]

def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over the valid target tokens of logsumexp(logits)^2, in float32. Vocabulary-sharded DTensor
    logits (loss parallel) are never gathered: the max and the sum of exponentials reduce across the
    shards (a max and a sum all-reduce of one value per token), and the result is a replicated DTensor."""
    from torch.distributed.tensor import DTensor, Replicate

    x = logits.float()
    peak = x.detach().amax(dim=-1, keepdim=True)
    lse = peak.squeeze(-1) + (x - peak).exp().sum(dim=-1).log()
    valid = (labels != IGNORE_INDEX).to(torch.float32)
    if isinstance(lse, DTensor):
        mesh = lse.device_mesh
        valid = DTensor.from_local(valid.to(lse.device), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return (lse.square() * valid).sum()


class ScaledTokenLoss:
    """loss_fn(logits, labels) = (cross_entropy_sum + z_weight * z_loss_sum) * scale; the trainer sets
    `scale` every step.

    `ce_sum` may be a compiled version of `cross_entropy_sum`. Under loss parallel (vocabulary-sharded
    DTensor logits) the result is a replicated DTensor; `local_value` turns it into a plain tensor.
    With a z-loss, the scaled z-loss term of every returned loss is kept (detached) until `pop_z`, so
    that the trainer can log it apart from the cross-entropy.
    """

    def __init__(self, ce_sum=cross_entropy_sum, z_weight: float = 0.0) -> None:
        self.ce_sum = ce_sum
        self.z_weight = z_weight
        self.scale: torch.Tensor | float = 1.0
        self._z: list[torch.Tensor] = []  # the scaled z-loss term of every call since `pop_z`, in order

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.z_weight:
            return self.ce_sum(logits, labels) * self.scale
        z = self.z_weight * z_loss_sum(logits, labels)
        self._z.append((local_value(z.detach()) * self.scale).float())
        return (self.ce_sum(logits, labels) + z) * self.scale

    def pop_z(self, device: torch.device, last: int | None = None) -> torch.Tensor:
        """The sum of the scaled z-loss terms since the last `pop_z`: of the `last` calls only when given.
        (A pipeline schedule may call the loss function once more than its micro-batches, before them:
        torch >= 2.13 infers gradient shapes on the first step that way.)"""
        terms, self._z = self._z, []
        if last is not None:
            terms = terms[len(terms) - last:] if last else []
        return torch.stack(terms).sum() if terms else torch.zeros((), device=device)
