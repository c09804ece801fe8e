"""A plan's inputs, one way: job + planner knobs -> job -> the trainer's resolved Layout -> PlanInputs.

1. `job_with_knobs`: the planner's knobs (command-line flags, or one search candidate) are written
   into the job config (`CONFIG_KEYS`: where each knob lives); the planner also pins what it plans for
   (the data-parallel shard degree for its world size, the pipeline schedule's canonical name);
2. `validate.resolve`: the trainer's own `resolve_layout` (with the model's checks) resolves that job
   into a Layout, once; a ConfigError there is the layout's problem (`PlanInputs.problems`);
3. `inputs_from_config` builds the PlanInputs from the job, its Layout's decisions, the device and the
   planner-only flags (`PLANNER_KEYS`: price, tokens, memory, ...), and keeps the job and the Layout on
   them: the trainer's start-up checks and the trace read those, never a job rebuilt from the inputs.

`display_overrides` is a job -> job diff: the `--section.key value` overrides that turn the user's job
into the planned one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torchtrain.components.hardware import GPUSpec
from torchtrain.config import ConfigError, JobConfig
from torchtrain.config.quantize import FLOAT8_GROUPED_MM, FLOAT8_LINEAR
from torchtrain.distributed.layout import Layout, resolve_batch, resolve_optimizer_impl, resolve_param_dtype
from torchtrain.distributed.parallel_dims import ParallelDims
from torchtrain.distributed.roles import generator_ranks, trainer_world
from torchtrain.planner import preference, vision
from torchtrain.planner.inputs import CONFIG_KEYS, DTYPE_NAMES, PLANNER_KEYS, SCHEDULES, PlanInputs
from torchtrain.planner.objectives import read_preference, read_rollouts
from torchtrain.planner.validate import resolve


def config_value(cfg: JobConfig, knob: str) -> Any:
    section, key = CONFIG_KEYS[knob]
    return getattr(getattr(cfg, section), key)


def job_with_knobs(cfg: JobConfig, knobs: dict[str, Any]) -> JobConfig:
    """The job with the knobs' keys set (`CONFIG_KEYS`; None = leave the job's value); in memory, no
    parsing; the job itself is untouched."""
    sections: dict[str, dict[str, Any]] = {}
    for knob, value in knobs.items():
        if value is not None:
            section, key = CONFIG_KEYS[knob]
            sections.setdefault(section, {})[key] = value
    changes = {name: dataclasses.replace(getattr(cfg, name), **keys) for name, keys in sections.items()}
    changes["model"] = dataclasses.replace(cfg.model, overrides=dict(cfg.model.overrides),
                                           override_sources=dict(cfg.model.override_sources))
    return dataclasses.replace(cfg, **changes)


def _norm_schedule(name: str) -> str:
    for s in SCHEDULES:
        if s.lower() == str(name).lower():
            return s
    raise ConfigError(f"pipeline schedule {name!r} is not modelled by the planner; "
                      f"choose one of {', '.join(SCHEDULES)}")


def _knobs(cfg: JobConfig, flags: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The job keys the planner's flags set: `CONFIG_KEYS` knobs, with `pp_stages_per_rank` (virtual
    stages per rank) written as the blocks per stage it means."""
    knobs = {k: v for k, v in flags.items() if k in CONFIG_KEYS and v is not None}
    if "ac_option" in knobs:
        knobs["ac_option"] = str(knobs["ac_option"])
    knobs["pp_schedule"] = _norm_schedule(knobs.get("pp_schedule", config_value(cfg, "pp_schedule")))
    v, pp = flags.get("pp_stages_per_rank"), knobs.get("pp", config_value(cfg, "pp"))
    if v and pp > 1:
        from torchtrain.planner.pipeline import default_stages_per_rank

        if v != default_stages_per_rank(knobs["pp_schedule"]):
            knobs["pp_layers_per_stage"] = n_layers // (pp * v)
    return knobs


def _fit_degrees(job: JobConfig, world_size: int, given: set[str]) -> tuple[JobConfig, list[str]]:
    """A job whose fixed degrees (replicate x tp x pp x cp) do not divide a world size the planner was
    asked about: each degree the planner's flags did not set shrinks to its largest divisor that fits
    what the others leave (tp first, then cp, pp, replicate), with a note -- the question is about the
    model on that many GPUs, not about the job's degrees (pass --tp ... to choose them)."""
    par, notes = job.parallelism, []
    names = {"tp": "tensor_parallel_degree", "cp": "context_parallel_degree", "pp": "pipeline_parallel_degree",
             "dp_replicate": "data_parallel_replicate_degree"}
    degrees = {k: getattr(par, v) for k, v in names.items()}
    if world_size % math.prod(degrees.values()) == 0:
        return job, notes
    knobs = {}
    for knob in names:
        if knob in given:
            continue
        others = math.prod(d for k, d in degrees.items() if k != knob)
        room = world_size // others if world_size % others == 0 else math.gcd(world_size, degrees[knob])
        fit = math.gcd(degrees[knob], room)
        if fit != degrees[knob]:
            notes.append(f"the job's {names[knob]} {degrees[knob]} does not fit {world_size} GPUs; planned with {fit}")
            degrees[knob] = knobs[knob] = fit
        if world_size % math.prod(degrees.values()) == 0:
            break
    return (job_with_knobs(job, knobs) if knobs else job), notes


