"""FSDP2 (`fully_shard`): ZeRO-3 sharding of parameters, gradients and optimizer state; HSDP.

With dp_shard = N, each rank stores 1/N of every parameter (a DTensor sharded on dim 0). Before a
unit's forward the full parameter is all-gathered, used, and (when resharding after forward) freed;
backward gathers it again and reduce-scatters the gradient, so each rank keeps only its gradient
shard. Memory per rank for P parameters with Adam in fp32 is therefore ~ (4 + 4 + 8) P / N bytes
plus one unit's full parameters at a time. HSDP (a 2-D (replicate, shard) mesh) shards within a
group of N ranks and all-reduces gradients across the R groups.

Gradients are averaged over the R x N data-parallel ranks; the trainer scales each rank's loss so that
this average equals the gradient of the global token-mean loss (see `trainer/loss.py`).
"""

from __future__ import annotations

import warnings
from typing import Iterable, Literal, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

# Under tensor parallelism the token embedding returns its local shard, `DTensor.to_local()`'s view, and FSDP warns
# at every run that an in-place op on a view it returns would drop its backward hook. The decoders use that output
# out of place only (FSDP x TP trains as one process does: tests/test_parallel_features.py), so the warning is not
# shown for the embedding; any other module's view still is.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    units: Sequence[nn.Module | list[nn.Module]],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: Literal["default", "always", "never"] = "default",
    cpu_offload: bool = False,
    expert_units: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard each unit (in forward order), then the root for whatever parameters remain.

    `expert_units` (expert parallelism): modules whose parameters are already split over the EP mesh;
    each becomes its own unit over `expert_mesh` first (sharded on dim 1, `expert_fsdp_placement`), so
    the enclosing units leave them out.

    `reshard_after_forward` is the effective policy (`layout.effective_reshard`: zero2 and pipeline
    stages resolve `default` to `never`). `default` reshards every unit after forward except the last
    one, whose parameters backward needs immediately; the root keeps its parameters (they are the
    first used by backward's tail). `cpu_offload` keeps the sharded state in host memory.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # the units' floating-point inputs are already in the compute dtype (the previous unit's output), except
    # side inputs that must stay float32 (the RoPE table): only the root casts what enters the model
    unit_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    extra = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
    if expert_units:
        from torchtrain.distributed.expert_parallel import expert_fsdp_placement

        placement = expert_fsdp_placement(expert_mesh.size(expert_mesh.ndim - 1))
        for unit in expert_units:
            fully_shard(unit, mesh=expert_mesh, mp_policy=unit_mp, reshard_after_forward=reshard_after_forward != "never",
                        shard_placement_fn=placement, **extra)
    for i, unit in enumerate(units):
        if reshard_after_forward == "default":
            reshard = i < len(units) - 1
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(unit, mesh=mesh, mp_policy=unit_mp, reshard_after_forward=reshard, **extra)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward == "always", **extra)
    return model


def fsdp_modules(modules: Iterable[nn.Module]) -> list[FSDPModule]:
    return [m for m in modules if isinstance(m, FSDPModule)]
