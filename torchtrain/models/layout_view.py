"""What a model's own checks and adaptations may read of the resolved layout (`distributed/layout.py::Layout`),
declared here as protocols so that models/ names it without importing distributed/ (nothing imports upward).
The Layout and its ParallelDims satisfy them (every member is read, never set: the Layout computes most of
them as properties); a model that needs more of the layout adds it here first."""

from __future__ import annotations

from typing import Protocol


class DegreesView(Protocol):
    """The parallel degrees (`distributed/parallel_dims.py::ParallelDims`)."""

    tp: int
    cp: int
    tp_enabled: bool
    cp_enabled: bool
    ep_enabled: bool
    pp_enabled: bool


class BatchView(Protocol):
    """The batch plan: the job's sequence length."""

    seq_len: int


class LayoutView(Protocol):
    """The resolved layout, as a model's `validate` and `adapt` hooks read it."""

    dims: DegreesView
    batch: BatchView
    local_seq_len: int
    cp_chunk_len: int
