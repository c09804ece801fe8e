"""Plans and searches as readable tables (default) or JSON (`--json`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtrain.components.observability.tensor_memory import CATEGORIES
from torchtrain.planner import grpo_report, interruptions, preference_report, sdc, vision
from torchtrain.planner.core import Plan, RankPlan
from torchtrain.planner.pipeline import ENCODER

GIB = 2**30


def _g(x: float | None, unit: float = GIB) -> str:
    return "n/a" if x is None else f"{x / unit:,.2f}"


def _unit(plan: Plan) -> tuple[float, str]:
    """GiB, or MiB for plans of small models (tests, CPU runs) so their numbers stay readable."""
    return (GIB, "GiB") if plan.worst.peak >= GIB / 4 else (2**20, "MiB")


def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:,.2f} {suffix}{unit}"
    return f"{x:,.2f} {unit}".rstrip()


def _duration(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s >= 86400:
        return f"{s / 86400:,.1f} days"
    if s >= 3600:
        return f"{s / 3600:,.1f} h"
    return f"{s:,.2f} s"


def _device(plan: Plan) -> str:
    p = plan.inputs
    if p.gpu is None:
        mem = f"{p.memory_gib:g} GiB" if p.memory_gib else "memory unknown"
        return f"{p.world_size} x CPU ({mem})"
    return f"{p.world_size} x {p.gpu.name}"


def _stage_text(rank: RankPlan, encoder: bool = False) -> str:
    """A rank's stages; `encoder`: the model has a vision encoder (shown on the stage that holds it)."""
    parts = []
    for s in rank.analytic.stages:
        blocks = f"blocks {s.layers[0]}-{s.layers[-1]}" if s.layers else "no blocks"
        ends = [e for e, on in (("vision encoder", encoder and s.holds(ENCODER)), ("embedding", s.first),
                                ("output", s.last)) if on]
        parts.append(blocks + (" + " + " + ".join(ends) if ends else ""))
    return "; ".join(parts)


def _params(a) -> str:
    """"N parameters", with the active ones of a mixture-of-experts model."""
    text = f"{_si(a.num_params)} parameters"
    return text + (f", {_si(a.num_active_params)} active per token" if a.num_active_params != a.num_params else "")


def _experts_line(plan: Plan) -> str | None:
    p, t = plan.inputs, plan.throughput
    if not p.num_experts:
        return None
    if p.ep == 1:
        return f"  experts  {p.num_experts} per MoE layer on every rank (no expert parallelism: --ep)"
    links = t.expert_link_bytes or {}
    scheme = ("node-limited: one row per selected node across nodes, k rows inside" if p.ep_backend == "node_limited"
              else "standard: k rows of h per routed token")
    return (f"  experts  ep {p.ep}: {p.num_experts // p.ep} of {p.num_experts} experts per rank, FSDP-sharded over "
            f"{p.expert_fsdp} ranks; all-to-all sent per rank per step: {_si(links.get('inter-node', 0.0), 'B')} "
            f"inter-node, {_si(links.get('intra-node', 0.0), 'B')} intra-node ({scheme}; "
            f"{p.ep_ranks_per_node} EP ranks per node)")


def _fewest_lines(plan: Plan, fewest: tuple | None) -> list[str]:
    """What fits instead, when the plan does not: the fewest GPUs without offload and with the plan's
    offload flags (`fewest.py`)."""
    if fewest is None:
        return []
    gpu = plan.inputs.gpu.name if plan.inputs.gpu else "devices"
    lines = []
    for what, found in zip(("without offload", "with this offload"), fewest):
        if what == "with this offload" and plan.offload is None:
            continue
        lines.append(f"  fewest {gpu} that fit {what}: " + (
            f"{found[0]} ({found[1].inputs.describe()})" if found else "none up to 4096"))
    return lines


