"""Pipeline parallelism: cut the model into stages, place them on ranks, run a schedule.

With p pipeline ranks the transformer blocks are split into S = p x v stages (v virtual stages per
rank for interleaved schedules); the embedding goes with the first stage and the final norm + output
with the last. A step's local batch (micro-batches x accumulation) is cut into m micro-batches that
flow through the stages; a schedule orders the forwards and backwards. With GPipe/1F1B the idle
share of each rank, the bubble, is (p - 1) / (m + p - 1); interleaving (v > 1) divides the bubble by
about v, zero-bubble schedules fill it with weight-gradient work. 1F1B keeps at most p micro-batches'
activations alive on the first rank, GPipe all m.

Placement: "loop" puts stage s on rank s mod p; "V" (ZBVZeroBubble, DualPipeV) gives rank r stages r
and 2p - 1 - r, so the first and last stages share a rank.

Everything that can be checked without a process group is checked in `split_pipeline`, so an invalid
combination fails before start-up with a message naming the key.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass

import torch

from torchtrain.config.fields import ConfigError, did_you_mean
from torchtrain.config.parallelism import Parallelism
from torchtrain.distributed.pipeline_timeline import Timeline, simulate

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def schedule_names() -> list[str]:
    """Schedules the installed torch offers (DualPipeV only in recent versions)."""
    from torch.distributed.pipelining import schedules

    names = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
    return [n for n in names if hasattr(schedules, "Schedule" + n)]


def _schedule_class(name: str):
    from torch.distributed.pipelining.schedules import get_schedule_class

    if name.lower() not in {n.lower() for n in schedule_names()}:
        raise ConfigError(
            f"[parallelism.pipeline_parallel_schedule] unknown schedule {name!r} for torch "
            f"{torch.__version__}{did_you_mean(name, schedule_names())} Available: {', '.join(schedule_names())}"
        )
    return get_schedule_class(name)


@dataclass(frozen=True)
class PipelineSplit:
    schedule_name: str
    multi_stage: bool
    num_stages: int
    stages_per_rank: int
    v_placement: bool
    modules_per_stage: list[list[str]]
    n_microbatches: int
    csv_path: str | None

    def stage_ids(self, pp_rank: int, pp: int) -> list[int]:
        if self.v_placement:
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + i * pp for i in range(self.stages_per_rank)]


def _csv_num_stages(path: str) -> int:
    from torch.distributed.pipelining.schedules import _Action

    if not os.path.isfile(path):
        raise ConfigError(f"[parallelism.pipeline_parallel_schedule_csv] file not found: {path!r}")
    stages = set()
    with open(path, newline="") as f:
        for row in csv.reader(f):
            for cell in row:
                action = _Action.from_str(cell) if cell.strip() else None
                if action is not None:
                    stages.add(action.stage_index)
    if not stages:
        raise ConfigError(f"[parallelism.pipeline_parallel_schedule_csv] {path} holds no actions")
    return max(stages) + 1


def split_pipeline(par: Parallelism, p: int, model_args, stage_modules_fn, local_sequences: int,
                  model_name: str = "") -> PipelineSplit:
    """Resolve and validate the stage split, placement and micro-batching of `par` over `p` pipeline
    ranks (no process group needed).

    `stage_modules_fn(model_args, num_stages, first_less, last_less)` is the model's split: module
    names (e.g. "tok_embeddings", "layers.3", "output") per stage, or a ConfigError.
    `local_sequences`: sequences one pipeline (one dp rank) processes per step.
    """
    if stage_modules_fn is None:
        raise ConfigError(f"[parallelism.pipeline_parallel_degree] model {model_name!r} does not define a "
                          f"pipeline split; set pipeline_parallel_degree = 1")
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    csv_path = par.pipeline_parallel_schedule_csv
    cls = _schedule_class(par.pipeline_parallel_schedule)
    name = cls.__name__.removeprefix("Schedule")
    multi = csv_path is not None or not issubclass(cls, PipelineScheduleSingle)
    v_placement = name in V_SCHEDULES and csv_path is None

    if par.module_fqns_per_model_part:
        modules = [list(stage) for stage in par.module_fqns_per_model_part]
        num_stages = len(modules)
        _check_explicit_split(modules, stage_modules_fn(model_args, 1, 0, 0)[0])
    else:
        if csv_path is not None:
            num_stages = _csv_num_stages(csv_path)
        elif par.pipeline_parallel_layers_per_stage is not None:
            units = model_args.n_layers + par.pipeline_parallel_first_stage_less_layers + \
                par.pipeline_parallel_last_stage_less_layers
            if units % par.pipeline_parallel_layers_per_stage:
                raise ConfigError(
                    f"[parallelism.pipeline_parallel_layers_per_stage] {par.pipeline_parallel_layers_per_stage} does "
                    f"not divide model.n_layers ({model_args.n_layers}) + first/last-stage-less-layers = {units}"
                )
            num_stages = units // par.pipeline_parallel_layers_per_stage
        else:
            num_stages = p * (2 if multi else 1)
        modules = stage_modules_fn(model_args, num_stages, par.pipeline_parallel_first_stage_less_layers,
                                   par.pipeline_parallel_last_stage_less_layers)

    if num_stages % p:
        raise ConfigError(f"[parallelism] {num_stages} pipeline stages cannot be spread evenly over "
                          f"pipeline_parallel_degree {p}; use a multiple of {p} stages")
    per_rank = num_stages // p
    if not multi and per_rank != 1:
        raise ConfigError(
            f"[parallelism.pipeline_parallel_schedule] {name} runs one stage per rank but the split has "
            f"{per_rank} per rank ({num_stages} stages); use an interleaved schedule (Interleaved1F1B, "
            f"LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble) or {p} stages"
        )
    if v_placement and per_rank != 2:
        raise ConfigError(f"[parallelism.pipeline_parallel_schedule] {name} needs exactly 2 stages per rank "
                          f"({2 * p} stages), got {num_stages}")

    mb = par.pipeline_parallel_microbatch_size
    if local_sequences % mb:
        raise ConfigError(
            f"[parallelism.pipeline_parallel_microbatch_size] {mb} does not divide the {local_sequences} "
            f"sequences each pipeline processes per step (training.local_batch_size x accumulation)"
        )
    n_mb = local_sequences // mb
    need = num_stages if name == "DualPipeV" else (1 if name == "GPipe" else p)
    if n_mb < need:
        raise ConfigError(
            f"[parallelism.pipeline_parallel_microbatch_size] {name} needs at least {need} micro-batches per "
            f"step but gets {n_mb} ({local_sequences} sequences / micro-batch size {mb}); lower the micro-batch "
            f"size or raise training.local_batch_size / global_batch_size"
        )
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_mb // p)
        if n_mb % rounds:
            raise ConfigError(
                f"[parallelism.pipeline_parallel_microbatch_size] {name} needs the micro-batch count ({n_mb}) to "
                f"be a multiple of {rounds} (micro-batches // pipeline_parallel_degree); e.g. use {rounds * p}"
            )
    return PipelineSplit(name, multi, num_stages, per_rank, v_placement, modules, n_mb, csv_path)


def _check_explicit_split(modules: list[list[str]], all_names: list[str]) -> None:
    """Every module exactly once, in model order (stages run first to last)."""
    flat = [name for stage in modules for name in stage]
    unknown = sorted(set(flat) - set(all_names))
    if unknown:
        raise ConfigError(f"[parallelism.module_fqns_per_model_part] unknown module names {unknown}; "
                          f"the model's modules are {', '.join(all_names)}")
    if flat != all_names or any(not stage for stage in modules):
        raise ConfigError("[parallelism.module_fqns_per_model_part] must list every module exactly once, in model "
                          f"order, with no empty stage: {', '.join(all_names)}")


def build_schedule(split: PipelineSplit, stages: list, loss_fn):
    """The schedule object over this rank's stages; construction errors become config errors."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime, get_schedule_class

    try:
        if split.csv_path is not None:
            schedule = _PipelineScheduleRuntime(stages, split.n_microbatches, loss_fn=loss_fn, scale_grads=False)
            schedule._load_csv(split.csv_path)
        else:  # multi-stage schedules take the list, single-stage ones the stage
            cls = get_schedule_class(split.schedule_name)
            schedule = cls(stages if split.multi_stage else stages[0], split.n_microbatches, loss_fn=loss_fn,
                           scale_grads=False)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ConfigError(f"[parallelism.pipeline_parallel_schedule] {split.schedule_name}: {e}") from None
    return schedule


def schedule_timeline(schedule, split: PipelineSplit) -> Timeline:
    if split.multi_stage:
        return simulate(schedule.pipeline_order, split.num_stages, True)
    # Single-stage schedules (GPipe, 1F1B) run forwards and backwards in micro-batch order on every
    # rank; their action lists are renumbered accordingly (torch's list for the last 1F1B rank
    # starts its forwards at micro-batch 1, which would not replay).
    order = {}
    for rank, actions in schedule._get_pipeline_order().items():
        seen: dict[str, int] = {}
        renumbered = []
        for a in actions:
            if a is not None and a.computation_type.value in ("F", "B"):
                kind = a.computation_type.value
                a = a._replace(microbatch_index=seen.get(kind, 0))
                seen[kind] = a.microbatch_index + 1
            renumbered.append(a)
        order[rank] = renumbered
    return simulate(order, split.num_stages, False)
