"""A user's tensor-parallel plan for any nn.Module: module-name patterns -> styles, checked, applied.

A plan maps a module name (an `fnmatch` glob over `named_modules()` names, e.g. `blocks.*.attn.q` or
`blocks.*.mlp.fc[12]`) to a style: a style name (`utils/tp_styles.py`, the one translation of torch's,
torchtitan's and transformers' names: `colwise`, `rowwise`, `sequence_parallel`, `colwise_gather_output`,
...) or any `torch.distributed.tensor.parallel.ParallelStyle` object, applied with `parallelize_module`
over the "tp" mesh dimension. Column-parallel names split an nn.Linear's output features (an
nn.Embedding's embedding dimension), row-parallel names its input features (an nn.Embedding's rows; the
partial outputs summed into a replicated output), replicated names fit norms and dropout (computed on
sequence shards, dimension 1).

Every pattern must match a module, every named style must fit the module it matches (type and a
TP-divisible size); otherwise a ConfigError names the pattern and the module.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from torchtrain.config.fields import ConfigError
from torchtrain.utils import tp_styles

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.Dropout)


def _split_size(module: nn.Module, style: str) -> tuple[str, int] | None:
    """(what, size) the style splits over the TP ranks, or None when the style does not fit the type."""
    if isinstance(module, nn.Linear):
        return (("out_features", module.out_features) if style in tp_styles.COLUMN
                else ("in_features", module.in_features))
    if isinstance(module, nn.Embedding):
        return (("embedding_dim", module.embedding_dim) if style in tp_styles.COLUMN
                else ("num_embeddings", module.num_embeddings))
    return None


def _check(name: str, pattern: str, module: nn.Module, style: str, tp: int) -> None:
    kind = type(module).__name__
    if style in tp_styles.REPLICATED:
        if not isinstance(module, _NORMS):
            raise ConfigError(f"tp_plan[{pattern!r}]: {style!r} fits a norm or dropout layer, but {name!r} "
                              f"is a {kind}; use 'colwise'/'rowwise' for linear layers")
        return
    split = _split_size(module, style)
    if split is None:
        raise ConfigError(f"tp_plan[{pattern!r}]: {style!r} fits nn.Linear or nn.Embedding, but {name!r} is a {kind}; "
                          f"name its linear layers instead (or give a ParallelStyle object)")
    what, size = split
    if size % tp:
        raise ConfigError(f"tp_plan[{pattern!r}]: {name!r} has {what} {size}, not divisible by "
                          f"tensor_parallel_degree {tp}; each TP rank must hold an equal share")


def resolve_plan(model: nn.Module, plan: dict[str, Any], tp: int) -> dict[str, ParallelStyle]:
    """Module name -> ParallelStyle for every module the plan's patterns match (ConfigError when a pattern
    matches nothing, a style is unknown, or a style does not fit its module)."""
    if not isinstance(plan, dict):
        raise ConfigError(f"tp_plan must be a dict of module-name pattern -> style, got {type(plan).__name__}")
    names = [n for n, _ in model.named_modules() if n]
    modules = dict(model.named_modules())
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle) and style not in tp_styles.NAMES:
            raise ConfigError(f"tp_plan[{pattern!r}]: unknown style {style!r}; use one of "
                              f"{', '.join(repr(s) for s in tp_styles.NAMES)} or a torch ParallelStyle object")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            sample = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ConfigError(f"tp_plan[{pattern!r}] matches no module of {type(model).__name__} (modules: {sample})")
        for name in matched:
            if isinstance(style, str):
                _check(name, pattern, modules[name], style, tp)
                out[name] = tp_styles.translate(style)
            else:
                out[name] = style
    return out


def apply_tp_plan(model: nn.Module, plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh) -> None:
    """Parallelise each planned module over the TP mesh, in place."""
    for name, style in plan.items():
        parallelize_module(model.get_submodule(name), tp_mesh, style)
