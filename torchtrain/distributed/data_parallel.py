"""Replicated data parallelism (DDP, and the gradient side of ZeRO-1).

Every data-parallel rank holds the whole model; after backward the gradients are averaged with an
all-reduce (bucketed and overlapped with backward), so all replicas take the same optimizer step.
Memory per rank: 4 P (fp32 params) + 4 P (grads) + 8 P (Adam), no saving from more ranks.
ZeRO-1 keeps this for parameters and gradients and shards only the optimizer state (see
`components/optim/optimizer.py`), cutting the 8 P of Adam state to 8 P / dp.

The composable `replicate` API is used (it keeps parameter names unchanged, unlike wrapping in
DistributedDataParallel).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, bucket_cap_mb: int = 100) -> nn.Module:
    from torch.distributed._composable.replicate import replicate

    # No start-up broadcast of rank 0's weights: initialisation is identical on every rank
    # (distributed/param_init.py), and a checkpoint load sets every rank's weights itself.
    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=bucket_cap_mb, init_sync=False)
    return model
