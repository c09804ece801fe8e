"""Model registry: name -> everything the trainer needs to build, parallelise and train a model.

A new model plugs in by calling :func:`register_model_spec` (usually in its package's
``__init__.py``) and importing that package from ``torchtrain/models/__init__.py``; the trainer and
the config parser then accept ``[model] name = "<name>"`` without any other change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from torchtrain.config.fields import ConfigError, did_you_mean
from torchtrain.models.base import BaseModelArgs

if TYPE_CHECKING:
    from torchtrain.config import JobConfig
    from torchtrain.distributed.parallel_dims import ParallelDims
    from torchtrain.models.state_dict_adapter import StateDictAdapter

ParallelizeFn = Callable[[nn.Module, "ParallelDims", "JobConfig"], nn.Module]
ValidateFn = Callable[[BaseModelArgs, "ParallelDims", "JobConfig"], None]


@dataclass
class ModelSpec:
    """Everything model-specific the trainer uses. Optional hooks default to "not supported"."""

    name: str
    model_cls: type[nn.Module]
    args_cls: type[BaseModelArgs]
    flavors: dict[str, BaseModelArgs]
    parallelize_fn: ParallelizeFn
    """Apply the model's parallel plan (TP, activation checkpointing, compile, FSDP) in place."""
    validate_fn: ValidateFn | None = None
    """Check the model's arguments against the parallel layout (e.g. heads divisible by TP)."""
    stage_modules_fn: Callable[..., list[list[str]]] | None = None
    """Pipeline split: (args, num_stages, first_less, last_less) -> module names per stage, in model
    order. Stages are cut with `distributed.pipeline.keep_modules`, so a model's top-level modules
    must tolerate being None and its repeated blocks must live in an nn.ModuleDict."""
    state_dict_adapter: type["StateDictAdapter"] | None = None
    """Converts weights to/from Hugging Face format (HF export/import of `[checkpoint]`)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Further model-specific hooks for extensions (free-form)."""


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"model {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    import torchtrain.models  # noqa: F401  (registers the built-in models)

    if name not in _REGISTRY:
        hint = did_you_mean(name, list(_REGISTRY))
        raise ConfigError(f"[model.name] unknown model {name!r}{hint} Registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def model_names() -> list[str]:
    import torchtrain.models  # noqa: F401

    return list(_REGISTRY)


def build_model_args(spec: ModelSpec, flavor: str, overrides: dict[str, Any]) -> BaseModelArgs:
    """The flavor preset with the job's `[model]` overrides applied, validated."""
    if flavor not in spec.flavors:
        hint = did_you_mean(flavor, list(spec.flavors))
        raise ConfigError(
            f"[model.flavor] {spec.name} has no flavor {flavor!r}{hint} Flavors: {', '.join(spec.flavors)}"
        )
    args = spec.flavors[flavor].replace(**overrides)
    args.validate()
    return args
