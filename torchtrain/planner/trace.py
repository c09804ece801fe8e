"""Traced memory: one real training step of the real model under the real parallel plan, on fake tensors.

For one representative rank (the first rank of a pipeline stage: it holds the largest FSDP shards),
in this one process and for any world size:

1. a fake process group (`torch.testing._internal.distributed.fake_pg`: collectives return at once
   and move no data) over an *equivalent world* of pp x min(dp_replicate, 2) x dp_shard x tp ranks.
   Per-rank shapes depend on dp_shard, tp and the stage only; replicas just all-reduce gradients in
   place, so two of them exercise the HSDP code path exactly as R would. The mesh is the trainer's
   own (`ParallelDims.build_mesh`);
2. as in the trainer, the model is built on the meta device, cut to the rank's pipeline stage
   (`stage_model.py` names the stage's modules, `simulation/parts.py` builds and cuts), parallelised by the generic applier from the job's resolved Layout
   (`distributed/parallelize.py::apply_parallelism`, the trainer's own call), and materialised --
   here under `FakeTensorMode`: tensors with shapes, dtypes and storage sizes but no data, so a 405B
   model costs no memory;
3. the optimizer is the trainer's (`OptimizersContainer.for_layout`, kernel resolved for the target
   device); the optimizer state a first step would create is created directly (a step on zero
   gradients), then one measured steady-state step runs under
   `TensorMemoryTracker` -- the tracker and definition the trainer uses for `memory_tensor_peak_gib`.
   The step *is* the trainer's (`trainer/step_factory.py`: micro-batch loop with no-sync
   accumulation, loss with the job's z-loss, MoE balancer and extra losses -- or a `[dpo]` job's preference
   loss with its reference, a frozen copy built like the model: `preference.py` --, backward, clipping,
   optimizer); with pipelining it drives the rank's stages with `simulation/stage_step.py` (forward,
   loss on the last stage, backward from a received gradient, FSDP no-sync / no-reshard on all but
   the last micro-batch as `torch.distributed.pipelining` does) over two micro-batches;
4. the optimizer's pre-step hook splits the step into a forward/backward phase and an optimizer phase.
   A pipeline rank keeps k micro-batches in flight (`pipeline.in_flight`): its peak is the measured
   forward/backward peak plus (k - 1) x the activation bytes one micro-batch leaves stored after its
   forward (measured too), or the optimizer phase's peak if larger.

Depth. Blocks are identical, so every term of either phase's peak is affine in the number of blocks
(parameters, gradients and optimizer state per block; activations per block; FSDP keeps a fixed number
of units gathered), once the peak has settled on its moment of the step (with full AC, for example,
the backward peak moves while the depth is below ~3 blocks). A rank with more than
`FULL_TRACE_MAX_BLOCKS` blocks is therefore traced with 3 and 4 blocks per stage (3N and 4N for
selective AC every N blocks) -- real shapes, real plan -- and the result extended linearly to its
real depth; this keeps 405B planning to seconds per stage. (Tested against full traces.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from torchtrain.components.observability.tensor_memory import TensorMemoryTracker, track_modules
from torchtrain.config import JobConfig
from torchtrain.distributed.activation_checkpoint import OP_LEVEL_OPTIONS
from torchtrain.models.common.experts import planned_capability
from torchtrain.planner import preference
from torchtrain.planner.compiled import (
    compiled_adamw_update,
    compiled_modules,
    compiles_loss,
    fused_cross_entropy_sum,
)
from torchtrain.planner.host_time import OpCounter, OpCounts
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.pipeline import Stage, pipeline_of
from torchtrain.planner.stage_model import has_ac, has_tp, part_cut
from torchtrain.simulation.fake_world import fake_backend_available, fake_world
from torchtrain.simulation.parts import PartCut, build_fake_parts, fake_batches
from torchtrain.simulation.stage_step import StagePipeline

FULL_TRACE_MAX_BLOCKS = 5


@dataclass
class TraceResult:
    """What one traced step measured on one pipeline rank (bytes).

    `backward` / `optimizer`: peak and breakdown of the forward+backward phase and of the optimizer
    phase; `per_microbatch`: activation bytes one micro-batch leaves stored after its forward (only
    measured with pipelining). `at(k)` turns them into the rank's peak with k micro-batches in flight.
    """

    pp_rank: int
    backward: float = 0.0
    backward_breakdown: dict[str, float] = field(default_factory=dict)
    optimizer: float = 0.0
    optimizer_breakdown: dict[str, float] = field(default_factory=dict)
    per_microbatch: float = 0.0
    seconds: float = 0.0
    counts: OpCounts | None = None
    """The operators the traced step dispatched (`host_time.py`), for the host time."""
    traced_blocks: tuple[int, ...] = ()
    """Blocks per traced model part; several entries when the result was extended linearly."""
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)

    def at(self, flight: int = 1) -> tuple[float, str, dict[str, float], float]:
        """(peak, phase, breakdown, in-flight bytes added) with `flight` micro-batches stored at once."""
        extra = max(0, flight - 1) * self.per_microbatch
        if self.backward + extra >= self.optimizer:
            parts = dict(self.backward_breakdown)
            parts["activations"] = parts.get("activations", 0.0) + extra
            return self.backward + extra, "forward/backward", parts, extra
        return self.optimizer, "optimizer step", dict(self.optimizer_breakdown), 0.0


# ----------------------------------------------------------------------------- entry point
def trace_rank(p: PlanInputs, cfg: JobConfig, pp_rank: int = 0, cache: dict | None = None,
               fake: bool = True) -> TraceResult:
    """Trace pipeline rank `pp_rank` (rank 0 of its data/tensor-parallel group); see the module doc.

    `cache` (shared by the ranks of one plan) reuses traces of identical model parts. `fake=False`
    runs the very same step on real tensors (tests use it to show fake tensors change nothing).
    """
    reason = fake_backend_available()
    if reason:
        return TraceResult(pp_rank, skipped=reason)
    t0 = time.perf_counter()
    cache = {} if cache is None else cache

    def traced(stages: list[Stage]) -> TraceResult:
        key = tuple((len(s.layers), s.first, s.last, s.extra) for s in stages)
        if key not in cache:
            cache[key] = _trace(p, cfg, pp_rank, stages, fake)
        return cache[key]

    stages = list(pipeline_of(p).stages[pp_rank])
    if sum(len(s.layers) for s in stages) <= FULL_TRACE_MAX_BLOCKS:
        result = dataclasses.replace(traced(stages), pp_rank=pp_rank)
    else:
        q = int(p.ac_option) if p.ac_mode == "selective" and p.ac_option not in OP_LEVEL_OPTIONS else 1
        small = [traced(_resized(stages, k * q)) for k in (3, 4)]
        result = _extend(small[0], small[1], len(stages) * q, sum(len(s.layers) for s in stages))
        result.pp_rank = pp_rank
    result.seconds = time.perf_counter() - t0
    return result


def _resized(stages: list[Stage], blocks: int) -> list[Stage]:
    """The same stages with `blocks` blocks each (indices 0.. in every part: only shapes matter)."""
    return [Stage(s.index, tuple(range(blocks)), s.first, s.last, s.extra) for s in stages]


def _extend(a: TraceResult, b: TraceResult, step_blocks: int, real_blocks: int) -> TraceResult:
    """Linear extension in the number of blocks from traces with fewer blocks (see the module doc)."""
    if a.skipped or b.skipped:
        return a if a.skipped else b
    base = sum(a.traced_blocks)
    scale = (real_blocks - base) / step_blocks

    def lin(x: float, y: float) -> float:
        return x + (y - x) * scale

    def lin_dict(x: dict[str, float], y: dict[str, float]) -> dict[str, float]:
        return {k: lin(x.get(k, 0.0), y.get(k, 0.0)) for k in x.keys() | y.keys()}

    out = TraceResult(a.pp_rank, lin(a.backward, b.backward), lin_dict(a.backward_breakdown, b.backward_breakdown),
                      lin(a.optimizer, b.optimizer), lin_dict(a.optimizer_breakdown, b.optimizer_breakdown),
                      lin(a.per_microbatch, b.per_microbatch), traced_blocks=a.traced_blocks + b.traced_blocks,
                      notes=list(dict.fromkeys(a.notes + b.notes)),
                      counts=a.counts.lin(b.counts, scale) if a.counts is not None and b.counts is not None else None)
    out.notes.append(f"traced with {sum(a.traced_blocks)} and {sum(b.traced_blocks)} blocks, extended linearly "
                     f"to {real_blocks} (identical blocks)")
    return out


# ----------------------------------------------------------------------------- one trace
def _trace(p: PlanInputs, cfg: JobConfig, pp_rank: int, stages: list[Stage], fake: bool = True) -> TraceResult:
    from torch._subclasses.fake_tensor import FakeTensorMode

    result = TraceResult(pp_rank, traced_blocks=tuple(len(s.layers) for s in stages))
    rep = min(p.dp_replicate, 2)
    world = p.pp * rep * p.dp_shard * p.cp * p.tp
    if dist.is_initialized():
        raise RuntimeError("the planner's trace needs a process without a process group")
    layout = _trace_layout(p, cfg, rep, world)
    with fake_world(world, rank=pp_rank * (world // p.pp)):
        layout.dims.build_mesh("cpu")
        from torchtrain.models.registry import get_model_spec

        cuts = [part_cut(stage, p.args.n_layers) for stage in stages]
        parts = build_fake_parts(get_model_spec(p.model_name), p.args, layout, cuts, p.device_type)
        copy = preference.copy_parts(p, lambda: build_fake_parts(get_model_spec(p.model_name), p.args, layout, cuts,
                                                                 p.device_type, frozen=True))  # [dpo]: the frozen copy
        # Meta-device model, parallelised, then materialised as fake tensors: the trainer's own order,
        # and sharding meta tensors is cheap where chunking fake ones 1000s of ways is not.
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
        with mode:
            for part in parts + copy:
                part.to_empty(device="cpu")
        try:
            _run(p, cfg, layout, cuts, parts, result, mode, copy)
        except Exception as e:  # the DPO step (the trainer's own) fails on this layout: say so, do not guess
            if p.dpo is None:
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            result.skipped = f"the DPO step fails in the trace on this layout ({type(e).__name__}: {first})"
    return result


def _trace_layout(p: PlanInputs, cfg: JobConfig, rep: int, world: int):
    """The job's resolved Layout for its target device, on the trace's equivalent world."""
    from torchtrain.distributed.layout import resolve_layout
    from torchtrain.distributed.parallel_dims import ParallelDims
    from torchtrain.models.registry import get_model_spec

    layout = resolve_layout(cfg, p.world_size, p.device_type, p.args, get_model_spec(p.model_name))
    dims = ParallelDims(dp_replicate=rep, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, world_size=world,
                        loss_parallel_requested=layout.dims.loss_parallel_requested, cp=p.cp, ep=p.ep)
    allow = p.layout.allow_compute_copy if p.layout is not None else layout.allow_compute_copy
    # the planned Layout's choices (the traced job runs eagerly: its optimizer step as compiled, compiled.py)
    return dataclasses.replace(layout, dims=dims, allow_compute_copy=allow, compile_optimizer=p.compile_optimizer)


def _run(p: PlanInputs, cfg: JobConfig, layout, cuts: list[PartCut], parts: list[nn.Module],
         result: TraceResult, mode, copy: list[nn.Module] = ()) -> None:
    """The measured step; tensors are made under `mode` (fake tensors), except the step's own set-up
    (`build_train_step` reads the mesh's rank table, which must stay real). `copy`: a DPO reference copy's
    parts, counted as parameters (`preference.py`)."""
    from torchtrain.components.optim.lr_scheduler import LRSchedulersContainer
    from torchtrain.components.optim.optimizer import OptimizersContainer
    from torchtrain.trainer.step_factory import build_train_step

    if p.tp > 1 and not any(has_tp(m) for m in parts):
        result.skipped = ("the model's tensor-parallel plan sharded no parameter over the tp mesh dimension")
        return
    if p.ac_mode != "none" and not any(has_ac(m) for m in parts):
        result.notes.append(f"AC mode {p.ac_mode!r} requested but the parallel plan applied none")
    for m in parts:
        m.train()
    with mode:
        optimizers = OptimizersContainer.for_layout(parts, cfg.optimizer, layout)  # as Trainer.__init__ builds it
        schedulers = LRSchedulersContainer(optimizers, cfg.lr_scheduler, cfg.training.steps)
    tracker = TensorMemoryTracker()
    track_modules(tracker, list(parts) + list(copy), optimizers)
    fused = p.gpu.fused_rms_norm if p.gpu is not None else p.device_type == "cuda"  # the device decides
    counter = OpCounter(compiled_modules(p, parts) if p.compile else None, cuda=fused)
    stored: list[float] = []
    # The trainer's own step (z-loss, MoE balancer, extra losses as the job sets them); a pipeline rank
    # runs up to two micro-batches through its stages (simulation/stage_step.py).
    pipeline = functools.partial(StagePipeline, cuts=cuts, seq_len=p.seq_len, dim=p.args.dim, tracker=tracker,
                                 stored=stored, tensor_mode=mode)
    step = build_train_step(layout, cfg.training, p.args, parts, optimizers, schedulers, torch.device("cpu"),
                            pipeline=pipeline, **preference.step_options(cfg, p, list(copy), layout))
    step.scaler.reads_back = False  # float16 loss scaling: no scale nor found-inf flag read back (fake values)
    if compiles_loss(p):  # the compiled cross-entropy's memory, counted as a compiled graph (compiled.py)
        step.loss_fn.ce_sum = counter.compiled(fused_cross_entropy_sum)
    for opt in optimizers.compiled:  # the compiled optimizer update: the same, one graph per parameter
        opt.kernel = counter.compiled(compiled_adamw_update, backward=False)
    phases: dict[str, tuple[int, dict[str, int]]] = {}

    def end_of_backward(*_):
        counter.phase = "optimizer"
        if "backward" not in phases:
            phases["backward"] = (tracker.peak, tracker.peak_breakdown())
            tracker.reset_peak()

    with mode:
        if p.pp == 1:  # up to two accumulation micro-batches
            batches = [preference.with_pairs(p, b) for b in
                       fake_batches(layout, p.seq_len, p.args.vocab_size, count=min(p.grad_accum_steps, 2))]
        else:
            batches = [preference.with_pairs(p, b) for b in
                       fake_batches(layout, p.seq_len, p.args.vocab_size, count=1,
                                    sequences=step.pipeline.n_micro * step.pipeline.microbatch_size)]
        _create_optimizer_state(parts, optimizers)
        hook = optimizers.optimizers[0].register_step_pre_hook(end_of_backward)
        # experts take the path the target GPU takes (grouped GEMMs from 9.0), not the fake tensors' CPU loop
        with tracker, counter, counter.functions(), planned_capability(p.gpu.compute_capability if p.gpu else None):
            step(batches)
    phases["optimizer"] = (tracker.peak, tracker.peak_breakdown())
    hook.remove()
    tracker.remove_hooks()
    counter.remove_hooks()
    counter.counts.microbatches = len(batches) if p.pp == 1 else step.pipeline.n_micro
    result.counts = counter.counts
    if stored:
        result.per_microbatch = sum(stored) / len(stored)
    (bwd, bwd_parts), (opt, opt_parts) = phases["backward"], phases["optimizer"]
    result.backward, result.backward_breakdown = float(bwd), {k: float(v) for k, v in bwd_parts.items()}
    result.optimizer, result.optimizer_breakdown = float(opt), {k: float(v) for k, v in opt_parts.items()}


def _create_optimizer_state(parts: list[nn.Module], optimizers) -> None:
    """What a first training step leaves behind: optimizer state (Adam m, v, step), gradients freed.

    Stepping once on zero gradients creates exactly that state at a fraction of a real step's cost;
    the measured step that follows is then a steady-state step. Frozen parameters (LoRA's base
    weights) get no gradient, as in training.
    """
    for part in parts:
        for q in part.parameters():
            if q.requires_grad:
                q.grad = torch.zeros_like(q)
    optimizers.step()
    optimizers.zero_grad()