def _fit_world(job: JobConfig, world_size: int, shard_given: bool) -> tuple[JobConfig, list[str]]:
    """The job with its data-parallel shard degree pinned for `world_size` (the trainer's rule,
    `ParallelDims.resolve_dp_shard`); a job degree that does not fit a world size the planner was asked
    about becomes the remaining ranks, with a note. ConfigError when no degree fits."""
    par, notes = job.parallelism, []
    rep, shard = par.data_parallel_replicate_degree, par.data_parallel_shard_degree
    tp, pp, cp = par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree
    if not shard_given and shard != -1 and rep * shard * tp * pp * cp != world_size:
        notes.append(f"the job's data_parallel_shard_degree {shard} does not fit this world size; "
                     f"using the remaining ranks (-1)")
        shard = -1
    shard = ParallelDims.resolve_dp_shard(world_size, rep, shard, tp, pp, cp)
    return job_with_knobs(job, {"dp_shard": shard}), notes


def inputs_from_config(cfg: JobConfig, args: Any, world_size: int, device_type: str, gpu: GPUSpec | None,
                       flags: dict[str, Any]) -> PlanInputs:
    """PlanInputs of the job `cfg` with the planner's `flags` (layout knobs, `pp_stages_per_rank`, and
    `PLANNER_KEYS`; None = unset) on `world_size` devices of `device_type` -- the job's ranks: with
    grpo.generator_ranks, the PlanInputs' world is the ranks that train (the planner's GRPO section plans the rest)."""
    knobs = _knobs(cfg, flags, args.n_layers)
    ranks, world_size = world_size, trainer_world(world_size, generator_ranks(cfg))  # (the ranks that train)
    job, fitted = _fit_degrees(job_with_knobs(cfg, knobs), world_size, set(knobs))
    job, notes = _fit_world(job, world_size, "dp_shard" in knobs)
    notes = fitted + notes
    layout, problems = resolve(job, ranks, device_type, args)
    par = job.parallelism
    split = (par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers,
             tuple(tuple(s) for s in par.module_fqns_per_model_part or ()), par.pipeline_parallel_schedule_csv,
             par.pipeline_parallel_layers_per_stage)
    split = () if split == (0, 0, (), None, None) else split
    decided = _from_layout(layout) if layout is not None else _as_asked(job, world_size, device_type, split,
                                                                         args.n_layers)
    memory = flags.get("memory_gib") or (gpu.memory_gib if gpu is not None else None)
    ckpt = job.checkpoint
    inputs = PlanInputs(
        model_name=job.model.name, args=args, world_size=world_size,
        flavor=flavor_label(job, args),
        reshard_after_forward=par.fsdp_reshard_after_forward, seq_len=job.training.seq_len,
        local_batch_size=job.training.local_batch_size, pp_schedule=par.pipeline_parallel_schedule,
        pp_microbatch_size=par.pipeline_parallel_microbatch_size, pp_split=split,
        optimizer=job.optimizer.name, device_type=device_type, gpu=gpu, memory_gib=memory, notes=notes,
        ep_backend=par.expert_parallel_comm_backend, ep_node=par.expert_parallel_ranks_per_node,
        ep_overlap_chunks=par.expert_parallel_overlap_chunks, ep_comm_delay_ms=job.debug.expert_comm_delay_ms,
        float8_experts=float8_experts(job),
        checkpoint_interval=ckpt.interval if ckpt.enable else None,
        sdc_check_freq=job.fault.sdc_check_freq, sdc_check_optimizer=job.fault.sdc_check_optimizer,
        image_pixels=(job.images.min_pixels, job.images.max_pixels), dpo=read_preference(job, decided["lora"]),
        grpo=read_rollouts(job, decided["lora"]), job=job, layout=layout, problems=problems, **decided)
    for knob in PLANNER_KEYS:
        if knob != "memory_gib" and flags.get(knob) is not None:
            setattr(inputs, knob, flags[knob])
    vision.check(inputs)
    inputs.notes += vision.notes(inputs) + preference.notes(inputs)
    return inputs


def flavor_label(job: JobConfig, args: Any) -> str:
    """How the report names the model after its name: the flavor (with overrides), or what arguments
    without presets describe themselves as (a transformers folder)."""
    if args.describe():
        return f"({args.describe()})"
    return job.model.flavor + (" (with overrides)" if job.model.overrides else "")


