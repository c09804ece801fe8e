"""`--search`: every layout of a job for a GPU count and type, the ones that fit, fastest first.

Enumerated (the global batch and sequence length of the job stay fixed, so every layout trains the
same tokens per step):

* tp in {1, 2, 4, 8, ...} up to the GPUs of one node, dividing the world size;
* pp in powers of two up to the number of blocks, dividing world / tp;
* cp (context parallelism, FSDP strategies only) in powers of two that leave every rank at least
  `CP_MIN_LOCAL_TOKENS` tokens of each sequence (shorter local sequences make the key/value exchange
  outweigh the attention it splits), dividing world / (tp pp); `--cp` fixes it;
* dp_replicate x dp_shard = world / (tp pp cp), every factorisation (dp_shard = 1: pure replication);
* MoE models: the expert-parallel degree ep in the powers of two dividing num_experts that the mesh
  admits (borrowed from dp_shard x tp; a multiple of tp with tensor parallelism), 1 included;
* MoE models with ep > 1: the token dispatcher (standard, and node_limited when the EP group spans
  nodes) and the overlap chunks (1, 2, 4) -- tried on each layout that fits, the fastest kept (they
  change the step, not the memory) -- and the DualPipeV schedule with pipelining;
* activation checkpointing: none, selective "op" (and "cheap" for a model that declares modules cheap
  to recompute), full (`--search-ac` restricts);
* without pipelining: local batch = every divisor of global / dp up to 32 (the rest is accumulation);
  with pipelining: local batch = global / dp, micro-batch size in {1, 2, 4, 8} dividing it, and
  schedules 1F1B, Interleaved1F1B (2 stages per rank) and GPipe;
* strategies: zero3 (FSDP / HSDP; add zero2, zero1, ddp with `--strategies`).

Each layout is a set of knobs that goes the planner's one way (`from_job.inputs_from_config`: the job
with the knobs, its Layout resolved by the trainer, PlanInputs read from it), so a layout the trainer
refuses is rejected with the trainer's reason; its analytic peak is computed for the first and the
last pipeline rank (the others hold fewer micro-batches and neither end) and compared with the usable
device memory; survivors are ranked by predicted tokens/s (`step_time.py`). The top `verify` entries
are then traced; one whose traced peak does not fit is rejected and the next one verified instead.
`--runnable-only` also rejects layouts the trainer would not start (its full preflight). Every
rejection keeps its reason (`--show-rejected`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from torchtrain.config import ConfigError
from torchtrain.distributed.layout import DPStrategy
from torchtrain.distributed.parallel_dims import ParallelDims
from torchtrain.planner.analytic import estimate_memory
from torchtrain.planner.core import Job, Plan, make_plan, with_peak
from torchtrain.planner.from_job import display_overrides, inputs_from_config
from torchtrain.planner.inputs import PLANNER_KEYS, PlanInputs
from torchtrain.planner.step_time import StepTime, estimate_step
from torchtrain.planner.validate import runnable_problems
from torchtrain.utils.progress import Progress


@dataclass
class Candidate:
    inputs: PlanInputs
    peak: float = 0.0
    throughput: StepTime | None = None
    reason: str | None = None
    plan: Plan | None = None
    """The full plan (with traces) of a verified candidate."""
    blockers: list[str] | None = None
    overrides: list[str] | None = None
    """Config overrides selecting this layout (set for the shown entries)."""

    @property
    def tokens_per_s(self) -> float:
        return (self.throughput.tokens_per_s or 0.0) if self.throughput else 0.0


@dataclass
class SearchResult:
    base: PlanInputs
    ranked: list[Candidate] = field(default_factory=list)
    rejected: list[Candidate] = field(default_factory=list)
    examined: int = 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


CP_MIN_LOCAL_TOKENS = 8192


def _cp_degrees(base: PlanInputs, ranks: int, fixed: int | None) -> list[int]:
    if fixed is not None:
        return [fixed] if ranks % fixed == 0 else []
    return [c for c in _powers_of_two(ranks) if c == 1 or (ranks % c == 0 and base.seq_len % (2 * c) == 0
                                                         and base.seq_len // c >= CP_MIN_LOCAL_TOKENS)]


def enumerate_layouts(base: PlanInputs, ac_modes: list[str], strategies: list[str],
                      cp: int | None = None) -> list[dict]:
    """The knobs (`inputs.CONFIG_KEYS`) of every layout to try for `base`'s job, world and device."""
    a, world, out = base.model, base.world_size, []
    node = base.gpu.gpus_per_node if base.gpu is not None else world
    for tp in _powers_of_two(min(node, world)):
        if world % tp:
            continue
        for pp, c in ((pp, c) for pp in _powers_of_two(min(a.n_layers, world // tp)) if (world // tp) % pp == 0
                      for c in _cp_degrees(base, world // (tp * pp), cp)):
            dp = world // (tp * pp * c)
            if base.global_batch_size % dp:
                continue
            for rep, strategy, (ac, option) in itertools.product(_divisors(dp), strategies, _ac_choices(base, ac_modes)):
                if DPStrategy.parse(strategy).replicated and (rep != dp or c > 1):
                    continue  # replicated strategies: one data-parallel group, counted once; no CP
                for ep in (_expert_degrees(base, dp // rep, tp, DPStrategy.parse(strategy)) if c == 1 else [1]):
                    out += _batchings(base, dict(tp=tp, pp=pp, cp=c, ep=ep, dp_replicate=rep, dp_shard=dp // rep,
                                                 strategy=strategy, ac_mode=ac, ac_option=option,
                                                 global_batch_size=base.global_batch_size), dp)
    return out


def _ac_choices(base: PlanInputs, ac_modes: list[str]) -> list[tuple[str, str]]:
    """(mode, option) pairs to try: selective "op", and "cheap" when the model declares modules cheap to
    recompute."""
    out = []
    for mode in ac_modes:
        options = ["op"] + (["cheap"] if base.model.cheap_to_recompute else []) if mode == "selective" else ["op"]
        out += [(mode, option) for option in options]
    return out


def _expert_degrees(base: PlanInputs, shard: int, tp: int, strategy: DPStrategy) -> list[int]:
    """EP degrees to try: 1, and for an MoE model the powers of two dividing its experts that fit the
    mesh (the trainer's rule, `ParallelDims.resolve_dp_shard_in_ep`); EP needs an FSDP strategy."""
    experts = base.num_experts
    if not experts or strategy.replicated:
        return [1]
    out = [1]
    for ep in _powers_of_two(min(experts, shard * tp))[1:]:
        try:
            ParallelDims.resolve_dp_shard_in_ep(ep, shard, tp)
        except ConfigError:
            continue
        if experts % ep == 0:
            out.append(ep)
    return out


def _batchings(base: PlanInputs, common: dict, dp: int) -> list[dict]:
    """The layout `common` with every local batch (no pipelining), or every micro-batch size and schedule
    (the schedule's own stages per rank: 2 for Interleaved1F1B)."""
    per_rank = base.global_batch_size // dp
    if common["pp"] == 1:
        return [dict(common, local_batch_size=local) for local in _divisors(per_rank) if local <= 32]
    out = []
    schedules = ("1F1B", "Interleaved1F1B", "GPipe") + (("DualPipeV",) if common["ep"] > 1 else ())
    for mb, schedule in itertools.product((1, 2, 4, 8), schedules):
        if per_rank % mb == 0:
            out.append(dict(common, local_batch_size=per_rank, pp_microbatch_size=mb, pp_schedule=schedule))
    return out


def candidate_inputs(job: Job, base: PlanInputs, knobs: dict) -> PlanInputs:
    """One layout's PlanInputs: `base`'s job with the knobs, on `base`'s world and device, with its
    planner-only flags."""
    flags = dict(knobs, **{k: getattr(base, k) for k in PLANNER_KEYS})
    return inputs_from_config(job.cfg, job.args, base.world_size, base.device_type, base.gpu, flags)


def _worst_analytic(p: PlanInputs) -> float:
    ranks = {0, p.pp - 1}
    return max(estimate_memory(p, r).peak for r in ranks)


def search(job: Job, base: PlanInputs, ac_modes: list[str], strategies: list[str], verify: int = 1,
           peak_tflops: float | None = None, runnable_only: bool = False, show_progress: bool = False,
           cp: int | None = None) -> SearchResult:
    """`show_progress`: progress lines (rate, ETA) on stderr while checking layouts and tracing; `cp`:
    only this context-parallel degree (default: those `_cp_degrees` admits)."""
    result = SearchResult(base)
    usable = base.usable_bytes
    candidates = enumerate_layouts(base, ac_modes, strategies, cp)
    result.examined = len(candidates)
    survivors = []
    with Progress("search: checking layouts", len(candidates), "layouts", enabled=show_progress) as bar:
        for knobs in candidates:
            bar.update()
            if _check(candidate_inputs(job, base, knobs), usable, peak_tflops, result, survivors):
                _best_mechanisms(job, base, knobs, peak_tflops, survivors)
    survivors.sort(key=lambda c: (-c.tokens_per_s, c.peak))
    # traces: `verify`, plus one more for each traced layout that turns out not to fit
    with Progress(f"search: tracing the best layouts (--verify {verify})", None, "traces",
                  enabled=show_progress and verify > 0 and bool(survivors)) as bar:
        _verify(job, survivors, verify, usable, peak_tflops, runnable_only, result, bar)
    return result


EP_CHUNKS = (1, 2, 4)


def _best_mechanisms(job: Job, base: PlanInputs, knobs: dict, peak_tflops: float | None,
                     survivors: list[Candidate]) -> None:
    """For an MoE layout with ep > 1 that fits (the last survivor): the fastest token dispatcher and
    overlap chunking (module doc), each variant resolved by the trainer like any layout."""
    c = survivors[-1]
    p = c.inputs
    if p.ep == 1 or p.model.moe is None:
        return
    backends = ("standard", "node_limited") if p.ep > p.ep_ranks_per_node else ("standard",)
    for backend, chunks in itertools.product(backends, EP_CHUNKS):
        if (backend, chunks) == (p.ep_backend, p.ep_overlap_chunks):
            continue
        q = candidate_inputs(job, base, dict(knobs, ep_backend=backend, ep_overlap_chunks=chunks))
        if q.problems:
            continue
        step = estimate_step(with_peak(q, peak_tflops))
        if (step.tokens_per_s or 0.0) > c.tokens_per_s:
            c.inputs, c.throughput = q, step


def _check(p: PlanInputs, usable: float | None, peak_tflops: float | None, result: SearchResult,
           survivors: list[Candidate]) -> bool:
    """Reject the layout with its reason, or add it to `survivors` with its analytic peak and speed
    (then True)."""
    c = Candidate(p)
    if p.problems:
        c.reason = "invalid: " + "; ".join(p.problems)
        result.rejected.append(c)
        return False
    try:
        c.peak = _worst_analytic(p)
    except ConfigError as e:  # the trainer's pipeline rules (split, micro-batches, schedule)
        c.reason = f"invalid: {e}"
        result.rejected.append(c)
        return False
    if usable is not None and c.peak > usable:
        c.reason = f"does not fit: analytic peak {c.peak / 2**30:,.1f} GiB > usable {usable / 2**30:,.1f} GiB"
        result.rejected.append(c)
        return False
    c.throughput = estimate_step(with_peak(p, peak_tflops))
    survivors.append(c)
    return True


def _verify(job: Job, survivors: list[Candidate], verify: int, usable: float | None, peak_tflops: float | None,
            runnable_only: bool, result: SearchResult, bar: Progress) -> None:
    """Rank the survivors; trace the best `verify` of them and reject those whose traced peak does not fit."""
    verified = 0
    for c in survivors:
        if runnable_only:
            c.blockers = runnable_problems(c.inputs, job.tokenizer)
            if c.blockers:
                c.reason = "refused by the trainer's start-up checks: " + "; ".join(c.blockers)
                result.rejected.append(c)
                continue
        if verified < verify:
            c.plan = make_plan(job, c.inputs, trace=True, peak_tflops=peak_tflops)
            bar.update()
            traced = [r.traced_peak for r in c.plan.ranks if r.traced_peak is not None]
            if traced and usable is not None and max(traced) > usable:
                c.reason = (f"does not fit: traced peak {max(traced) / 2**30:,.1f} GiB > usable "
                            f"{usable / 2**30:,.1f} GiB (analytic {c.peak / 2**30:,.1f})")
                result.rejected.append(c)
                continue
            verified += 1
        result.ranked.append(c)


def annotate_runnable(job: Job, result: SearchResult, top: int) -> None:
    """Record for the shown entries whether the trainer would start them (its own start-up checks)."""
    for c in result.ranked[:top]:
        c.blockers = c.plan.blockers if c.plan is not None else runnable_problems(c.inputs, job.tokenizer)
        c.overrides = display_overrides(job.cfg, c.inputs)
