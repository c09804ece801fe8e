"""One optimisation step -- the train module, separate from the Trainer's loop.

`TrainStep` holds what a step needs (model parts, loss, optimizers, LR schedule, loss scaler,
autocast, the pipeline runner), all configured from the resolved Layout, and nothing about the run
around it (data, logging, checkpoints, validation cadence). The Trainer calls it every step, the
planner's trace runs the very same step on fake tensors to measure memory, and the validator
evaluates through its `forward`.

One step over the micro-batches m of this rank (gradient accumulation), with R = dp x cp ranks
holding different tokens (data-parallel ranks, each sequence split over context-parallel ranks):

    N     = global number of valid target tokens of the step (all-reduced over the R ranks)
    loss  = sum_t CE(m, t) * R / N            per micro-batch, over this rank's tokens, then backward
            (data-parallel gradient sync only on the last micro-batch; under PP the schedule runs
            the micro-batches)
    unscale (float16) -> clip to the global gradient norm -> the hooks' verdict (skip?) ->
    optimizer step (or skip; a compiled step applies the clip factor itself and writes the compute
    copy: `components/optim/compiled_adamw.py`) -> float8 scales (float8 all-gather with precomputed scales) ->
    LR step -> zero grads
    reported loss = sum over ranks and micro-batches of the scaled losses / R = the global token mean

FSDP / DDP average gradients over those R ranks, so the gradient is exactly that of the global
token-mean loss under any layout (trainer/loss.py). Under context parallelism each batch is first
cut to this rank's chunks of every sequence (`shard`); a model whose forward takes `positions` gets
the data's document positions.
Under replica-group fault tolerance (distributed/replica_ft.py) R is the data-parallel ranks of the
replica groups in the step's quorum: N and the loss are also summed across those groups, and a step
whose cross-group collectives failed is not applied (verdict "replica_lost").
With `training.z_loss`, each token's loss also holds the z-loss term (trainer/loss.py); the
returned `loss` is the cross-entropy alone and `z_loss` that term, reduced the same way.
A mixture-of-experts model adds its auxiliary load-balancing loss to each token's loss with the same
scale, and its global expert loads are reduced (and its routing bias updated) after the step
(`trainer/moe_balance.py`); other terms a model adds in its forward (multi-token prediction) get
the same scale and are summed for logging (`trainer/extra_losses.py`).
A post-training objective (`trainer/objective.py`) may hand the step its own loss instead, a `SequenceLoss`
(`trainer/sequence_loss.py`) that reads the whole batch, not just the labels: a mean over its own units (pairs
of answers, say) or over the target tokens, in the same way; it may prepare each micro-batch before its forward
(score it with another model first).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import nn

from torchtrain.components.optim.lr_scheduler import LRSchedulersContainer
from torchtrain.components.optim.optimizer import OptimizersContainer
from torchtrain.distributed.compile import compile_loss
from torchtrain.distributed.compute_copy import ComputeCopy
from torchtrain.distributed.context_parallel import shard_batch
from torchtrain.distributed.layout import Layout
from torchtrain.distributed.pipeline_runtime import PipelineRunner
from torchtrain.distributed.tensor_parallel import maybe_loss_parallel
from torchtrain.distributed.tied_stages import TiedStages
from torchtrain.distributed.utils import all_reduce, clip_factor, clip_grad_norm_, reshard, set_gradient_sync
from torchtrain.models.converters.float8 import precompute_scales
from torchtrain.trainer.extra_losses import ExtraLosses
from torchtrain.trainer.loss import ScaledTokenLoss
from torchtrain.trainer.moe_balance import MoEBalancer
from torchtrain.trainer.precision import LossScaler
from torchtrain.trainer.sequence_loss import SequenceLoss
from torchtrain.utils.batch_keys import concat_batches
from torchtrain.utils.token_loss import count_valid_tokens, cross_entropy_sum, local_value

"""Inputs a vision-language model's forward takes besides the tokens (`models/common/multimodal.py`)."""