def format_plan(plan: Plan, fewest: tuple | None = None) -> str:
    p, a, lines = plan.inputs, plan.inputs.model, []
    lines.append(f"torchtrain plan: {p.model_name} {p.flavor} ({_params(a)}) on {_device(plan)}")
    lines.append(f"  layout   {p.describe()}")
    experts = _experts_line(plan)
    if experts:
        lines.append(experts)
    lines += vision.describe(p)
    lines.append(f"  batch    {p.local_batch_size} sequences x dp {p.dp} x {p.grad_accum_steps} accumulation = "
                 f"{p.global_batch_size} sequences of {p.seq_len} tokens"
                 + (f"; pipeline micro-batch {p.pp_microbatch_size} ({p.n_microbatches} per batch)"
                    if p.pp > 1 else ""))
    lines.append(f"  dtypes   compute {p.param_dtype}, master weights float32, gradient reduction {p.reduce_dtype}; "
                 f"{p.optimizer} ({p.optimizer_impl})")
    status = "INVALID: " + "; ".join(plan.problems) if plan.problems else (
        "valid; the trainer starts it" if not plan.blockers else
        "valid layout, but the trainer's start-up checks refuse the job: " + "; ".join(plan.blockers))
    lines.append(f"  status   {status}")
    if plan.overrides:
        lines.append("  run with " + " ".join(plan.overrides))
    lines.append("")
    if not plan.ranks:  # an impossible layout has no memory to show
        return "\n".join(lines)
    worst = plan.worst
    lines += _memory_table(plan, worst) + _fewest_lines(plan, fewest)
    if p.pp > 1:
        lines += ["", _pipeline_table(plan)]
    if plan.offload is not None:
        from torchtrain.planner.offload import format_offload

        lines += ["", *format_offload(plan.offload, plan.base_throughput, plan.throughput)]
    lines += ["", *_throughput_lines(plan)]
    if plan.preference is not None:
        lines += ["", *preference_report.describe(plan.preference, _unit(plan))]
    if plan.grpo is not None:
        lines += ["", *grpo_report.describe(plan.grpo, _unit(plan))]
    notes = plan.notes + worst.analytic.notes + (worst.trace.notes if worst.trace else [])
    if notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines)


def _memory_table(plan: Plan, rank: RankPlan) -> list[str]:
    p, est = plan.inputs, rank.analytic
    u, name = _unit(plan)
    head = f"Memory per GPU ({name}), pipeline rank {rank.pp_rank}" if p.pp > 1 else f"Memory per GPU ({name})"
    lines = [f"{head}: {_stage_text(rank, p.model.vision is not None)}; analytic peak at the {est.phase}",
             f"  {'component':<58} {name:>9}  formula"]
    for row in est.rows:
        lines.append(f"  {row.name:<58} {_g(row.bytes, u):>9}  {row.formula}")
    lines.append(f"  {'analytic peak':<58} {_g(est.peak, u):>9}  "
                 f"(next: {est.other_phase[0]} {_g(est.other_phase[1], u)})")
    if est.host_bytes:
        lines.append(f"  {'host memory (CPU offload)':<58} {_g(est.host_bytes, u):>9}")
    if rank.trace is None:
        why = "(offloaded layout: analytic only)" if plan.offload is not None else "(--no-trace)"
        lines.append(f"  {'traced peak':<58} {'skipped':>9}  {why}")
    elif rank.trace.skipped:
        lines.append(f"  {'traced peak':<58} {'n/a':>9}  {rank.trace.skipped}")
    else:
        parts = " | ".join(f"{k.replace('_', ' ')} {_g(rank.traced_breakdown.get(k, 0.0), u)}" for k in CATEGORIES)
        lines.append(f"  {'traced peak (one real step on fake tensors)':<58} {_g(rank.traced_peak, u):>9}  "
                     f"at {rank.traced_phase}: {parts}")
        diff = rank.traced_peak - est.peak
        lines.append(f"  {'difference traced - analytic':<58} {diff / u:>+9.2f}  ({diff / max(est.peak, 1):+.1%})")
    usable = p.usable_bytes
    if usable is None:
        lines.append(f"  {'device memory':<58} {'unknown':>9}  (give --memory-gib to check the fit)")
    else:
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        if plan.grpo is not None and plan.grpo.sampling_fits is False:
            verdict += f" (GRPO sampling peak {_g(plan.grpo.sampling_peak_bytes, u)} {name})"
        lines.append(f"  {'usable device memory':<58} {_g(usable, u):>9}  {p.memory_gib:g} GiB - {p.headroom:.0%} "
                     f"headroom -> {verdict} (worst rank {_g(plan.worst.peak, u)} {name})")
    return lines


