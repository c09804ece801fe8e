"""Muon: orthogonalised momentum for the hidden weight matrices, AdamW for everything else.

For every hidden weight matrix W (rows A, columns B; a 3-D expert weight is one matrix per expert)
with gradient G, per step (momentum mu, learning rate lr, weight decay wd):

    M  = mu * M + G                          (the momentum buffer, the only state: 4 bytes / weight)
    U  = G + mu * M   (Nesterov; else U = M)
    O  = NewtonSchulz(U)                     (~ the orthogonal factor U V^T of U's SVD)
    W  = W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O

NewtonSchulz: X = U / ||U||_F, then `ns_steps` quintic iterations X <- a X + (b S + c S^2) X with
S = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315) (K. Jordan's coefficients; on the wide
orientation, float32). The factor 0.2 sqrt(max(A, B)) is Moonshot AI's RMS matching (Liu et al.,
"Muon is Scalable for LLM Training", 2025): an orthogonal A x B matrix has RMS 1/sqrt(max(A, B)), so
the update's RMS becomes 0.2, AdamW's typical update RMS, and AdamW's `lr` and `weight_decay` serve
both parts unchanged. Every other parameter -- embeddings, the output head, norms, biases -- takes the
AdamW update (decoupled weight decay, bias-corrected moments) in the same optimizer, with the groups'
own weight decay (`components/optim/optimizer.py`: none for norms and biases).

**Sharded parameters.** Momentum and the weight update are element-wise: on FSDP / TP shards they run
locally. Newton-Schulz needs whole matrices, so for a DTensor weight the Nesterov update is
all-gathered over the mesh dimensions that split its matrices (one fp32 all-gather of the matrix per
step -- the volume of one FSDP parameter all-gather in fp32), orthogonalised on every rank alike, and
each rank keeps its own shard (a local slice, no communication). Expert weights split over the
expert-parallel ranks by expert stay split that way: only their expert-FSDP sharding inside each
matrix is gathered, and with whole matrices locally nothing is. Replicated (DDP) and ZeRO-1
parameters are plain tensors (ZeRO-1 gives each rank a share of whole parameters to update, so the
Newton-Schulz work is split over the data-parallel ranks for free).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torchtrain.components.optim.closure import closure_loss

_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2


def newton_schulz(u: torch.Tensor, steps: int) -> torch.Tensor:
    """The approximately orthogonalised `u` (float32; batched over leading dimensions)."""
    a, b, c = _NS_COEFFICIENTS
    x = u.float()
    wide = x.size(-2) <= x.size(-1)
    if not wide:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * (s @ s)) @ x
    return x if wide else x.mT


def orthogonalize(u: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton-Schulz of `u`; a DTensor comes back with `u`'s placements (see the module docstring):
    gathered over the mesh dimensions that split its matrices (none for experts split by expert only),
    orthogonalised, and sliced back to this rank's shard."""
    if not isinstance(u, DTensor):
        return newton_schulz(u, steps)
    mesh, placements = u.device_mesh, tuple(u.placements)
    whole = tuple(Replicate() if isinstance(p, Shard) and p.dim >= u.dim() - 2 and mesh.size(i) > 1 else p
                  for i, p in enumerate(placements))
    if whole == placements:  # every local matrix is whole: no communication
        return DTensor.from_local(newton_schulz(u.to_local(), steps), mesh, placements, run_check=False,
                                  shape=u.shape, stride=u.stride())
    if all(isinstance(p, Replicate) for p in whole):
        return distribute_tensor(newton_schulz(u.full_tensor(), steps), mesh, placements, src_data_rank=None)
    gathered = u.redistribute(mesh, whole)
    ortho = DTensor.from_local(newton_schulz(gathered.to_local(), steps), mesh, whole, run_check=False,
                               shape=u.shape, stride=gathered.stride())
    return ortho.redistribute(mesh, placements)


def rms_scale(shape: torch.Size) -> float:
    """0.2 sqrt(max(A, B)) of the matrices (the last two dimensions)."""
    return RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `use_muon=True`, AdamW for the others (see the module docstring)."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, use_muon=False)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon(p, group)
                else:
                    self._adamw(p, group)
        return loss

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state, mu = self.state[p], group["momentum"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.mul_(mu).add_(p.grad)
        update = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
        ortho = orthogonalize(update, group["ns_steps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(ortho.to(p.dtype), alpha=-group["lr"] * rms_scale(p.shape))

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state, (beta1, beta2) = self.state[p], group["betas"]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)  # a CPU scalar as in torch.optim.AdamW (its value is read back)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = state["step"].item()
        grad, exp_avg, exp_avg_sq = p.grad, state["exp_avg"], state["exp_avg_sq"]
        p.mul_(1 - group["lr"] * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
        p.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1 ** step))