class StepHooks:
    """What the run around a step plugs into it (phase timing, fault injection, the guard).
    Every method is a no-op here; the trainer overrides what it uses."""

    def phase(self, name: str | None) -> None:
        """Entering a phase of the step ("forward_backward", "optimizer"), or None when it ends."""

    def loss_multiplier(self) -> float | None:
        """A factor applied to every micro-batch's loss before backward (fault injection), or None."""
        return None

    def reads_gradients(self) -> bool:
        """Whether `after_backward` reads the parameters' `.grad` this step (they are then put there even
        where the compute copy holds the step's gradients: `ComputeCopy.grads_to_masters`)."""
        return False

    def after_backward(self, model_parts: list[nn.Module]) -> None:
        """Gradients are complete and not yet unscaled or clipped."""

    def verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> str | None:
        """Decide on the step before the optimizer runs: None to step, else a reason to skip it."""
        return None

    def output_check(self) -> "OutputCheck | None":
        """This step's re-execution check of its first micro-batch's output, or None (not this step)."""
        return None


class OutputCheck(Protocol):
    """Re-execution (components/fault/replica_check.py): the first micro-batch's logits as computed (`first`,
    before its loss reads them) and as computed again after the step's backward (`again`)."""

    def first(self, logits: torch.Tensor) -> None: ...

    def again(self, logits: torch.Tensor) -> None: ...


@dataclass
class StepResult:
    """What one step did. Tensors stay on the device (reading them synchronises): `metrics` reads them
    for logging only."""

    loss: torch.Tensor
    """Global token-mean cross-entropy of the step (without the z-loss term)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate the optimizer step used."""
    tokens: torch.Tensor
    """Global number of target tokens of the step."""
    stepped: bool
    """Whether the optimizer stepped (False: skipped by the loss scaler or the verdict)."""
    verdict: str | None = None
    """Why the step was not applied ("rollback", "abort", "replica_lost", ...), None when it was."""
    z_loss: torch.Tensor | None = None
    """The z-loss term, reduced as `loss` (with `training.z_loss`)."""
    moe: torch.Tensor | None = None
    """Global expert loads and auxiliary loss per MoE layer (`MoEBalancer.end_step`)."""
    extra_losses: torch.Tensor | None = None
    """Sums and counts of the other losses the model adds in its forward (`ExtraLosses.end_step`)."""
    moe_record: Callable[[torch.Tensor], dict[str, float]] | None = field(default=None, repr=False)
    """Turns `moe` into named metrics (`MoEBalancer.record`)."""
    extra_record: Callable[[torch.Tensor], dict[str, float]] | None = field(default=None, repr=False)
    """Turns `extra_losses` into named metrics (`ExtraLosses.record`)."""
    sequence_stats: torch.Tensor | None = None
    """A sequence loss's summed statistics over all ranks (its `STATS`)."""
    sequence_record: Callable[[torch.Tensor], dict[str, float]] | None = field(default=None, repr=False)
    """Turns `sequence_stats` into named metrics (the loss's `record`)."""

    def metrics(self) -> dict[str, float]:
        """The step's own metrics for the log: loss, grad_norm, lr, then the MoE metrics, z_loss and
        the extra losses by name where the step has them (reads the tensors: synchronises)."""
        out = {"loss": self.loss.item(), "grad_norm": self.grad_norm.item(), "lr": self.lr}
        if self.moe is not None and self.moe_record is not None:
            out.update(self.moe_record(self.moe))
        if self.z_loss is not None:
            out["z_loss"] = self.z_loss.item()
        if self.extra_losses is not None and self.extra_record is not None:
            out.update(self.extra_record(self.extra_losses))
        if self.sequence_stats is not None and self.sequence_record is not None:
            out.update(self.sequence_record(self.sequence_stats))
        return out


PipelineFactory = Callable[[Layout, list[nn.Module], torch.device, Callable], PipelineRunner]


