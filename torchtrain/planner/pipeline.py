"""Pipeline facts of a layout, taken from the trainer's own pipeline machinery.

* The split and placement are the trainer's (`distributed.pipeline.split_pipeline` with the model's
  `stage_modules`): which blocks each stage owns, which stages a rank runs (loop or V placement).
* The schedule is torch's own schedule object, built here on meta-device stages over a fake
  process group of the pipeline ranks (no data, no communication), and its action lists are replayed
  (`distributed.pipeline_timeline`): that gives the bubble fraction the trainer prints at start-up,
  and per rank the peak number of (stage, micro-batch) forwards whose activations are held at once.
  GPipe holds all m micro-batches on every rank; 1F1B at most p - r on rank r.

Results are cached per (model, schedule, degrees, micro-batches): a search asks for few distinct ones.
A layout the trainer would refuse raises the trainer's ConfigError (also cached).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchtrain.config import ConfigError
from torchtrain.config.parallelism import Parallelism

ENCODER = "vision_encoder"
"""A vision-language model's encoder: a top-level module of the first stage (`Stage.holds`)."""


@dataclass(frozen=True)
class Stage:
    index: int
    """Stage index in 0..pp x v - 1 (forward order)."""
    layers: tuple[int, ...]
    """Global indices of the blocks this stage owns."""
    first: bool
    """It embeds the inputs (stage 0)."""
    last: bool
    """It holds the final norm and output head."""
    extra: tuple[str, ...] | None = None
    """Other top-level modules it holds (DeepSeek-V3's `mtp`, and the embedding copy the last stage
    keeps for it); None: all of them (the whole model, no pipeline)."""

    def holds(self, module: str) -> bool:
        """Whether this stage holds the top-level `module` besides its blocks and ends (e.g. the vision
        encoder, which sits with the embedding: `models/common/parallel.py::decoder_stage_modules`)."""
        return self.extra is None or module in self.extra


@dataclass(frozen=True)
class PipelineProfile:
    stages: dict[int, tuple[Stage, ...]]
    """pipeline rank -> the stages it runs."""
    in_flight: dict[int, int]
    """pipeline rank -> peak stage-micro-batch forwards held at once."""
    bubble: float
    timeline: str
    schedule: str
    n_microbatches: int
    stages_per_rank: int
    overlapped: dict[int, float] = field(default_factory=dict)
    """pipeline rank -> share of its forwards that run paired with another micro-batch's backward in
    one OVERLAP_F_B action (DualPipeV): one's communication under the other's computation."""


def default_stages_per_rank(schedule: str) -> int:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from torchtrain.distributed.pipeline import _schedule_class

    return 1 if issubclass(_schedule_class(schedule), PipelineScheduleSingle) else 2


def _stage(index: int, names: list[str]) -> Stage:
    layers = tuple(int(n.split(".", 1)[1]) for n in names if n.startswith("layers."))
    ends = ("norm", "output") + (("tok_embeddings",) if index == 0 else ())
    extra = tuple(n for n in names if not n.startswith("layers.") and n not in ends)
    return Stage(index, layers, index == 0, "output" in names or "norm" in names, extra)


def profile(model_name: str, args, pp: int, schedule: str, microbatch_size: int, local_sequences: int,
            stages_per_rank: int, split: tuple = ()) -> PipelineProfile:
    """The layout's pipeline (cached); raises ConfigError exactly when the trainer would refuse it."""
    key = (model_name, repr(args), pp, schedule, microbatch_size, local_sequences, stages_per_rank, split)
    return _profile(key, args)


_CACHE: dict[tuple, PipelineProfile | ConfigError] = {}


def _profile(key: tuple, args) -> PipelineProfile:
    if key not in _CACHE:
        try:
            _CACHE[key] = _build_profile(*key[:1], args, *key[2:])
        except ConfigError as e:
            _CACHE[key] = e
    value = _CACHE[key]
    if isinstance(value, ConfigError):
        raise value
    return value


