"""Data-dependent sizes on the host, with a stand-in where tensors hold no data."""

from __future__ import annotations

import torch


def host_split_sizes(counts: torch.Tensor, total: int) -> list[int]:
    """`counts` as host integers (a device synchronisation). Without data -- fake or meta tensors: the
    planner's trace, pipeline shape inference -- the sizes are unknown and taken as balanced: `total`
    split evenly over the entries (MoE routing is assumed uniform there)."""
    from torch._subclasses.fake_tensor import is_fake

    if counts.is_meta or is_fake(counts):
        q, r = divmod(total, counts.numel())
        return [q + (i < r) for i in range(counts.numel())]
    return counts.tolist()
