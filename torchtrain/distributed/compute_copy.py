"""Mixed precision on a data-parallel group of one rank, without FSDP: a compute copy of the parameters.

With one data-parallel rank, FSDP2's `fully_shard` gathers nothing and reduces nothing; for a bf16 (or
fp16) job all it does is cast. Its machinery for that cast (per-unit copy-in and copy-out buffers,
a reduce-scatter of one rank, pre/post hooks on every unit) costs hundreds of host-side operations a
step, and a launch-bound GPU step pays each of them. This module does only the cast:

    step start           p16 <- p32                    every parameter cast once into a reused buffer
    forward, backward    the modules hold p16           (swapped in; recomputation under activation
                                                        checkpointing sees p16 too)
    each gradient        g32 <- g32 + float(g16)        as it is produced (a post-accumulate-grad hook);
                                                        g16 is freed at once
    after the step's     the modules hold p32 again, p16's storage is freed
    last backward
    clip, optimizer,     p32 and g32, exactly as under FSDP
    checkpoints

The numerics are those of FSDP2 on one rank with `param_dtype` = p16's dtype and `reduce_dtype` float32:
compute from parameters rounded once per step, gradients upcast to float32 as they arrive and summed
over micro-batches in float32, a float32 optimizer step. So the losses equal those of the FSDP layout
(bitwise on CPU, tested), and because the float32 parameters keep their names and stay in the
modules outside the step, checkpoints are interchangeable with FSDP runs.

Memory: the low-precision copy lives from the step's first forward to its last backward (FSDP keeps
only the current unit's gathered parameters; autocast keeps the casts it caches for backward, which
is the same amount), low-precision gradients one parameter at a time, float32 gradients from their
first arrival to the end of the step (as under FSDP).

`Layout.compute_copy` decides where this applies (one rank of data and context parallelism, no other
model parallelism, no CPU offload, LoRA or float8 all-gather); the train step enters `active()` around
its forward/backward and the evaluation forwards enter it through the step's context.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from torchtrain.utils.parameters import parameter_places


class ComputeCopy:
    """The low-precision compute copies of `model_parts`' parameters (see the module doc)."""

    def __init__(self, model_parts: list[nn.Module], dtype: torch.dtype):
        self.dtype = dtype
        self._slots: list[tuple[nn.Module, str, int]] = []  # (module, attribute, index into the lists below)
        self.masters: list[nn.Parameter] = []
        self.copies: list[nn.Parameter] = []
        for param, places in parameter_places(model_parts):  # a tied parameter: one copy, all its places
            self._slots += [(module, name, len(self.masters)) for module, name in places]
            self.masters.append(param)
            self.copies.append(self._new_copy(param))
        self._nbytes = [c.numel() * c.element_size() for c in self.copies]
        self._depth = 0

    def _new_copy(self, master: nn.Parameter) -> nn.Parameter:
        copy = nn.Parameter(torch.empty_like(master, dtype=self.dtype), requires_grad=master.requires_grad)
        copy.untyped_storage().resize_(0)  # allocated only while a step runs
        if master.requires_grad:
            copy.register_post_accumulate_grad_hook(self._hook(master))
        return copy

    @staticmethod
    def _hook(master: nn.Parameter):
        def to_master(copy: torch.Tensor) -> None:
            grad, copy.grad = copy.grad, None
            if master.grad is None:
                master.grad = grad.to(master.dtype)
            else:
                master.grad.add_(grad)
        return to_master

    def _swap(self, params: list[nn.Parameter]) -> None:
        for module, name, i in self._slots:
            module._parameters[name] = params[i]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The modules compute from fresh low-precision copies inside; nested entries share the outer one."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        for copy, nbytes in zip(self.copies, self._nbytes):
            copy.untyped_storage().resize_(nbytes)
        with torch.no_grad():
            torch._foreach_copy_(self.copies, self.masters)
        self._swap(self.copies)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self._swap(self.masters)
            for copy in self.copies:
                copy.grad = None
                copy.untyped_storage().resize_(0)

    def __len__(self) -> int:
        return len(self.masters)
