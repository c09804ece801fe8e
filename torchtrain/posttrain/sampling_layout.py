"""Sampling from the model being trained, in the layout it trains in (GRPO's rollouts: posttrain/rollout.py).

Each data-parallel rank samples its own prompts with the parallelised model itself, one token per forward:

* FSDP / HSDP: the first forward gathers every unit's weights and they stay gathered until sampling ends
  (reshard-after-forward off for the while), so the following token steps run without any all-gather; the
  units are resharded after. Peak memory is the whole unsharded model (plus the cache) on every rank for that
  time -- what any in-process generator needs; an external generator keeps its own copy instead;
* TP: the ranks of a tensor-parallel group hold the same prompts and draw the same random numbers, so they feed
  the same tokens; each forward runs the plan's collectives as in training, and vocabulary-sharded logits are
  gathered for the last position only (`posttrain/decoding.py::full_logits`);
* DDP / one process: as is;
* any layout, pipeline and context parallelism included, with `grpo.generator = "copy"`: `SamplerCopy`, an
  unsharded copy of the weights on every rank, synced from the model before each iteration's sampling.

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


def build_whole(spec, args, device: torch.device, lora=None) -> nn.Module:
    """The model built whole (no parallelism) on `device`, its buffers computed, its parameters uninitialised -- with
    the `lora` adapters (a `[lora]` section) when given, so that it takes a LoRA run's weights name for name."""
    with torch.device("meta"):
        model = spec.build(args)
    if lora is not None:
        from torchtrain.models.converters.lora import apply_lora

        apply_lora(model, lora)
    model.to_empty(device=device)
    model.init_buffers()
    return model


class SamplerCopy:
    """An unsharded copy of the model on every rank to sample with, in any layout -- pipeline and context parallelism
    included, where the training modules cannot run one token at a time: before each iteration's sampling `sync`
    copies the weights of the model being trained into it (each parameter gathered whole from its FSDP / TP shards,
    and under PP broadcast from the stage that holds it to the other stages' ranks). One more whole copy of the
    weights per rank; no collective while sampling. An external generator (a vLLM engine, say) works the same way:
    its own copy, the weights pushed to it before each batch of rollouts."""

    def __init__(self, model: nn.Module, model_parts: list[nn.Module], pp_group=None):
        self.model, self.parts, self.pp_group = model, model_parts, pp_group
        model.requires_grad_(False)
        self._owners: dict[str, int] | None = None

    @torch.no_grad()
    def sync(self) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.tensor import DTensor

        local: dict[str, torch.Tensor] = {}
        for part in self.parts:
            for name, value in get_model_state_dict(part).items():
                local[name] = value.full_tensor() if isinstance(value, DTensor) else value
        target = self.model.state_dict()
        if self.pp_group is None:
            for name, value in target.items():
                value.copy_(local[name])
            return
        if self._owners is None:  # which pipeline rank holds each tensor (asked once)
            held: list = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(held, sorted(local), group=self.pp_group)
            ranks = dist.get_process_group_ranks(self.pp_group)
            self._owners = {name: ranks[i] for i in reversed(range(len(held))) for name in held[i]}
        for name, value in target.items():  # in a fixed order on every rank
            if name in local:
                value.copy_(local[name])
            dist.broadcast(value, src=self._owners[name], group=self.pp_group)
