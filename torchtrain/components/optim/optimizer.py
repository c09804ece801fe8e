"""Optimizers (one per model part, so pipeline stages each own theirs) behind one step()/zero_grad():
AdamW, Adam, or Muon (`components/optim/muon.py`: hidden weight matrices orthogonalised, the rest AdamW).

The container is Stateful for checkpoints: its state dict is the flattened optimizer state of every
part keyed by parameter name (`state.<param>.exp_avg`, `param_groups.<param>.lr`), so it reshards
across layouts like the weights do.

Weight decay is applied to matrices and embeddings (parameters with >= 2 dims) only; norms' gains are
not decayed (the common practice of Megatron-LM, nanoGPT and OLMo). Muon takes the parameters with
>= 2 dims except embeddings (`nn.Embedding` weights) and the output head (the model's top-level
`output` or `lm_head` module), as in Moonshot AI's and K. Jordan's recipes.

ZeRO-1 (the layout's `zero1`): parameters and gradients stay replicated, but each of the dp ranks
keeps Adam state for, and updates, only its 1/dp share of the parameters, then broadcasts the
updated share (ZeroRedundancyOptimizer): optimizer memory 8 P -> 8 P / dp.

Where the Layout compiles the optimizer step (`Layout.compiled_optimizer_step`), AdamW and Adam are
`components/optim/compiled_adamw.py`'s subclasses: the same state, one compiled pass per parameter that
also applies the clip factor the train step hands over (`scale_next_step`) and writes the compute copy
(`write_copies`).

Under [offload] the container's `streamed` optimizers (`components/offload/optimizer.py`) step each
optimizer bucket by bucket over offloaded state, and put the whole state back around checkpoints.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from torchtrain.components.optim.compiled_adamw import CompiledAdam, CompiledAdamW
from torchtrain.components.optim.muon import Muon
from torchtrain.config.training import Optimizer as OptimizerConfig
from torchtrain.models.heads import output_heads

if TYPE_CHECKING:
    from torchtrain.distributed.layout import Layout


def muon_params(model: nn.Module) -> set[int]:
    """ids of the parameters Muon orthogonalises: >= 2 dims, not an embedding nor the output head."""
    adamw = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    for head in output_heads(model).values():
        adamw.update(id(p) for p in head.parameters())
    return {id(p) for p in model.parameters() if p.dim() >= 2 and id(p) not in adamw}


def _param_groups(model: nn.Module, weight_decay: float, muon: bool = False) -> list[dict]:
    """Decay / no-decay groups, further split by tensor kind (plain, or DTensor per device mesh):
    the foreach / fused kernels cannot mix plain tensors and DTensors, nor DTensor meshes. With
    `muon`, the Muon matrices form groups of their own (`use_muon`)."""
    orthogonal = muon_params(model) if muon else set()
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            kind = p.device_mesh if isinstance(p, DTensor) else None
            groups.setdefault((p.dim() < 2, id(p) in orthogonal, kind), []).append(p)
    ordered = sorted(groups.items(), key=lambda kv: (kv[0][0], not kv[0][1]))  # decay first, Muon first
    return [{"params": params, "weight_decay": 0.0 if no_decay else weight_decay, **({"use_muon": m} if muon else {})}
            for (no_decay, m, _), params in ordered]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, impl: str,
                    zero1_group: "dist.ProcessGroup | None" = None, compiled: bool = False) -> torch.optim.Optimizer:
    """`impl`: the resolved kernel ("fused", "foreach" or "for-loop"; see `layout.resolve_optimizer_impl`),
    for AdamW and Adam (Muon has one implementation); `compiled`: AdamW / Adam with the compiled step
    (`compiled_adamw.py`), whose state is laid out as the fused kernel's."""
    groups = _param_groups(model, cfg.weight_decay, muon=cfg.name == "Muon")
    if cfg.name == "Muon":
        cls = Muon
        kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, momentum=cfg.muon_momentum,
                      nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps)
    else:
        if compiled:
            cls = CompiledAdamW if cfg.name == "AdamW" else CompiledAdam
        else:
            cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
        kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                      foreach=impl == "foreach" and not compiled, fused=impl == "fused" or compiled)
    if zero1_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=zero1_group, **kwargs)
    return cls(groups, **kwargs)


class OptimizersContainer:
    """One optimizer per model part, stepped together. `zero1_group`: shard the state over it."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig, impl: str,
                 zero1_group: "dist.ProcessGroup | None" = None, compiled: bool = False):
        self.model_parts = model_parts
        self.optimizers = [build_optimizer(part, cfg, impl, zero1_group, compiled) for part in model_parts]
        self.streamed: list | None = None
        """The optimizers' offloaded steps, one per optimizer ([offload]; set by `OffloadRuntime`)."""

    @classmethod
    def for_layout(cls, model_parts: list[nn.Module], cfg: OptimizerConfig, layout: "Layout") -> "OptimizersContainer":
        """The optimizers the layout asks for: its kernel, and ZeRO-1 sharding over the dp ranks."""
        group = layout.dims.dp_mesh.get_group() if layout.zero1 else None
        return cls(model_parts, cfg, layout.optimizer_impl, zero1_group=group, compiled=layout.compiled_optimizer_step)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def step(self) -> None:
        for opt in self.streamed or self.optimizers:
            opt.step()

    @property
    def compiled(self) -> list[CompiledAdamW | CompiledAdam]:
        """The optimizers whose step is compiled (`compiled_adamw.py`): all or none."""
        return [opt for opt in self.optimizers if isinstance(opt, (CompiledAdamW, CompiledAdam))]

    def scale_next_step(self, factor: torch.Tensor) -> None:
        """The compiled step multiplies every gradient by `factor` (the clip factor) as it reads it."""
        for opt in self.compiled:
            opt.grad_scale = factor

    def write_copies(self, copies: dict[int, torch.Tensor]) -> None:
        """The compiled step writes each parameter's new value into `copies[id(parameter)]`."""
        for opt in self.compiled:
            opt.copies = copies

    def written(self) -> list[torch.Tensor]:
        """The parameters whose copy the last compiled step wrote."""
        return [p for opt in self.compiled for p in opt.written]

    def _resident(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for streamed in self.streamed or ():
            stack.enter_context(streamed.resident())
        return stack

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        merged: dict = {}
        with self._resident():
            for part, opt in zip(self.model_parts, self.optimizers):
                merged.update(get_optimizer_state_dict(part, opt, options=options))
        return merged

    def load_state_dict(self, state: dict) -> None:
        # Each (part, optimizer) pair picks its own parameters' entries from the merged flat dict.
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        with self._resident():
            for part, opt in zip(self.model_parts, self.optimizers):
                set_optimizer_state_dict(part, opt, state, options=options)

    @property
    def lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]
