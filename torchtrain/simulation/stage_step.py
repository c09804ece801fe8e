"""A pipeline rank's step in a fake world, in place of torch's schedule.

torch's schedule starts by exchanging values with the other pipeline ranks (a warm-up exchange,
shape inference), which a fake world cannot give. `StagePipeline` stands in for the trainer's
`PipelineRunner` inside the very same `TrainStep` (pass it as the step's `pipeline`): each of this
rank's stages runs forward and backward on up to `max_microbatches` micro-batches of the job's
shape, one after the other -- the first stage on the tokens, the others on a fake activation of the
stage boundary's shape (received from the previous stage in training), the last applying the step's
loss -- with FSDP gradient sync and reshard-after-backward on the last micro-batch only, as the
schedule does. Token counting, loss scaling, z-loss, MoE statistics, extra losses, clipping and the
optimizer step are the `TrainStep`'s own.

`forward` stands in for `PipelineRunner.forward` (a no-grad scoring pass such as a DPO reference's): this
rank's stages over the whole batch, the later ones on a fake activation of the boundary's shape.

With a `TensorMemoryTracker`, `stored` receives the activation bytes each stage-micro-batch forward
left stored (what k micro-batches in flight multiply: the planner's trace).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn

from torchtrain.distributed.fsdp import fsdp_modules
from torchtrain.distributed.layout import Layout
from torchtrain.simulation.parts import PartCut


class StagePipeline:
    def __init__(self, layout: Layout, model_parts: list[nn.Module], device: torch.device, loss_fn: Callable,
                 cuts: list[PartCut], seq_len: int, dim: int, tracker=None, stored: list[float] | None = None,
                 max_microbatches: int = 2, tensor_mode: ContextManager | None = None):
        split, dims = layout.pipeline, layout.dims
        self.model_parts, self.cuts, self.loss_fn, self.device = model_parts, cuts, loss_fn, device
        self.stage_ids = [cut.index for cut in cuts]
        self.microbatch_size = layout.batch.local_batch_size * layout.batch.grad_accum_steps // split.n_microbatches
        self.n_micro = min(split.n_microbatches, max_microbatches)
        self.tracker, self.stored = tracker, stored if stored is not None else []
        # stage-boundary activations (a sequence-parallel shard), made here: outside the measured step, in the
        # step's `tensor_mode` (the planner's fake tensors: a 405B boundary holds no data)
        shape = (self.microbatch_size, seq_len // (dims.cp * dims.tp), dim)
        with tensor_mode or contextlib.nullcontext():
            self.received = [torch.randn(shape, dtype=layout.param_dtype) for _ in range(self.n_micro)]

    def forward(self, inputs: torch.Tensor, kwargs: dict | None = None,
                parts: list[nn.Module] | None = None) -> torch.Tensor | None:
        """`PipelineRunner.forward` on this rank: its stages (or `parts`, cut the same way: a frozen reference
        copy) over the whole batch, one after the other, a stage after another rank's on a fake activation of the
        boundary's shape (made here: the receive's buffer); the last stage's output, else None."""
        out = None
        for stage, part in zip(self.cuts, parts if parts is not None else self.model_parts):
            x = inputs.to(self.device) if stage.first else \
                torch.randn((inputs.shape[0], *self.received[0].shape[1:]), dtype=self.received[0].dtype)
            out = part(x, **(kwargs or {}))
        return out if self.cuts[-1].last else None

    def _activations(self) -> float:
        return self.tracker.current_breakdown()["activations"] if self.tracker is not None else 0.0

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, local_value, kwargs: dict | None = None) -> torch.Tensor:
        """This rank's stages over the first micro-batches of the local batch; the summed scaled loss of
        the last stage's micro-batches (0 off the last stage), as `PipelineRunner.step`."""
        mb, losses = self.microbatch_size, []
        for i in range(self.n_micro):
            cut = slice(i * mb, (i + 1) * mb)
            tokens, targets = inputs[cut].to(self.device), labels[cut].to(self.device)
            micro_kwargs = {k: v[cut] for k, v in (kwargs or {}).items()}
            last_micro = i == self.n_micro - 1
            for part in fsdp_modules(self.model_parts):
                part.set_requires_gradient_sync(last_micro)
                part.set_reshard_after_backward(last_micro)
            for stage, part in zip(self.cuts, self.model_parts):
                x = tokens if stage.first else self.received[i].detach().requires_grad_(True)
                before = self._activations()
                out = part(x, **micro_kwargs)
                if stage.last:
                    out = self.loss_fn(out, targets)
                    losses.append(local_value(out.detach()).float())
                self.stored.append(self._activations() - before)
                out.backward(None if stage.last else torch.ones_like(out))
                del out, x
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum()