def _build_profile(model_name: str, args, pp: int, schedule: str, microbatch_size: int, local_sequences: int,
                   stages_per_rank: int, split: tuple) -> PipelineProfile:
    from torchtrain.distributed.pipeline import split_pipeline
    from torchtrain.models.registry import get_model_spec

    spec = get_model_spec(model_name)
    par = Parallelism()
    par.pipeline_parallel_degree, par.pipeline_parallel_schedule = pp, schedule
    par.pipeline_parallel_microbatch_size = microbatch_size
    if split:  # the job's own split keys, read as the trainer reads them
        (par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers,
         fqns, par.pipeline_parallel_schedule_csv, par.pipeline_parallel_layers_per_stage) = split
        par.module_fqns_per_model_part = [list(s) for s in fqns] or None
    if stages_per_rank != default_stages_per_rank(schedule) and not split:
        layers = args.n_layers // (pp * stages_per_rank)
        if layers * pp * stages_per_rank != args.n_layers:
            raise ConfigError(f"[model.n_layers] {args.n_layers} blocks cannot be split into {pp * stages_per_rank} "
                              f"equal stages")
        par.pipeline_parallel_layers_per_stage = layers
    pipe = split_pipeline(par, pp, args, spec.stage_modules, local_sequences, model_name)
    stages = {r: tuple(_stage(s, pipe.modules_per_stage[s]) for s in pipe.stage_ids(r, pp)) for r in range(pp)}
    key = (model_name, repr(args), pp, pipe.schedule_name, pipe.multi_stage, pipe.num_stages, pipe.stages_per_rank,
           pipe.v_placement, pipe.n_microbatches, pipe.csv_path)
    if key not in _SCHEDULES:
        _SCHEDULES[key] = _schedule_facts(model_name, args, pp, pipe)
    in_flight, bubble, timeline, overlapped = _SCHEDULES[key]
    return PipelineProfile(stages, in_flight, bubble, timeline, pipe.schedule_name, pipe.n_microbatches,
                           pipe.stages_per_rank, overlapped)


_SCHEDULES: dict[tuple, tuple] = {}
"""The schedule's facts per (model, degree, schedule, stages, micro-batches): layouts that differ only
in micro-batch size or local batch but run as many micro-batches share them."""


def _schedule_facts(model_name: str, args, pp: int, pipe) -> tuple:
    """(in-flight per rank, bubble, rendered timeline, overlapped share per rank) of torch's schedule
    object for the split `pipe`, built on meta-device stages over a fake process group."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtrain.distributed.parallel_dims import ParallelDims
    from torchtrain.distributed.pipeline import build_schedule, schedule_timeline
    from torchtrain.distributed.pipeline_timeline import peak_in_flight
    from torchtrain.models.common.parallel import keep_modules

    pd = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=pp, world_size=pp)
    if dist.is_initialized():
        raise RuntimeError("pipeline profiles are built outside the planner's traces")
    dist.init_process_group("fake", rank=0, world_size=pp, store=FakeStore())
    try:
        pd.build_mesh("cpu")
        whole = _meta_model(model_name, args)
        objs = [PipelineStage(keep_modules(whole, pipe.modules_per_stage[s], share=True), s, pipe.num_stages,
                              torch.device("cpu"), group=pd.pp_mesh.get_group()) for s in pipe.stage_ids(0, pp)]
        sched = build_schedule(pipe, objs, lambda out, target: out.sum())
        order = sched.pipeline_order if pipe.multi_stage else sched._get_pipeline_order()
        timeline = schedule_timeline(sched, pipe)
    finally:
        dist.destroy_process_group()
    return peak_in_flight(order), timeline.bubble_fraction, timeline.render(), overlapped_share(order)


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def _meta_model(model_name: str, args) -> torch.nn.Module:
    """The whole model on the meta device, built once per (model, arguments): the schedule objects only
    read the structure of their stages' cuts."""
    from torchtrain.models.registry import get_model_spec

    key = (model_name, repr(args))
    if key not in _MODELS:
        with torch.device("meta"):
            _MODELS[key] = get_model_spec(model_name).build(args)
    return _MODELS[key]


def overlapped_share(order: dict[int, list]) -> dict[int, float]:
    """Per rank, the share of its forward actions inside an OVERLAP_F_B action (module doc of
    `PipelineProfile.overlapped`), read from the schedule's own action lists."""
    out = {}
    for rank, actions in order.items():
        forwards = paired = 0
        for a in (x for x in actions if x is not None):
            kind = a.computation_type.value
            if kind == "OVERLAP_F_B":
                paired += sum(sub.computation_type.value == "F" for sub in a.sub_actions)
                forwards += sum(sub.computation_type.value == "F" for sub in a.sub_actions)
            elif kind == "F":
                forwards += 1
        out[rank] = paired / forwards if forwards else 0.0
    return out


def no_pipeline(n_layers: int) -> PipelineProfile:
    whole = (Stage(0, tuple(range(n_layers)), True, True),)
    return PipelineProfile({0: whole}, {0: 1}, 0.0, "", "", 1, 1)


def pipeline_of(p) -> PipelineProfile:
    """The profile of a PlanInputs' layout (ConfigError when the trainer would refuse it)."""
    if p.pp == 1:
        return no_pipeline(p.args.n_layers)
    return profile(p.model_name, p.args, p.pp, p.pp_schedule, p.pp_microbatch_size,
                   p.local_batch_size * p.grad_accum_steps, p.pp_stages_per_rank, p.pp_split)


def structure(prof: PipelineProfile, rank: int) -> tuple:
    """What a rank's model part looks like: ranks with equal structure hold the same modules and
    differ only in how many micro-batches they keep in flight (one trace serves them all)."""
    return tuple((len(s.layers), s.first, s.last, s.extra) for s in prof.stages[rank])