class TrainStep:
    """Build it with `trainer.step_factory.build_train_step`, which decides every option from the job;
    `pipeline` replaces torch's schedule runner (`PipelineRunner`, the default) with another that has
    its `stage_ids` and `step` (the fake-world simulation's stage step)."""

    def __init__(self, layout: Layout, model_parts: list[nn.Module], optimizers: OptimizersContainer,
                 lr_schedulers: LRSchedulersContainer, device: torch.device, max_norm: float,
                 moe: MoEBalancer | None = None, z_loss: float = 0.0, replicas=None,
                 extra_losses: ExtraLosses | None = None, pipeline: PipelineFactory | None = None,
                 sequence_loss: SequenceLoss | None = None):
        self.layout, self.model_parts, self.device, self.moe = layout, model_parts, device, moe
        self.extra_losses = extra_losses
        self.replicas = replicas  # distributed/replica_ft.py ReplicaGroups under fault.replica_ft
        self.optimizers, self.lr_schedulers, self.max_norm = optimizers, lr_schedulers, max_norm
        ce = compile_loss(cross_entropy_sum) if layout.compile_loss else cross_entropy_sum
        self.loss_fn = ScaledTokenLoss(ce, z_loss)
        # a post-training objective's loss, which reads the whole batch instead of the token mean of cross-entropy
        self.sequence_loss = sequence_loss
        self.scaler = LossScaler(layout.loss_scaling, sharded=layout.fsdp, device=device)
        self.compute_copy = None
        if layout.compute_copy:
            self.compute_copy = ComputeCopy(model_parts, layout.param_dtype, kept=layout.compiled_optimizer_step,
                                            keep_grads=layout.grads_in_compute_dtype)
            if layout.compiled_optimizer_step:  # the optimizer's step writes the copy: kept between steps
                optimizers.write_copies(self.compute_copy.by_master())
        pipeline_loss = self.loss_fn if sequence_loss is None else sequence_loss.from_target  # (one tensor target)
        self.pipeline = (pipeline or PipelineRunner)(layout, model_parts, device, pipeline_loss) \
            if layout.pipeline else None
        self.tied = None  # modules several pipeline stages hold (distributed/tied_stages.py)
        if self.pipeline is not None:
            tied = TiedStages(layout.pipeline, layout.dims, self.pipeline.stage_ids, model_parts)
            self.tied = tied if tied else None
        accepted = model_parts[0].forward_inputs  # (models/base.py::BaseModel: what a model declares)
        self.model_inputs = [k for k in accepted if k != "token_ids"]  # (token_ids: below)
        # what the model derives from whole sequences (a vision-language model's image positions; else nothing)
        self.batch_inputs = model_parts[0].batch_inputs
        # a model that reads the token ids on every pipeline stage (multi-token prediction on the last)
        self.token_ids = "token_ids" in accepted and self.pipeline is not None
        self._pipeline_losses = 0  # micro-batch losses of the last pipeline step on this rank

    @property
    def reexecutable(self) -> bool:
        """A forward that changes nothing but its output, so it can run again for the re-execution check: no
        pipeline schedule, no MoE balancer or module-added losses counting what the forward saw."""
        return self.pipeline is None and self.moe is None and self.extra_losses is None

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of a batch: what the model derives from whole sequences (`batch_inputs`), then under
        context parallelism its chunks of every sequence (and their `seq_index`)."""
        batch = self.batch_inputs(batch)
        if self.sequence_loss is not None:  # (what it reads of whole sequences, before CP cuts them)
            batch = self.sequence_loss.before_shard(batch, self.pipeline is not None)
        dims = self.layout.dims
        return shard_batch(batch, dims.cp, dims.cp_rank, self.layout.cp_balanced) if dims.cp_enabled else batch

    def model_kwargs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keyword inputs of the model besides the tokens that it takes: document positions, and the
        tokens' sequence indices under context parallelism."""
        kwargs = {k: batch[k].to(self.device, non_blocking=True) for k in self.model_inputs if k in batch}
        if self.token_ids:
            kwargs["token_ids"] = batch["input_ids"].to(self.device, non_blocking=True)
        return kwargs

    def low_precision_weights(self):
        """The compute copy's low-precision parameters for a stretch of forwards over unchanged weights (cast
        once, not at each forward's `context`); nothing to enter without a compute copy."""
        return self.compute_copy.active() if self.compute_copy is not None else contextlib.nullcontext()

    def context(self) -> contextlib.ExitStack:
        """Forward (+ backward) context: loss parallel under TP, autocast for replicated strategies, the
        low-precision parameters of the compute copy (one rank without FSDP)."""
        stack = contextlib.ExitStack()
        stack.enter_context(maybe_loss_parallel(self.layout.loss_parallel))
        if self.compute_copy is not None:
            stack.enter_context(self.compute_copy.active())
        dtype = self.layout.autocast_dtype
        if dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
        return stack

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Logits of a (`shard`ed) batch (call inside `context()`); under PP only on the rank of the
        last stage."""
        if self.pipeline is not None:
            return self.pipeline.forward(batch["input_ids"], self.model_kwargs(batch))
        return self.model_parts[0](batch["input_ids"].to(self.device, non_blocking=True), **self.model_kwargs(batch))

    def _forward_backward(self, batches: list[dict[str, torch.Tensor]], check: OutputCheck | None = None
                          ) -> torch.Tensor:
        """Backward over the step's (`shard`ed, on-device) micro-batches; returns this rank's summed scaled loss.
        `check`: the first micro-batch's forward runs again after the backward, its logits compared (not under PP)."""
        accumulated = torch.zeros((), device=self.device)
        if self.pipeline is not None:  # accumulation happens through the schedule's micro-batches
            merged = concat_batches(batches)
            self._pipeline_losses = 0

            def value(loss: torch.Tensor) -> torch.Tensor:  # counts the micro-batch losses the schedule returns
                self._pipeline_losses += 1
                return local_value(loss)

            target = merged["labels"]
            if self.sequence_loss is not None:  # (what the loss reads beside the labels, packed in one tensor)
                rows = max(1, merged["input_ids"].shape[0] // self.layout.pipeline.n_microbatches)  # one micro-batch
                target = self.sequence_loss.pipeline_target(self, merged, rows)
            with self.context():
                return accumulated + self.pipeline.step(merged["input_ids"], target, value, self.model_kwargs(merged))
        model = self.model_parts[0]
        with self.low_precision_weights():
            for i, batch in enumerate(batches):  # (one compute copy for all micro-batches)
                if len(batches) > 1:
                    set_gradient_sync(self.model_parts, i == len(batches) - 1)
                if self.sequence_loss is not None:
                    batch = self.sequence_loss.prepare(self, batch)
                with self.context():
                    logits = model(batch["input_ids"], **self.model_kwargs(batch))  # (`__call__` moved them)
                    if check is not None and i == 0:
                        check.first(logits)
                        first = batch
                    loss = self.loss_fn(logits, batch["labels"]) if self.sequence_loss is None else \
                        self.sequence_loss(logits, batch)
                    del logits
                    self.scaler.scale(loss).backward()
                accumulated += local_value(loss.detach()).float()
            if check is not None:  # the same forward on the same weights: its logits must be bitwise equal
                with self.context():  # (with grad, as the first ran: the same kernels and compiled graphs)
                    check.again(model(first["input_ids"], **self.model_kwargs(first)))
                reshard(self.model_parts)  # no backward follows to free what FSDP gathered for it
        return accumulated

    def __call__(self, batches: list[dict[str, torch.Tensor]], hooks: StepHooks | None = None) -> StepResult:
        """Forward/backward over the step's micro-batches, clip, optimizer and LR step (`StepResult`:
        the global mean loss over all ranks and micro-batches, the global grad norm, the lr used, the
        global number of target tokens, whether the optimizer stepped, the verdict, ...)."""
        hooks = hooks or StepHooks()
        dims = self.layout.dims
        hooks.phase("forward_backward")
        # on the device first (pinned by the loader, copied without waiting): the target count is then taken
        # there, so the step never waits for the previous one to finish before it queues its own work
        batches = [{k: v.to(self.device, non_blocking=True) for k, v in self.shard(b).items()} for b in batches]
        # what the step's loss is a mean over: its target tokens, or a sequence loss's own units (pairs, say),
        # counted in the same all-reduce
        counts = sum(count_valid_tokens(b["labels"]) for b in batches)
        own_units = self.sequence_loss is not None and self.sequence_loss.units != "tokens"
        if own_units:
            counts = torch.stack([counts, sum(self.sequence_loss.count(b) for b in batches)])
        counts = all_reduce(counts, dims.loss_mesh)
        degree = dims.loss_degree
        if self.replicas is not None:
            counts, degree = self.replicas.sum_(counts), degree * self.replicas.live
        global_tokens, units = (counts[0], counts[1]) if own_units else (counts, counts)
        loss_fn = self.loss_fn if self.sequence_loss is None else self.sequence_loss
        loss_fn.scale = degree / units.double()
        multiplier = hooks.loss_multiplier()
        if multiplier is not None:
            loss_fn.scale = loss_fn.scale * multiplier
        if self.moe is not None:
            self.moe.begin_step(loss_fn.scale * self.scaler.factor)
        if self.extra_losses is not None:
            self.extra_losses.begin_step(loss_fn.scale * self.scaler.factor)
        accumulated = self._forward_backward(batches, hooks.output_check())  # (never under PP: `reexecutable`)
        hooks.phase("optimizer")
        copy = self.compute_copy
        if copy is not None and copy.keep_grads and hooks.reads_gradients():
            copy.grads_to_masters()
        hooks.after_backward(self.model_parts)
        self.scaler.unscale_(self.optimizers)
        if self.tied is not None:
            self.tied.sync_()
        params = copy.grad_holders() if copy is not None else [p for part in self.model_parts for p in part.parameters()]
        in_step = self.layout.compiled_optimizer_step  # the compiled optimizer step applies the clip factor
        grad_norm = clip_grad_norm_(params, self.max_norm, dims.pp_mesh,
                                    self.tied.norm_excluded() if self.tied is not None else None, apply=not in_step)
        lr = self.optimizers.lr
        if self.loss_fn.z_weight:  # the z-loss is logged on its own: `loss` stays the cross-entropy
            z = self.loss_fn.pop_z(self.device, self._pipeline_losses if self.pipeline is not None else None)
            accumulated = torch.stack([accumulated - z, z])
        global_loss = all_reduce(accumulated / degree, dims.loss_mesh)
        sequence_stats = None
        if self.sequence_loss is not None:  # (under PP the last stage's, summed to every stage as the loss is)
            sequence_stats = all_reduce(self.sequence_loss.pop_stats(
                self.device, self._pipeline_losses if self.pipeline is not None else None), dims.loss_mesh)
            if dims.pp_enabled:
                sequence_stats = all_reduce(sequence_stats, dims.pp_mesh)
        if dims.pp_enabled:  # only last-stage ranks hold a loss; the sum reaches every stage
            global_loss = all_reduce(global_loss, dims.pp_mesh)
        if self.replicas is not None:
            global_loss = self.replicas.sum_(global_loss)
        z_loss = None
        if self.loss_fn.z_weight:
            global_loss, z_loss = global_loss[0], global_loss[1]
        if self.replicas is not None and not self.replicas.commit():  # a group was lost during the step
            verdict = "replica_lost"
        else:
            verdict = hooks.verdict(global_loss, grad_norm)  # agreed by all ranks, before the step
        if in_step and verdict is None:
            self.optimizers.scale_next_step(clip_factor(grad_norm, self.max_norm))
        stepped = self.scaler.step(self.optimizers) if verdict is None else self.scaler.skip(self.optimizers)
        if stepped and in_step:
            copy.written(self.optimizers.written())
        if stepped and self.layout.float8 is not None and self.layout.float8.precompute_scale:
            precompute_scales(self.model_parts)  # float8 all-gather: next forward's scales, one all-reduce
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        if copy is not None and copy.keep_grads:
            copy.release_grads()
        moe_stats = self.moe.end_step(stepped) if self.moe is not None else None
        extra = self.extra_losses.end_step() if self.extra_losses is not None else None
        hooks.phase(None)
        return StepResult(global_loss, grad_norm, lr, global_tokens, stepped, verdict, z_loss, moe_stats, extra,
                          self.moe.record if self.moe is not None else None,
                          self.extra_losses.record if self.extra_losses is not None else None, sequence_stats,
                          self.sequence_loss.record if self.sequence_loss is not None else None)
