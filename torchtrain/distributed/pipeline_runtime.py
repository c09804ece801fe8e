"""Running this rank's pipeline stages: a training step through torch's schedule, and a forward-only
pass for evaluation.

Training (`PipelineRunner.step`): the step's local batch goes to the schedule, which cuts it into the
split's micro-batches and runs forwards and backwards in the schedule's order; the last stage applies
the loss to each micro-batch and records it. Only the schedule's micro-batch forwards count toward
the model's step statistics (`models.base.forward_counting`): the extra forward torch's stages run
on their first step to infer shapes (on empty tensors, for stages past the first) does not.

Evaluation (`PipelineRunner.forward`): the stages' forward is run directly, stage by stage in stage
order, over the whole batch, sending each stage's output to the rank of the next stage (a
shape/dtype header, then the tensor, over the pipeline process group). Unlike the schedule's
forward-only mode (`schedule.eval()`, torch >= 2.9) this works with every schedule and placement on
torch 2.11 and later, accepts any batch and sequence length (the schedule's buffers are sized for the
training micro-batches), and leaves the training schedule's state untouched.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchtrain.distributed.layout import Layout
from torchtrain.distributed.pipeline import build_schedule, schedule_timeline
from torchtrain.distributed.pipeline_overlap import register_overlap_f_b
from torchtrain.models.base import forward_counting
from torchtrain.utils.logging import logger

_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # dtype code, ndim, up to 6 dimensions


class PipelineRunner:
    """This rank's stages (`model_parts`, in stage order) and the schedule that trains them."""

    def __init__(self, layout: Layout, model_parts: list[nn.Module], device: torch.device,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        split, dims = layout.pipeline, layout.dims
        self.split, self.device = split, device
        self.group = dims.pp_mesh.get_group()
        self.pp_rank, self.pp = dims.pp_rank, dims.pp
        self.stage_ids = split.stage_ids(self.pp_rank, self.pp)
        self.model_parts = model_parts
        stages = [_counting_stage()(part, s, split.num_stages, device, group=self.group)
                  for s, part in zip(self.stage_ids, model_parts)]
        self.schedule = build_schedule(split, stages, loss_fn)
        # with forward/backward pairs overlapped: how many ran concurrently is logged after the first step
        self._log_overlap = layout.expert_comm is not None and layout.expert_comm.overlap_f_b
        if self._log_overlap:
            register_overlap_f_b(self.schedule)
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)

    def timeline(self):
        return schedule_timeline(self.schedule, self.split)

    def describe(self, microbatch_size: int) -> str:
        """The schedule, its bubble (simulated, and the GPipe/1F1B formula), its timeline and each stage's modules:
        what the trainer logs at start-up."""
        split, pp, timeline = self.split, self.pp, self.timeline()
        return (f"pipeline: {split.schedule_name}, {split.num_stages} stages ({split.stages_per_rank} per rank), "
                f"{split.n_microbatches} micro-batches of {microbatch_size}; bubble {100 * timeline.bubble_fraction:.1f}% "
                f"(GPipe/1F1B formula (p-1)/(m+p-1) = {100 * (pp - 1) / (split.n_microbatches + pp - 1):.1f}%)\n"
                f"{timeline.render()}\nstages: "
                + " | ".join(f"{i}: {', '.join(m)}" for i, m in enumerate(split.modules_per_stage)))

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, local_value, kwargs: dict | None = None) -> torch.Tensor:
        """One schedule step over the local batch; this rank's summed (scaled) loss (0 off the last stage).
        `kwargs` (per-token tensors such as positions) go to every stage, cut into micro-batches."""
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        targets = labels.to(self.device) if self.has_last else None
        args = (inputs.to(self.device),) if self.has_first else ()
        with forward_counting(False):  # shape inference; the micro-batch forwards count (_counting_stage)
            self.schedule.step(*args, target=targets, losses=losses, **(kwargs or {}))
        if self._log_overlap and self.schedule.overlapped_pairs:
            self._log_overlap = False
            logger.info("pipeline: %d forward/backward pairs ran concurrently in the first step "
                        "(expert_parallel_overlap_f_b)", self.schedule.overlapped_pairs)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([local_value(loss.detach()).float() for loss in losses]).sum()

    def forward(self, inputs: torch.Tensor, kwargs: dict | None = None,
                parts: list[nn.Module] | None = None) -> torch.Tensor | None:
        """The last stage's output (logits) for `inputs` on the rank that holds it, else None. `parts`: other
        modules cut into the same stages (a frozen reference copy), instead of this rank's own."""
        mine = dict(zip(self.stage_ids, parts if parts is not None else self.model_parts))
        owner = {s: r for r in range(self.pp) for s in self.split.stage_ids(r, self.pp)}
        h = None
        for s in range(self.split.num_stages):
            if s not in mine:
                continue
            if s == 0:
                x = inputs.to(self.device)
            elif owner[s - 1] == self.pp_rank:
                x = h
            else:
                x = _recv(dist.get_global_rank(self.group, owner[s - 1]), self.group, self.device)
            h = mine[s](x, **(kwargs or {}))
            if s + 1 < self.split.num_stages and owner[s + 1] != self.pp_rank:
                _send(h, dist.get_global_rank(self.group, owner[s + 1]), self.group)
        return h if self.split.num_stages - 1 in mine else None


def _counting_stage():
    """torch's PipelineStage whose micro-batch forwards (`forward_one_chunk`) count as training forwards,
    and whose start-up handshake leaves out its neighbours on its own rank: a V-shaped schedule puts
    two adjacent stages on one rank, which hand each other tensors directly, and gloo (before torch
    2.13) fails a send to the rank itself ("Pair is not connected")."""
    from torch.distributed.pipelining import PipelineStage

    class CountingStage(PipelineStage):
        def forward_one_chunk(self, *args, **kwargs):
            with forward_counting(True):
                return super().forward_one_chunk(*args, **kwargs)

        def _get_init_p2p_neighbors_ops(self):
            ops = super()._get_init_p2p_neighbors_ops()
            return [op for op in ops if getattr(op, "group_peer", None) != self.group_rank]

    return CountingStage


def _send(t: torch.Tensor, dst: int, group) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):  # stage outputs are local tensors under TP (use_local_output)
        t = t.to_local()
    t = t.contiguous()
    if t.dim() > _HEADER - 2:
        raise ValueError(f"stage output has {t.dim()} dimensions; at most {_HEADER - 2} can be sent")
    header = [_WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER - 2 - t.dim())
    dist.send(torch.tensor(header, dtype=torch.int64, device=t.device), dst, group=group)
    dist.send(t, dst, group=group)


def _recv(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    code, ndim, *dims = header.tolist()
    out = torch.empty(dims[:ndim], dtype=_WIRE_DTYPES[code], device=device)
    dist.recv(out, src, group=group)
    return out
