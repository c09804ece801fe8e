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

Kept between steps (`kept`): where the optimizer's step writes each parameter's new value into its copy
as it updates it (`components/optim/compiled_adamw.py`, `Layout.compiled_optimizer_step`), the copy stays
allocated and the step-start cast is skipped for every copy still fresh -- its master unchanged since the
optimizer wrote it (the tensor's version counter and storage are those recorded then). Anything else that
writes a master (a checkpoint load, a rollback) changes its version, so that copy is cast again.

Gradients left on the copy (`keep_grads`): with one micro-batch a step there is nothing to accumulate, and
upcasting a bf16 gradient to float32 is exact, so a step whose optimizer reads the low-precision gradient
and upcasts it as it reads (the compiled step) gets the same values without the float32 gradients: the
copies' `.grad` stay until the step ends (`grad_holders`, `release_grads`), 2 bytes a parameter instead of
4, and no upcast pass. Code that reads the parameters' `.grad` during the step (the "gradients" extension
point, fault injection) gets them upcast into the masters first (`grads_to_masters`).

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

    def __init__(self, model_parts: list[nn.Module], dtype: torch.dtype, kept: bool = False, keep_grads: bool = False):
        self.dtype, self.kept, self.keep_grads = dtype, kept, keep_grads
        self._slots: list[tuple[nn.Module, str, int]] = []  # (module, attribute, index into the lists below)
        self.masters: list[nn.Parameter] = []
        self.copies: list[nn.Parameter] = []
        for param, places in parameter_places(model_parts):  # a tied parameter: one copy, all its places
            self._slots += [(module, name, len(self.masters)) for module, name in places]
            self.masters.append(param)
            self.copies.append(self._new_copy(param))
        self._nbytes = [c.numel() * c.element_size() for c in self.copies]
        self._depth = 0
        self._index = {id(m): i for i, m in enumerate(self.masters)}
        self._fresh: list[tuple[int, int] | None] = [None] * len(self.masters)
        """Per master, its (version, storage) when its copy was last written (kept copies only)."""

    def by_master(self) -> dict[int, torch.Tensor]:
        """id(master) -> its copy: where an optimizer step writes the new values (`kept` copies)."""
        return {id(m): c for m, c in zip(self.masters, self.copies)}

    def written(self, masters: list[torch.Tensor]) -> None:
        """The optimizer has just written these masters' new values into their copies."""
        for m in masters:
            self._fresh[self._index[id(m)]] = self._stamp(m)

    @staticmethod
    def _stamp(master: torch.Tensor) -> tuple[int, int]:
        return master._version, master.untyped_storage()._cdata  # in-place writes; a storage replaced

    def _refresh(self) -> None:
        """Allocate the copies and cast the masters into them; kept copies: only those not fresh."""
        stale = range(len(self.masters))
        if self.kept:
            stale = [i for i, m in enumerate(self.masters)
                     if self._fresh[i] != self._stamp(m) or self.copies[i].untyped_storage().nbytes() == 0]
        if not stale:
            return
        for i in stale:
            self.copies[i].untyped_storage().resize_(self._nbytes[i])
        with torch.no_grad():
            torch._foreach_copy_([self.copies[i] for i in stale], [self.masters[i] for i in stale])
        if self.kept:
            self.written([self.masters[i] for i in stale])

    def _new_copy(self, master: nn.Parameter) -> nn.Parameter:
        copy = nn.Parameter(torch.empty_like(master, dtype=self.dtype), requires_grad=master.requires_grad)
        copy.untyped_storage().resize_(0)  # allocated only while a step runs (from the first one on: `kept`)
        if master.requires_grad and not self.keep_grads:
            copy.register_post_accumulate_grad_hook(self._hook(master))
        return copy

    def grad_holders(self) -> list[torch.Tensor]:
        """The tensors whose `.grad` are this step's gradients: the copies while they hold them
        (`keep_grads`), the masters otherwise."""
        return self.copies if any(c.grad is not None for c in self.copies) else self.masters

    def grads_to_masters(self) -> None:
        """Move gradients left on the copies into the masters' `.grad`, upcast (for code reading those)."""
        for master, copy in zip(self.masters, self.copies):
            if copy.grad is not None:
                master.grad, copy.grad = copy.grad.to(master.dtype), None

    def release_grads(self) -> None:
        """The step is over: free the gradients left on the copies."""
        for copy in self.copies:
            copy.grad = None

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
        self._refresh()
        self._swap(self.copies)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self._swap(self.masters)
            for copy in self.copies:
                if not self.keep_grads:
                    copy.grad = None
                if not self.kept:
                    copy.untyped_storage().resize_(0)

    def __len__(self) -> int:
        return len(self.masters)
