"""What a compiling job's Inductor graphs change in the planner's traced step, which runs eagerly.

The trace (`trace.py`) cannot run compiled graphs: its memory tracker and operator counter are dispatch
modes, which a compiled graph bypasses, and fake tensors would only trace, not run, them. So it runs
the job eagerly, and this module supplies what differs:

* **which modules are compiled** (`compiled_modules`, as `distributed/parallelize.py` compiles them:
  every block, and without tensor parallelism the modules the model names in `compile_also`): the
  operator counter charges their insides as graph launches, not as dispatched operators
  (`host_time.py`);
* **the compiled optimizer step** (`components/optim/compiled_adamw.py`): one graph launch per parameter,
  whose element-wise work keeps no temporaries (`compiled_adamw_update`);
* **the compiled cross-entropy's memory** (`FusedCrossEntropySum`; `loss_saved_bytes` and
  `loss_backward_bytes` for the analytic rows): eagerly, the loss upcasts the
  logits to float32, saves the float32 log-softmax (4 V bytes a token) and starts its backward with two
  more float32 buffers of that size; Inductor's graph of the same function keeps only its input (the
  logits, d V bytes a token in the compute dtype) and the per-token log-sum-exp, and its backward
  writes the logits' gradient directly in their dtype (d V bytes), with no float32 temporaries. The
  stand-in computes the same loss and gradient with that memory profile: a custom autograd function
  whose float32 work runs on 1/64 of the tokens at a time.

Blocks are traced eagerly: Inductor's own choice of what to save inside them (its partitioner, under
the job's checkpointing policy) is not modelled, which keeps the traced blocks' activations an upper
bound of the compiled ones.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from torchtrain.planner.inputs import PlanInputs
from torchtrain.utils.token_loss import IGNORE_INDEX

CHUNKS = 64
"""The stand-in's float32 work runs on this many slices of the tokens (its transient: 1/64 of 4 V t)."""


def compiled_modules(p: PlanInputs, parts: list[nn.Module]) -> list[nn.Module]:
    """The modules a compiling job compiles: every block and what `distributed/parallelize.py` compiles
    beside them."""
    from torchtrain.distributed.parallelize import compiled_beside_blocks
    from torchtrain.models.registry import get_model_spec

    if p.layout is not None and not p.layout.compile_model:
        return []
    spec = get_model_spec(p.model_name)
    out: list[nn.Module] = []
    for part in parts:
        out += list(spec.blocks_of(part).children()) + compiled_beside_blocks(part, spec, p.tp > 1)
    return out


def compiles_loss(p: PlanInputs) -> bool:
    """Whether the job compiles its cross-entropy (not under loss parallelism: vocabulary-sharded DTensor
    logits, which the stand-in does not take; nor a preference loss, which runs eagerly); a what-if copy without a
    Layout: compiling, without TP."""
    if p.dpo is not None:
        return False
    layout = p.layout
    if layout is not None:
        return layout.compile_loss and not layout.loss_parallel
    return p.compile and p.tp == 1


def loss_saved_bytes(p: PlanInputs) -> int:
    """Bytes per token and vocabulary entry the cross-entropy keeps for backward: the fp32 log-softmax
    (4); compiled, its input logits in the compute dtype (d)."""
    return p.param_bytes if compiles_loss(p) else 4


def loss_backward_bytes(p: PlanInputs) -> int:
    """The same for the buffers its backward starts with: two fp32 (8); compiled, the logits' gradient
    written in their dtype (d)."""
    return p.param_bytes if compiles_loss(p) else 8


class FusedCrossEntropySum(torch.autograd.Function):
    """Sum of per-token cross-entropy, as `utils/token_loss.py::cross_entropy_sum`, with the memory of
    its compiled graph (see the module doc)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x, y = logits.flatten(0, -2), labels.flatten()
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for rows in _slices(x):
            lse[rows] = torch.logsumexp(x[rows].float(), dim=-1)
        valid = y != IGNORE_INDEX
        picked = x.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, lse, labels)
        return ((lse - picked) * valid).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, labels = ctx.saved_tensors
        x, y = logits.flatten(0, -2), labels.flatten()
        out = torch.empty_like(logits)
        g = out.flatten(0, -2)
        for rows in _slices(x):
            part = torch.exp(x[rows].float() - lse[rows].unsqueeze(1))  # softmax
            target = y[rows]
            valid = (target != IGNORE_INDEX).unsqueeze(1)
            part.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -valid.float())
            g[rows] = (part * valid * grad).to(g.dtype)
        return out, None


def fused_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return FusedCrossEntropySum.apply(logits, labels)


def _slices(x: torch.Tensor) -> list[slice]:
    """The row slices the float32 work runs on; for fake tensors (the planner's trace) only the first: each
    slice's transient is freed before the next, so one holds the same peak, and no values are computed."""
    n = x.shape[0]
    size = max(1, -(-n // CHUNKS))
    slices = [slice(i, min(n, i + size)) for i in range(0, n, size)]
    return slices[:1] if is_fake(x) else slices


def compiled_adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, copy: torch.Tensor | None,
                          *_scalars) -> None:
    """Stand-in for the compiled optimizer update (`compiled_adamw.adamw_update`): the same tensors
    written in place, no temporaries (Inductor's one pass keeps every intermediate in registers)."""
    m.add_(g)
    v.add_(g)
    p.add_(m)
    if copy is not None:
        copy.copy_(p)