def _pipeline_table(plan: Plan) -> str:
    from torchtrain.planner.pipeline import pipeline_of

    p = plan.inputs
    u, name = _unit(plan)
    prof = pipeline_of(p)
    formula = (p.pp - 1) / (p.n_microbatches + p.pp - 1)
    lines = [f"Pipeline: {p.pp_schedule}, {p.pp} ranks x {p.pp_stages_per_rank} stage(s), {p.n_microbatches} "
             f"micro-batches: bubble {prof.bubble:.1%} (replayed from the schedule; GPipe/1F1B formula "
             f"(pp-1)/(m+pp-1) = {formula:.1%})",
             f"  {'rank':>4}  {'stages':<44} {'in flight':>9} {'analytic':>9} {'traced':>9}  ({name})"]
    for r in plan.ranks:
        traced = _g(r.traced_peak, u) if r.traced_peak is not None else "n/a"
        lines.append(f"  {r.pp_rank:>4}  {_stage_text(r, p.model.vision is not None)[:44]:<44} {r.analytic.in_flight:>9} "
                     f"{_g(r.analytic.peak, u):>9} "
                     f"{traced:>9}")
    return "\n".join(lines)


def _throughput_lines(plan: Plan) -> list[str]:
    p, t = plan.inputs, plan.throughput
    device = (f"{t.device}, {t.peak_tflops:,.1f} TFLOP/s {p.param_dtype} peak; rates from components/hardware.py"
              if t.peak_tflops else "no device rates: give --gpu, or --gpu cpu with --device FIELD=VALUE")
    model = "6N + attention" if p.lora is None else "4N + 6 x adapters + attention (LoRA)"
    label = f"FLOPs per token (model: {model})" if not t.encoder_flops_per_token else \
        "FLOPs per token (6N + attention + encoder)"
    if t.reference_flops_per_token:
        label = f"FLOPs per token ({model} + reference forward)"
    rows = [(label, _si(t.flops_per_token, "FLOP"))]
    if t.encoder_flops_per_token:  # counted in the step's FLOPs and MFU
        rows.append(("  of which the vision encoder (images)", f"{_si(t.encoder_flops_per_token, 'FLOP')} "
                     f"({t.encoder_flops_per_token / t.flops_per_token:.1%}; counted in the MFU)"))
    if t.reference_flops_per_token:  # a DPO reference's forward: counted in the step's FLOPs and MFU
        rows.append(("  of which the reference forward (DPO)", f"{_si(t.reference_flops_per_token, 'FLOP')} "
                     f"({t.reference_flops_per_token / t.flops_per_token:.1%}; counted in the MFU)"))
    rows += [
            ("+ recomputation (activation checkpointing)", _si(t.recompute_flops_per_token, "FLOP")),
            ("tokens per step", f"{t.tokens_per_step:,}")]
    if t.step_s is not None:
        work = ", ".join(f"{k} {v:,.3f}" for k, v in t.compute_breakdown_s.items() if v)
        comm = ", ".join(f"{k} {v:,.3f} s" for k, v in t.comm_s.items()) or "none"
        if t.expert_all_to_all_hidden_s:
            comm += f" (expert all-to-all hidden behind computation: {t.expert_all_to_all_hidden_s:,.3f} s)"
        rows += [("compute on the critical path", f"{t.compute_s:,.3f} s ({work})"),
                 ("pipeline bubble", f"{t.bubble_s:,.3f} s ({t.bubble:.1%} of the schedule)"),
                 ("exposed communication", comm), ("optimizer step", f"{t.optimizer_s:,.3f} s"),
                 ("GPU time", f"{t.gpu_s:,.3f} s")]
        if t.host_s is not None:
            parts = ", ".join(f"{k} {v:,.3f}" for k, v in t.host_breakdown_s.items())
            rows.append(("host time (dispatching the step)", f"{t.host_s:,.3f} s ({t.host_ops:,.0f} operators: {parts})"))
        bound = "" if t.host_s is None else " (host-bound)" if t.host_s > t.gpu_s else " (GPU-bound)"
        if plan.sdc is not None:
            rows.append(("silent data corruption check", sdc.describe(plan.sdc)))
        rows += [("step time", f"{t.step_s:,.3f} s{bound}"),
                 ("tokens/s", f"{t.tokens_per_s:,.0f} ({t.tokens_per_s / p.world_size:,.0f} per GPU)"),
                 ("effective MFU", f"{t.effective_mfu:.1%}")]
    budget = "Chinchilla: 20 x parameters" if p.tokens is None else "--tokens"
    rows.append((f"token budget ({budget})", f"{_si(t.budget_tokens, 'tokens')} = {t.steps:,} steps"))
    if t.train_s is not None:
        rows += [("time to train", _duration(t.train_s)), ("GPU-hours", f"{t.gpu_hours:,.0f}"),
                 (f"cost at ${p.price:,.2f} per GPU-hour (--price)", f"${t.cost:,.0f}")]
        if t.interruptions is not None:
            rows.append(("expected interruptions", interruptions.summary(t.interruptions, p.world_size)))
            if t.cost_with_interruptions is not None:
                rows += [("time to train with interruptions", _duration(t.interruptions.wall_s)),
                         ("GPU-hours and cost with interruptions",
                          f"{t.gpu_hours_with_interruptions:,.0f}, ${t.cost_with_interruptions:,.0f}")]
    return [f"Step time and cost ({device})"] + [f"  {label:<46} {value}" for label, value in rows]


