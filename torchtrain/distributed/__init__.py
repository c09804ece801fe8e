"""Distributed building blocks: the device mesh, FSDP2, layout-independent init, comm utilities."""

from torchtrain.distributed.parallel_dims import ParallelDims

__all__ = ["ParallelDims"]
