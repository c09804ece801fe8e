"""Sampling from the model being trained, in the layout it trains in (GRPO's rollouts: trainer/rollout.py).

Each data-parallel rank samples its own prompts with the parallelised model itself, one token per forward:

* FSDP / HSDP: the first forward gathers every unit's weights and they stay gathered until sampling ends
  (reshard-after-forward off for the while), so the following token steps run without any all-gather; the
  units are resharded after. Peak memory is the whole unsharded model (plus the cache) on every rank for that
  time -- what any in-process generator needs; an external generator keeps its own copy instead;
* TP: the ranks of a tensor-parallel group hold the same prompts and draw the same random numbers, so they feed
  the same tokens; each forward runs the plan's collectives as in training, and vocabulary-sharded logits are
  gathered for the last position only (`components/rollout/sampling.py::full_logits`);
* DDP / one process: as is.

Every forward runs eagerly (compiled regions recompile for every new length otherwise), without gradients and
without counting toward the step's statistics (MoE loads, extra losses). The ranks end sampling together
(`all_done`): a rank whose rows have all stopped keeps feeding them until every rank's have, so ranks whose
forwards hold collectives (expert parallelism) run the same number of them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtrain.models.base import forward_counting


def _reshards_after_forward(module: FSDPModule) -> bool:
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", [])
    return any(getattr(g, "_reshard_after_forward", True) for g in groups)


@contextlib.contextmanager
def sampling_mode(model_parts: list[nn.Module]) -> Iterator[None]:
    """Forwards that sample (module docstring): FSDP units kept gathered, eager, no gradients, not counted."""
    units = [m for part in model_parts for m in part.modules() if isinstance(m, FSDPModule)]
    saved = [_reshards_after_forward(m) for m in units]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
    eager = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else \
        contextlib.nullcontext()
    try:
        with torch.no_grad(), forward_counting(False), eager:
            yield
    finally:
        for m, value in zip(units, saved):
            m.set_reshard_after_forward(value, recurse=False)
            m.reshard()


def all_ranks_done(done: bool) -> bool:
    """Whether every rank's rows have stopped (one all-reduce over the world; this rank's answer alone without a
    process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return done
    flag = torch.tensor([1 if done else 0], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
