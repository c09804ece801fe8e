"""One plan: a job file + a world size + a device type -> memory per rank, throughput, cost, validity.

`load_job` reads the job exactly as the trainer does (`parse_args`, `preflight.resolve_model`);
`from_job.inputs_from_config` applies the planner's knobs to it and resolves its Layout (one way: the
PlanInputs keep that job and Layout); `make_plan` computes the analytic estimate of every pipeline
rank, traces one rank per distinct stage structure (see `trace.py`) on the planned job, estimates
throughput and cost, and records whether the layout is valid and whether the trainer would start it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchtrain.components.hardware import CPU, KNOWN_GPUS, GPUSpec, with_overrides
from torchtrain.config import ConfigError, JobConfig, parse_args
from torchtrain.planner import grpo, grpo_report, offload, preference, preference_report, reward_model, sdc, vision
from torchtrain.planner.analytic import MemoryEstimate, estimate_memory
from torchtrain.planner.from_job import display_overrides, inputs_from_config
from torchtrain.planner.host_time import HostTime, host_seconds
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.pipeline import pipeline_of, structure
from torchtrain.planner.step_time import StepTime, estimate_step
from torchtrain.planner.trace import TraceResult, trace_rank
from torchtrain.planner.validate import runnable_problems

if TYPE_CHECKING:
    from torchtrain.planner.offload import OffloadPlan


@dataclass
class RankPlan:
    pp_rank: int
    analytic: MemoryEstimate
    trace: TraceResult | None = None
    traced_peak: float | None = None
    traced_phase: str = ""
    traced_breakdown: dict[str, float] = field(default_factory=dict)
    traced_in_flight: float = 0.0

    @property
    def peak(self) -> float:
        """The figure fit decisions use: traced when available, else analytic."""
        return self.traced_peak if self.traced_peak is not None else self.analytic.peak


@dataclass
class Plan:
    inputs: PlanInputs
    ranks: list[RankPlan]
    throughput: StepTime
    problems: list[str]
    blockers: list[str]
    """Why this torchtrain build would not start the job ([] = it would)."""
    overrides: list[str]
    notes: list[str] = field(default_factory=list)
    offload: "OffloadPlan | None" = None
    """Tiers, node capacities and offload times (`offload.py`); None without offload."""
    base_throughput: StepTime | None = None
    """The step time without offload, for the slowdown (None without offload)."""
    preference: "preference_report.PreferenceCost | None" = None
    """A `[dpo]` job's reference: memory, FLOPs, time, the precomputed pass (`preference.py`)."""
    grpo: "grpo_report.GrpoCost | None" = None
    """A `[grpo]` job's iteration: sampling, the reference pass, the optimizer steps (`grpo.py`)."""
    sdc: "sdc.CheckCost | None" = None
    """The silent data corruption check's time a check and a step (`sdc.py`); None when the job does not check."""

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def fits(self) -> bool | None:
        usable = self.inputs.usable_bytes
        if usable is None or not self.ranks:
            return None
        return self.worst.peak <= usable and (self.offload is None or self.offload.fits) and \
            (self.grpo is None or self.grpo.sampling_fits is not False)

    @property
    def valid(self) -> bool:
        return not self.problems


