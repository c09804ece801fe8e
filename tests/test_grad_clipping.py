"""Gradient clipping over every kind of gradient a layout leaves (`distributed/utils.py::clip_grad_norm_`):
plain tensors, sharded DTensors, and Partial ones -- a replicated weight each tensor-parallel rank used for
its share of the work (a transformers model's norms under TP) holds a pending sum until it is reduced.
Every gradient must end scaled by the same coefficient, and none may stay a pending sum: torch before
2.13 drops an in-place scaling of a Partial DTensor, which left those gradients unclipped (9x too large
in the first step of a TP run) while the logged norm was right. One process, a one-rank mesh."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torchtrain.distributed.utils import clip_grad_norm_


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_every_kind_of_gradient_is_clipped_by_the_same_coefficient(mesh):
    torch.manual_seed(0)
    grads = {"plain": torch.randn(4, 3), "sharded": torch.randn(6, 2), "partial": torch.randn(5)}
    plain = torch.nn.Parameter(torch.zeros(4, 3))
    sharded = torch.nn.Parameter(DTensor.from_local(torch.zeros(6, 2), mesh, [Shard(0)]))
    replicated = torch.nn.Parameter(DTensor.from_local(torch.zeros(5), mesh, [Replicate()]))
    plain.grad = grads["plain"].clone()
    sharded.grad = DTensor.from_local(grads["sharded"].clone(), mesh, [Shard(0)])
    replicated.grad = DTensor.from_local(grads["partial"].clone(), mesh, [Partial()])
    expected_norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))

    norm = clip_grad_norm_([plain, sharded, replicated], max_norm=1.0)

    assert float(norm) == pytest.approx(expected_norm, rel=1e-6)
    coefficient = 1.0 / (expected_norm + 1e-6)
    assert not any(p.is_partial() for p in replicated.grad.placements)
    for got, want in ((plain.grad, grads["plain"]), (sharded.grad.full_tensor(), grads["sharded"]),
                      (replicated.grad.full_tensor(), grads["partial"])):
        torch.testing.assert_close(got, want * coefficient, rtol=1e-6, atol=0)
