"""Parallelism for any nn.Module, as a resolved Layout says: TP plan -> AC -> compile -> FSDP2/HSDP or DDP.

The order is the engine's (`distributed/parallelize.py`): tensor parallelism first (it must see the plain
nn.Linear modules), then activation checkpointing and compile of the modules of the named classes,
then data parallelism wraps last -- FSDP2 `fully_shard` over the layout's FSDP mesh (HSDP when the
layout has a replicate dimension) with the layout's mixed-precision and reshard policies
(`distributed/fsdp.py::apply_fsdp`), or DDP's `replicate` (`distributed/data_parallel.py`).

FSDP units: modules whose class is listed, or whose name matches a glob, in `fsdp_units`; by default
every module that holds a large share of the parameters (`default_units`).

A model built on the meta device is materialised on the device after wrapping and initialised by the
given `init_weights(model)` (or each module's `reset_parameters()`); a materialised model keeps its
values (TP and FSDP split the tensors every rank holds).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Iterable

import torch
from torch import nn

from torchtrain.accelerate.tp_plan import apply_tp_plan, resolve_plan
from torchtrain.config.fields import ConfigError
from torchtrain.distributed.data_parallel import apply_ddp
from torchtrain.distributed.fsdp import apply_fsdp
from torchtrain.distributed.layout import Layout

UNIT_SHARE = 0.05
"""A module is a default FSDP unit when it holds at least this share of the model's parameters."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def default_units(model: nn.Module, share: float = UNIT_SHARE) -> list[nn.Module]:
    """The root's children -- looking through ModuleList/ModuleDict containers, so each block
    of a stack is its own candidate -- that hold at least `share` of the model's parameters."""
    total = max(_count(model), 1)
    units: list[nn.Module] = []

    def visit(children: Iterable[nn.Module]) -> None:
        for child in children:
            if isinstance(child, _CONTAINERS):
                visit(child.children())
            elif _count(child) >= share * total:
                units.append(child)

    visit(model.children())
    return units


def _matching(model: nn.Module, selectors, what: str) -> list[nn.Module]:
    """Modules (not the root) whose class is in `selectors` or whose name matches a glob in it."""
    if selectors is None:
        return []
    selectors = list(selectors) if isinstance(selectors, (list, tuple, set)) else [selectors]
    classes = tuple(s for s in selectors if isinstance(s, type))
    patterns = [s for s in selectors if isinstance(s, str)]
    if len(classes) + len(patterns) < len(selectors):
        raise ConfigError(f"{what} takes module classes or module-name patterns, got {selectors!r}")
    found = [m for n, m in model.named_modules()
             if n and (isinstance(m, classes) or any(fnmatch.fnmatchcase(n, p) for p in patterns))]
    if not found:
        raise ConfigError(f"{what}={selectors!r} selects no module of {type(model).__name__}")
    return found


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """Drop the modules nested inside another selected one (a wrapper applies to a subtree once)."""
    inner = {id(d) for m in modules for d in m.modules() if d is not m}
    return [m for m in modules if id(m) not in inner]


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _reset(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def parallelize(model: nn.Module, layout: Layout, device: torch.device, tp_plan: dict | None = None,
                fsdp_units=None, checkpoint_modules=None, compile_modules=None,
                init_weights: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Apply the layout to `model` in place and return it, on `device`, materialised."""
    dims = layout.dims
    meta = is_meta(model)
    plan = resolve_plan(model, tp_plan, dims.tp) if tp_plan else {}
    if dims.tp_enabled and not plan:
        raise ConfigError(f"[parallelism.tensor_parallel_degree] {dims.tp} needs a tensor-parallel plan: "
                          f"Accelerator(tp_plan={{'module.name.pattern': 'colwise' | 'rowwise', ...}})")
    units = _outermost(_matching(model, fsdp_units, "fsdp_units")) if fsdp_units is not None else default_units(model)
    ac = _outermost(_matching(model, checkpoint_modules, "checkpoint_modules"))
    compiled = _outermost(_matching(model, compile_modules, "compile_modules"))
    if not meta:
        model.to(device)
    if dims.tp_enabled:
        apply_tp_plan(model, plan, dims.world_mesh["tp"])
    if ac:
        from torch.distributed._composable import checkpoint

        for module in ac:
            checkpoint(module)  # (composable: parameter names stay as they are)
    if compiled:
        from torchtrain.distributed.compile import check_compiler
        from torchtrain.utils.not_compiled import exclude_from_graphs

        check_compiler(device.type)
        exclude_from_graphs()
        for module in compiled:
            module.compile()
    if layout.ddp:  # (DDP holds whole tensors: a meta model is materialised before the wrapper sees it)
        if meta:
            _materialize(model, device, init_weights)
            meta = False
        apply_ddp(model, dims.dp_mesh)
    elif layout.fsdp:
        apply_fsdp(model, dims.fsdp_mesh, units, param_dtype=layout.param_dtype, reduce_dtype=layout.reduce_dtype,
                   reshard_after_forward=layout.reshard_after_forward)
    if meta:
        _materialize(model, device, init_weights)
    return model


def _materialize(model: nn.Module, device: torch.device, init_weights: Callable[[nn.Module], None] | None) -> None:
    model.to_empty(device=device)
    with torch.no_grad():
        (init_weights or _reset)(model)
