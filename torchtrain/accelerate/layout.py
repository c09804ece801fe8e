"""`Accelerator(parallelism=..., mixed_precision=...)` -> the engine's resolved Layout.

`parallelism` holds the keys of a job file's `[parallelism]` table: a dict, the path of a TOML file
with a `[parallelism]` table (or only those keys at top level), or None (FSDP over every rank, the
table's defaults). The keys are type- and range-checked like a job file's and turned into the same
`Parallelism` dataclass; the Layout is then resolved by `distributed/layout.py::resolve_layout`, so
every rule (degrees that must multiply to the world size, which strategy applies which wrapper, the
reshard policy, dtypes, forbidden combinations) is the trainer's own.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from torchtrain.config import ConfigError, JobConfig
from torchtrain.config.fields import coerce, did_you_mean, field_types
from torchtrain.config.parallelism import Parallelism
from torchtrain.distributed.layout import Layout, resolve_layout

PRECISIONS = {"no": "float32", "bf16": "bfloat16"}
"""Accelerate's `mixed_precision` values -> training.mixed_precision_param."""

NOT_HERE = ("pipeline_parallel_", "context_parallel_degree", "expert_parallel_degree", "module_fqns_per_model_part",
            "enable_async_tensor_parallel")
"""[parallelism] keys of the trainer's model families that an arbitrary nn.Module cannot use here."""


def _table(parallelism: Any) -> tuple[dict[str, Any], str]:
    """The raw [parallelism] keys and where they came from."""
    if parallelism is None:
        return {}, "parallelism"
    if isinstance(parallelism, dict):
        return dict(parallelism), "parallelism"
    if isinstance(parallelism, (str, os.PathLike)):
        from torchtrain.config.manager import load_toml

        path = os.fspath(parallelism)
        data = load_toml(path)
        table = data.get("parallelism", data)
        return dict(table), path
    raise ConfigError(f"Accelerator(parallelism=...) must be a dict of [parallelism] keys or the path of a TOML "
                      f"file, got {type(parallelism).__name__}")


def parse_parallelism(parallelism: Any) -> Parallelism:
    """The checked `Parallelism` section from a dict, a TOML path or None."""
    raw, origin = _table(parallelism)
    fields = field_types(Parallelism)
    values = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"unknown key parallelism.{key} ({origin}){did_you_mean(key, list(fields))} "
                              f"Valid keys: {', '.join(fields)}")
        values[key] = coerce(value, fields[key], f"parallelism.{key}")
    section = Parallelism(**values)
    section.validate()
    for key in values:
        if key.startswith(NOT_HERE) and values[key] != getattr(Parallelism(), key):
            raise ConfigError(f"[parallelism.{key}] is not available for an arbitrary model in torchtrain.accelerate "
                              f"(only data parallelism and tensor parallelism are); remove it")
    return section


def resolve(parallelism: Parallelism, mixed_precision: str, world_size: int, device_type: str) -> Layout:
    """The Layout of `parallelism` on `world_size` processes (ConfigError when it does not fit)."""
    if mixed_precision not in PRECISIONS:
        raise ConfigError(f"Accelerator(mixed_precision={mixed_precision!r}) is not supported; use one of "
                          f"{', '.join(repr(p) for p in PRECISIONS)} (fp16 loss scaling and fp8 are not offered)")
    job = JobConfig()
    job.parallelism = parallelism
    job.training = replace(job.training, mixed_precision_param=PRECISIONS[mixed_precision])
    layout = replace(resolve_layout(job, world_size, device_type), allow_compute_copy=False)  # the loop is the user's
    if layout.zero1:
        raise ConfigError("[parallelism.data_parallel_strategy] zero1 is not offered by torchtrain.accelerate (the "
                          "user's optimizer is not a ZeroRedundancyOptimizer); use ddp, zero2 or zero3")
    return layout