# ----------------------------------------------------------------------------------------- JSON
def _clean(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _clean(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def plan_to_dict(plan: Plan, fewest: tuple | None = None) -> dict[str, Any]:
    p = plan.inputs
    inputs = {f.name: _clean(getattr(p, f.name)) for f in dataclasses.fields(p)
              if f.name not in ("args", "notes", "job", "layout", "problems")}
    inputs.update(dp=p.dp, grad_accum_steps=p.grad_accum_steps, n_microbatches=p.n_microbatches,
                  layout=p.describe())
    ranks = []
    for r in plan.ranks:
        ranks.append({
            "pp_rank": r.pp_rank, "stages": _clean(r.analytic.stages), "in_flight": r.analytic.in_flight,
            "params_on_rank_before_sharding": r.analytic.params_on_rank,
            "analytic": {"peak_bytes": r.analytic.peak, "phase": r.analytic.phase,
                         "rows": [{"name": x.name, "bytes": x.bytes, "formula": x.formula} for x in r.analytic.rows],
                         "host_bytes": r.analytic.host_bytes},
            "traced": None if r.trace is None else {
                "skipped": r.trace.skipped, "peak_bytes": r.traced_peak, "phase": r.traced_phase,
                "breakdown_bytes": r.traced_breakdown, "in_flight_bytes": r.traced_in_flight,
                "traced_blocks": list(r.trace.traced_blocks), "seconds": r.trace.seconds, "notes": r.trace.notes},
            "peak_bytes": r.peak,
        })
    return {
        "model": {"name": p.model_name, "args": _clean(p.args), "num_params": p.model.num_params,
                  "num_active_params": p.model.num_active_params},
        "inputs": inputs, "valid": plan.valid, "problems": plan.problems, "runnable": not plan.blockers,
        "blockers": plan.blockers, "overrides": plan.overrides,
        "memory": {"ranks": ranks, "worst_rank": plan.worst.pp_rank if ranks else None,
                   "worst_peak_bytes": plan.worst.peak if ranks else None, "usable_bytes": p.usable_bytes,
                   "fits": plan.fits if ranks else None},
        "throughput": _clean(plan.throughput), "notes": plan.notes, "images": _images(p),
        "preference": _clean(plan.preference),
        "grpo": _clean(plan.grpo),
        "sdc_check": _clean(plan.sdc),
        "offload": None if plan.offload is None else {
            **_clean(plan.offload), "host_per_node_bytes": plan.offload.host_per_node,
            "nvme_per_node_bytes": plan.offload.nvme_per_node, "fits_node": plan.offload.fits,
            "step_s_without_offload": plan.base_throughput.step_s if plan.base_throughput else None},
        "fewest_gpus": None if fewest is None else {
            k: f[0] if f else None for k, f in zip(("without_offload", "with_offload"), fewest)},
    }


def _images(p) -> dict[str, Any] | None:
    """The images of a vision-language plan: each one's patch grid, decoder tokens and training FLOPs."""
    grid = vision.image_grid(p)
    if grid is None:
        return None
    return {"per_sample": p.images_per_sample, "size": list(p.image_size), "grid": list(grid),
            "patches": grid[0] * grid[1] * grid[2], "tokens": p.model.vision.tokens(grid),
            "encoder_flops": p.model.vision.flops(grid)}


# ----------------------------------------------------------------------------------------- search
def _candidate_row(i: int, c) -> str:
    p, t = c.inputs, c.throughput
    traced = "n/a"
    if c.plan is not None:
        peaks = [r.traced_peak for r in c.plan.ranks if r.traced_peak is not None]
        traced = _g(max(peaks)) if peaks else "n/a"
    runs = "" if c.blockers is None else ("yes" if not c.blockers else "not yet")
    batch = f"{p.local_batch_size}x{p.grad_accum_steps}" if p.pp == 1 else f"{p.pp_microbatch_size}x{p.n_microbatches}"
    return (f"  {i:>3}  {p.short():<42} {batch:>7} {_g(c.peak):>9} {traced:>9} "
            f"{(t.tokens_per_s or 0):>12,.0f} {(t.effective_mfu or 0):>7.1%} {(t.step_s or 0):>8.2f}  {runs}")


def format_search(result, top: int, show_rejected: bool) -> str:
    b = result.base
    gpu = b.gpu.name if b.gpu is not None else "CPU"
    usable = _g(b.usable_bytes) if b.usable_bytes is not None else "unknown"
    lines = [f"torchtrain search: {b.model_name} {b.flavor} ({_params(b.model)}) on "
             f"{b.world_size} x {gpu}; "
             f"global batch {b.global_batch_size} x {b.seq_len} tokens; usable memory {usable} GiB per GPU",
             f"  {result.examined:,} layouts examined: {len(result.ranked):,} fit, {len(result.rejected):,} rejected "
             "(ranked by predicted tokens/s: docs/planner.md, 'Time model')",
             "",
             f"  {'#':>3}  {'layout':<42} {'batch':>7} {'analytic':>9} {'traced':>9} {'tokens/s':>12} "
             f"{'MFU':>7} {'step s':>8}  runs now"]
    for i, c in enumerate(result.ranked[:top], start=1):
        lines.append(_candidate_row(i, c))
    if not result.ranked:
        lines.append("  (no layout fits: more GPUs, activation checkpointing, or a shorter sequence)")
    lines.append("  batch: local batch x accumulation, or with pipelining micro-batch size x micro-batches; "
                 "memory in GiB (worst rank)")
    if result.ranked and result.ranked[0].blockers:
        lines.append(f"  #1 needs: {'; '.join(result.ranked[0].blockers)}")
    if result.ranked and result.ranked[0].overrides is not None:
        lines.append("  #1 run with: " + (" ".join(result.ranked[0].overrides) or "the job as it is"))
    reasons: dict[str, int] = {}
    for c in result.rejected:
        reasons[c.reason.split(":")[0]] = reasons.get(c.reason.split(":")[0], 0) + 1
    lines.append("  rejected: " + (", ".join(f"{n:,} {k}" for k, n in reasons.items()) or "none")
                 + ("" if show_rejected else " (--show-rejected lists each with its reason)"))
    if show_rejected:
        lines += ["", "Rejected layouts:"]
        lines += [f"  {c.inputs.short()}, batch {c.inputs.local_batch_size}"
                  + (f" mb {c.inputs.pp_microbatch_size}" if c.inputs.pp > 1 else "") + f": {c.reason}"
                  for c in result.rejected]
    return "\n".join(lines)


def search_to_dict(result, top: int, show_rejected: bool) -> dict[str, Any]:
    def entry(c) -> dict[str, Any]:
        out = {"layout": c.inputs.describe(), "dp_replicate": c.inputs.dp_replicate, "dp_shard": c.inputs.dp_shard,
               "tp": c.inputs.tp, "pp": c.inputs.pp, "ep": c.inputs.ep, "strategy": c.inputs.strategy,
               "ac_mode": c.inputs.ac_mode,
               "ac_option": c.inputs.ac_option, "pp_schedule": c.inputs.pp_schedule,
               "pp_stages_per_rank": c.inputs.pp_stages_per_rank, "pp_microbatch_size": c.inputs.pp_microbatch_size,
               "local_batch_size": c.inputs.local_batch_size, "grad_accum_steps": c.inputs.grad_accum_steps,
               "analytic_peak_bytes": c.peak, "reason": c.reason}
        if c.throughput is not None:
            out["throughput"] = _clean(c.throughput)
        if c.plan is not None:
            out["plan"] = plan_to_dict(c.plan)
        if c.blockers is not None:
            out["runnable"], out["blockers"] = not c.blockers, c.blockers
        if c.overrides is not None:
            out["overrides"] = c.overrides
        return out

    b = result.base
    return {"model": b.model_name, "world_size": b.world_size, "gpu": b.gpu.key if b.gpu else "cpu",
            "global_batch_size": b.global_batch_size, "seq_len": b.seq_len, "usable_bytes": b.usable_bytes,
            "examined": result.examined, "fitting": len(result.ranked),
            "ranked": [entry(c) for c in result.ranked[:top]],
            "rejected_count": len(result.rejected),
            "rejected": [entry(c) for c in result.rejected] if show_rejected else None}
