"""Optimizers (one per model part, so pipeline stages each own theirs) behind one step()/zero_grad().

Weight decay is applied to matrices and embeddings (parameters with >= 2 dims) only; norms' gains are
not decayed (the common practice of Megatron-LM, nanoGPT and OLMo).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

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

    @property
    def lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]
