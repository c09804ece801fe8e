"""Config sections of the device mesh: [parallelism], [comm]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from torchtrain.config.fields import ConfigError, Ge


@dataclass
class Parallelism:
    data_parallel_replicate_degree: Annotated[int, Ge(1)] = 1
    """Replicas of the (sharded) model. > 1 with data_parallel_shard_degree > 1 is HSDP: shard within
    a replica group, all-reduce gradients across replicas."""

    data_parallel_shard_degree: int = -1
    """Ranks each parameter is sharded over by FSDP2 (ZeRO-3). -1: every rank the other degrees leave.
    The product of all degrees must equal the world size."""

    tensor_parallel_degree: Annotated[int, Ge(1)] = 1
    """Tensor (Megatron-style) parallel degree. 1 disables it."""

    pipeline_parallel_degree: Annotated[int, Ge(1)] = 1
    """Pipeline parallel degree (number of ranks a model is cut across). 1 disables it."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward (`always`, ZeRO-3), keep them until backward (`never`,
    ZeRO-2-like, more memory, less communication), or `default`: always, except for the root module
    whose parameters backward needs first."""

    def validate(self) -> None:
        if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
            raise ConfigError(
                "[parallelism.data_parallel_shard_degree] must be -1 (use the remaining ranks) or >= 1, "
                f"got {self.data_parallel_shard_degree}"
            )


@dataclass
class Comm:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend. `auto`: NCCL on CUDA, gloo on CPU."""

    init_timeout_seconds: Annotated[int, Ge(1)] = 300
    """Timeout for collectives until the first step finishes (start-up includes slow work such as
    loading a checkpoint)."""

    train_timeout_seconds: Annotated[int, Ge(1)] = 100
    """Timeout for collectives after the first step: a rank that hangs longer fails the job instead of
    holding every rank forever."""
