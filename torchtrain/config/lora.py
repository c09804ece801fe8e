"""Config section [lora]: low-rank adapters on frozen base weights (docs/finetuning.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from torchtrain.config.fields import ConfigError, Ge, Gt, Le


@dataclass
class Lora:
    enable: bool = False
    """Train rank-`rank` adapters beside the linear layers named by `target_modules` and freeze every
    other weight: each such layer computes W x + (alpha / rank) B A dropout(x), with A (rank x in)
    random and B (out x rank) zero at the start, so training starts from the base model. Only A and
    B get gradients and optimizer state. Composes with every parallelism (FSDP/HSDP, DDP, ZeRO, tensor,
    pipeline, context and expert parallelism; under expert parallelism the grouped experts are not
    linear layers and stay unadapted), activation checkpointing and compile; float8 is refused."""

    rank: Annotated[int, Ge(1)] = 8
    """Rank r of each adapter."""

    alpha: Annotated[float, Gt(0)] = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""

    dropout: Annotated[float, Ge(0), Le(1)] = 0.0
    """Dropout on the adapter's input (training only); 0 disables it."""

    target_modules: list[str] = field(default_factory=lambda: ["*.attention.wq", "*.attention.wk",
                                                               "*.attention.wv", "*.attention.wo"])
    """Linear layers that get adapters, as shell-style patterns (`*`, `?`, `[...]`) matched against
    each module's full name in the model (e.g. `layers.3.attention.wq`; `*.feed_forward.*` for the
    MLPs); a pattern without a `.` matches the last part of the name (`wq`). Every pattern must match
    at least one linear layer."""

    save_adapter_only: bool = False
    """Checkpoints hold the adapters only (with their optimizer state, the schedule, the data position and
    the RNG states), not the frozen base weights. Resuming from one first loads the base weights from
    `checkpoint.initial_load_path` (or, without it, draws them from the seed as at the start), then the
    adapters: exact when the base is the one the run started from."""

    def validate(self) -> None:
        if self.enable and not self.target_modules:
            raise ConfigError("[lora.target_modules] is empty: name the linear layers that get adapters, "
                              "e.g. [\"*.attention.wq\", \"*.attention.wv\"]")
