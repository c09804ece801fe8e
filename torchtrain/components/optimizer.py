"""Optimizers (one per model part, so pipeline stages each own theirs) behind one step()/zero_grad().

The container is Stateful for checkpoints: its state dict is the flattened optimizer state of every
part keyed by parameter name (`state.<param>.exp_avg`, `param_groups.<param>.lr`), so it reshards
across layouts like the weights do.

Weight decay is applied to matrices and embeddings (parameters with >= 2 dims) only; norms' gains are
not decayed (the common practice of Megatron-LM, nanoGPT and OLMo).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from torchtrain.config.training import Optimizer as OptimizerConfig


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                  foreach=impl == "foreach", fused=impl == "fused")
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    return cls(_param_groups(model, cfg.weight_decay), **kwargs)


class OptimizersContainer:
    """One optimizer per model part, stepped together."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig, device: torch.device):
        self.model_parts = model_parts
        self.optimizers = [build_optimizer(part, cfg, device) for part in model_parts]

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