def float8_experts(job: JobConfig) -> bool:
    """Whether the job asks for float8 expert GEMMs: `model.converters` names quantize.grouped_mm.float8
    and its fqns name the experts (torchtitan's convention: no fqns means the experts)."""
    if not any(c in FLOAT8_GROUPED_MM for c in job.model.converters):
        return False
    fqns = job.quantize.grouped_mm.float8.fqns
    return not fqns or any("experts" in f for f in fqns)


def _from_layout(layout: Layout) -> dict[str, Any]:
    """The PlanInputs fields the trainer's Layout decides."""
    d, f8 = layout.dims, layout.float8
    return dict(dp_replicate=d.dp_replicate * layout.replica_groups, dp_shard=d.dp_shard, tp=d.tp, pp=d.pp,
                cp=d.cp, ep=d.ep, strategy=layout.strategy.value, global_batch_size=layout.batch.global_batch_size,
                pp_stages_per_rank=layout.pipeline.stages_per_rank if layout.pipeline is not None else 1,
                ac_mode=layout.ac_mode, ac_option=str(layout.ac_option), cpu_offload=layout.cpu_offload,
                offload_optimizer=layout.offload_optimizer, offload_params=layout.offload_params,
                param_dtype=DTYPE_NAMES[layout.param_dtype], reduce_dtype=DTYPE_NAMES[layout.reduce_dtype],
                optimizer_impl=layout.optimizer_impl, compile=layout.compile_model or layout.compile_loss,
                async_tp=layout.async_tp, float8=f8 is not None, float8_all_gather=f8 is not None and
                f8.fsdp_float8_all_gather, float8_head=f8 is not None and f8.convert_output_head, lora=layout.lora)


def _as_asked(job: JobConfig, world_size: int, device_type: str, split: tuple, n_layers: int) -> dict[str, Any]:
    """The same fields for a job the trainer refuses (no Layout): what the job asks for, with values left
    to the device resolved by the trainer's single-decision rules, so the report can still describe it."""
    par, tr = job.parallelism, job.training
    rep, shard, pp = par.data_parallel_replicate_degree, par.data_parallel_shard_degree, par.pipeline_parallel_degree
    from torchtrain.planner.pipeline import default_stages_per_rank

    v = default_stages_per_rank(par.pipeline_parallel_schedule)
    if split and split[4] and pp > 1:
        v = max(1, (n_layers + split[0] + split[1]) // (split[4] * pp))
    f8 = any(c in FLOAT8_LINEAR for c in job.model.converters)
    return dict(dp_replicate=rep, dp_shard=shard, tp=par.tensor_parallel_degree, pp=pp,
                cp=par.context_parallel_degree, ep=par.expert_parallel_degree, strategy=par.data_parallel_strategy,
                global_batch_size=resolve_batch(tr.local_batch_size, -1, rep * shard).global_batch_size
                if tr.global_batch_size == -1 else tr.global_batch_size, pp_stages_per_rank=v,
                ac_mode=job.activation_checkpoint.mode, ac_option=str(job.activation_checkpoint.selective_ac_option),
                cpu_offload=tr.enable_cpu_offload or job.offload.params != "none",
                offload_optimizer=job.offload.optimizer, offload_params=job.offload.params,
                param_dtype=DTYPE_NAMES[resolve_param_dtype(tr.mixed_precision_param, device_type)],
                reduce_dtype=tr.mixed_precision_reduce,
                optimizer_impl=resolve_optimizer_impl(job.optimizer.implementation,
                                                      "cpu" if tr.enable_cpu_offload else device_type),
                compile=job.compile.enable, async_tp=par.enable_async_tensor_parallel, float8=f8,
                float8_all_gather=f8 and job.quantize.linear.float8.enable_fsdp_float8_all_gather,
                float8_head=f8 and job.quantize.linear.float8.convert_output_head,
                lora=job.lora if job.lora.enable else None)


# ---------------------------------------------------------------------------------- job -> job
def display_overrides(cfg: JobConfig, p: PlanInputs) -> list[str]:
    """`--section.key value` overrides that turn the user's job `cfg` into the job `p` plans (`p.job`),
    for keys that matter to this layout (a global batch of -1 stays when it means the same batch)."""
    out = []
    for knob in CONFIG_KEYS:
        (section, key), current, value = CONFIG_KEYS[knob], config_value(cfg, knob), config_value(p.job, knob)
        if key == "global_batch_size" and current == -1 and value == p.local_batch_size * p.dp:
            continue
        if current != value and not _irrelevant(p, key):
            out += [f"--{section}.{key}", _cli_value(value)]
    return out


def _irrelevant(p: PlanInputs, key: str) -> bool:
    """Keys whose value does not matter for this layout (e.g. the schedule without pipelining)."""
    if key in ("pipeline_parallel_schedule", "pipeline_parallel_microbatch_size"):
        return p.pp == 1
    if key == "selective_ac_option":
        return p.ac_mode != "selective"
    return False


def _cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
