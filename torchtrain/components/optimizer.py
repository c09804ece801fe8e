"""Optimizers (one per model part, so pipeline stages each own theirs) behind one step()/zero_grad().

The container is Stateful for checkpoints: its state dict is the flattened optimizer state of every
part keyed by parameter name (`state.<param>.exp_avg`, `param_groups.<param>.lr`), so it reshards
across layouts like the weights do.

Weight decay is applied to matrices and embeddings (parameters with >= 2 dims) only; norms' gains are
not decayed (the common practice of Megatron-LM, nanoGPT and OLMo).

ZeRO-1 (the layout's `zero1`): parameters and gradients stay replicated, but each of the dp ranks
keeps Adam state for, and updates, only its 1/dp share of the parameters, then broadcasts the
updated share (ZeroRedundancyOptimizer): optimizer memory 8 P -> 8 P / dp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from torchtrain.config.training import Optimizer as OptimizerConfig

if TYPE_CHECKING:
    from torchtrain.distributed.layout import Layout


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay / no-decay groups, further split by tensor kind (plain, or DTensor per device mesh):
    the foreach / fused kernels cannot mix plain tensors and DTensors, nor DTensor meshes."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            kind = p.device_mesh if isinstance(p, DTensor) else None
            groups.setdefault((p.dim() < 2, kind), []).append(p)
    return [{"params": params, "weight_decay": 0.0 if no_decay else weight_decay}
            for (no_decay, _), params in sorted(groups.items(), key=lambda kv: kv[0][0])]  # decay first


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, impl: str,
                    zero1_group: "dist.ProcessGroup | None" = None) -> torch.optim.Optimizer:
    """`impl`: the resolved kernel ("fused", "foreach" or "for-loop"; see `layout.resolve_optimizer_impl`)."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                  foreach=impl == "foreach", fused=impl == "fused")
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    groups = _param_groups(model, cfg.weight_decay)
    if zero1_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=zero1_group, **kwargs)
    return cls(groups, **kwargs)


class OptimizersContainer:
    """One optimizer per model part, stepped together. `zero1_group`: shard the state over it."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig, impl: str,
                 zero1_group: "dist.ProcessGroup | None" = None):
        self.model_parts = model_parts
        self.optimizers = [build_optimizer(part, cfg, impl, zero1_group) for part in model_parts]

    @classmethod
    def for_layout(cls, model_parts: list[nn.Module], cfg: OptimizerConfig, layout: "Layout") -> "OptimizersContainer":
        """The optimizers the layout asks for: its kernel, and ZeRO-1 sharding over the dp ranks."""
        group = layout.dims.dp_mesh.get_group() if layout.zero1 else None
        return cls(model_parts, cfg, layout.optimizer_impl, zero1_group=group)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        merged: dict = {}
        for part, opt in zip(self.model_parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, opt, options=options))
        return merged

    def load_state_dict(self, state: dict) -> None:
        # Each (part, optimizer) pair picks its own parameters' entries from the merged flat dict.
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state, options=options)

    @property
    def lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]