class VocabOnly:
    """Stands in for a tokenizer whose files are not on this machine (only its size is checked; its special
    tokens, such as a vision-language model's image tokens, are taken to be there)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def token_id(self, text: str) -> int:
        return 0


@dataclass
class Job:
    argv: list[str]
    cfg: JobConfig
    args: Any
    tokenizer: Any
    notes: list[str] = field(default_factory=list)

    @property
    def has_tokenizer(self) -> bool:
        """Whether the job's tokenizer was loaded (else only its vocabulary size stands in: `VocabOnly`), so
        that its data can be read."""
        return not isinstance(self.tokenizer, VocabOnly)


def load_job(argv: list[str]) -> Job:
    """Parse the job (config file + `--section.key value` overrides) and build its model arguments."""
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.models.registry import build_model_args, get_model_spec
    from torchtrain.trainer.preflight import resolve_model

    cfg = parse_args(argv)
    notes = []
    try:
        tokenizer = build_tokenizer(cfg.model.hf_assets_path)
    except ConfigError as e:
        spec = get_model_spec(cfg.model.name)
        tokenizer = VocabOnly(build_model_args(spec, cfg.model.flavor, cfg.model.overrides,
                                                cfg.model.override_sources).vocab_size)
        notes.append(f"tokenizer not loaded ({e}); vocabulary size check skipped")
    _, args = resolve_model(cfg, tokenizer)
    return Job(argv, cfg, args, tokenizer, notes)


def resolve_gpu(name: str, overrides: list[str] | None = None) -> tuple[str, GPUSpec | None]:
    """(device type, spec) for --gpu: a key of KNOWN_GPUS, or "cpu" (no spec unless `overrides`, the
    `--device key=value` flags, give its measured rates), with the overrides applied."""
    key = name.lower().replace("-", "_")
    if key == "cpu":
        return "cpu", with_overrides(CPU, overrides) if overrides else None
    if key not in KNOWN_GPUS:
        raise ConfigError(f"unknown --gpu {name!r}; known: cpu, {', '.join(KNOWN_GPUS)}")
    return "cuda", with_overrides(KNOWN_GPUS[key], overrides or [])


def with_peak(p: PlanInputs, peak_tflops: float | None) -> PlanInputs:
    """`--peak-tflops` (or the job's metrics.peak_tflops): the device's peak for the compute dtype."""
    if peak_tflops is None:
        return p
    field_name = "fp32_tflops" if p.param_dtype == "float32" else "bf16_tflops"
    return p.replace(gpu=dataclasses.replace(p.gpu or CPU, **{field_name: peak_tflops}))


def make_plan(job: Job, inputs: PlanInputs, trace: bool = True, peak_tflops: float | None = None) -> Plan:
    """The plan of `inputs` (read from `job` by `from_job.inputs_from_config`)."""
    p = inputs
    if p.job is None:
        raise ValueError("make_plan needs PlanInputs read from a job (from_job.inputs_from_config), not a what-if copy")
    problems = list(p.problems)
    overrides = display_overrides(job.cfg, p)
    blockers = ["invalid layout"] if problems else runnable_problems(p, job.tokenizer)
    try:
        prof = pipeline_of(p)
    except ConfigError as e:  # the trainer's own pipeline checks (once: resolve_layout may have said it)
        if str(e) not in problems:
            problems.append(str(e))
    if problems:  # no per-rank memory for a layout that cannot exist
        return Plan(p, [], estimate_step(with_peak(p.replace(pp=1), peak_tflops)), problems, ["invalid layout"],
                    overrides, list(job.notes) + p.notes)
    ranks = [RankPlan(r, estimate_memory(p, r)) for r in range(p.pp)]
    if offload.active(p):  # the trace's fake tensors cannot be pinned nor streamed: analytic memory
        trace = False
        p.notes.append("offloaded layout: memory from the analytic model (the trace does not run offload)")
    if trace and not blockers:  # a job the trainer refuses has no real step to trace
        tcfg = trace_job(p)
        done: dict[tuple, TraceResult] = {}
        cache: dict = {}
        for rank in ranks:
            key = structure(prof, rank.pp_rank)
            if key not in done:
                done[key] = trace_rank(p, tcfg, rank.pp_rank, cache)
            result = rank.trace = done[key]
            if result.skipped is None:
                flight = prof.in_flight[rank.pp_rank]
                rank.traced_peak, rank.traced_phase, rank.traced_breakdown, rank.traced_in_flight = result.at(flight)
                _add_images(p, rank, prof, flight)
                preference.raise_traced_peak(p, rank)
                grpo.hold_copy(p, rank)
                reward_model.hold(p, rank)
    if trace and job.cfg.compile.enable:
        p.notes.append("traced in eager mode, with the compiled cross-entropy's memory (planner/compiled.py); "
                       "compiled blocks may keep fewer intermediates, so the traced peak is an upper bound")
    peak = peak_tflops if peak_tflops is not None else job.cfg.metrics.peak_tflops
    step = estimate_step(with_peak(p, peak), host_of(p, ranks))
    plan = Plan(p, ranks, step, problems, blockers, overrides, list(job.notes) + p.notes)
    if offload.active(p):
        plan.offload = offload.plan_offload(p, ranks[0].analytic, step)
        for rank in ranks:
            rank.analytic = offload.adjust_memory(rank.analytic, p)
        plan.base_throughput, plan.throughput = step, offload.with_offload_time(step, plan.offload)
    plan.preference = preference_report.summarize(p, ranks, plan.throughput, job)
    plan.grpo = grpo_report.summarize(p, ranks, plan.throughput, job)
    plan.notes += grpo_report.notes(p)
    plan.sdc = sdc.summarize(p, ranks, plan.throughput)
    return plan


def _add_images(p: PlanInputs, rank: RankPlan, prof, flight: int) -> None:
    """The traced step runs text-only batches: on a rank that runs the vision encoder, the activations its
    images store (analytic, `vision.py`) are added to the traced peak, per micro-batch in flight."""
    if vision.image_grid(p) is None or not any(vision.holds_encoder(p, s) for s in prof.stages[rank.pp_rank]):
        return
    images = flight * vision.activation_bytes(p)[0]
    rank.traced_peak += images
    rank.traced_breakdown = {**rank.traced_breakdown,
                             "activations": rank.traced_breakdown.get("activations", 0.0) + images}
    note = ("the traced step runs text-only batches: the vision encoder's activations for the images "
            "(analytic) are added to the traced peak")
    if note not in p.notes:
        p.notes.append(note)


def host_of(p: PlanInputs, ranks: list[RankPlan]) -> HostTime | None:
    """The host's dispatch time of a step (`host_time.py`): the slowest traced pipeline rank's, its
    forward/backward operators scaled to the job's micro-batches; None without a traced step."""
    microbatches = p.n_microbatches if p.pp > 1 else p.grad_accum_steps
    times = [host_seconds(r.trace.counts.scaled(microbatches), p.gpu, p.compile) for r in ranks
             if r.trace is not None and r.trace.counts is not None]
    times = [t for t in times if t is not None]
    return max(times, key=lambda t: t.seconds) if times else None


def trace_job(p: PlanInputs) -> JobConfig:
    """The job the trace runs: the planned job (`p.job`), in eager mode (the memory tracker is a
    dispatch mode, which torch.compile cannot trace through; eager memory is what the trainer's own
    `metrics.track_tensor_memory` measures too, and bounds the compiled step's)."""
    return dataclasses.replace(p.job, compile=dataclasses.replace(p.job.compile, enable=False))


def plan_from_flags(job: Job, world_size: int, gpu: str, flags: dict[str, Any], trace: bool = True,
                    peak_tflops: float | None = None, device: list[str] | None = None) -> Plan:
    device_type, spec = resolve_gpu(gpu, device)
    inputs = inputs_from_config(job.cfg, job.args, world_size, device_type, spec, flags)
    return make_plan(job, inputs, trace, peak_tflops)
