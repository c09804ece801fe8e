"""A `[dpo]` plan's preference section: what its reference costs, gathered from the plan (`preference.py` has
the model), for the table (`describe`) and `--json` (`PreferenceCost`)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.preference import KINDS, OneOff, data_rows, one_off


@dataclass
class PreferenceCost:
    """The `[dpo]` lines of a plan (`summarize`); bytes are the worst rank's."""

    loss_type: str
    reference: str
    reference_bytes_per_rank: float
    """Device memory the reference holds through the step: its copy's weights (0 without a copy; its units are
    gathered only during its forward)."""
    reference_weights_bytes: float
    reference_host_bytes: float
    """The copy's weights in host memory (CPU offload)."""
    reference_flops_per_token: float
    train_flops_per_token: float
    reference_step_s: float | None
    """The reference's forwards in the step time (compute, TP, exposed all-gathers)."""
    mfu_trained_model_only: float | None
    """The effective MFU counting only the trained model's FLOPs (the trainer's mfu_pct convention)."""
    trace: str
    """How the traced peak covers the DPO step."""
    one_off: OneOff | None = None


def summarize(p: PlanInputs, ranks, step, job) -> PreferenceCost | None:
    """The preference section of a plan: `ranks` its RankPlans, `step` its StepTime, `job` its core.Job."""
    if p.dpo is None:
        return None
    rank = max(ranks, key=lambda r: r.peak) if ranks else None
    rows = [r for r in rank.analytic.rows if r.name.startswith("reference copy")] if rank else []
    weights = sum(r.bytes for r in rows)
    ref = step.reference_flops_per_token
    mfu = None if step.effective_mfu is None else step.effective_mfu * (1 - ref / step.flops_per_token)
    if rank is None or rank.trace is None:
        trace = "not traced"
    elif rank.trace.skipped is not None:
        trace = f"not traced: {rank.trace.skipped}"
    else:
        what = {"copy": "the copy built and run as the trainer does, its weights counted as parameters",
                "adapters off": "the reference forward with the adapters off, the preference loss"}
        trace = f"the real DPO step on fake tensors ({what.get(p.dpo.reference, 'the preference loss')})"
    cost = PreferenceCost(p.dpo.loss_type, p.dpo.reference, weights, weights,
                          rank.analytic.reference_host if rank else 0.0, ref, step.flops_per_token - ref,
                          step.reference_s, mfu, trace)
    if p.dpo.reference == "precomputed":
        cost.one_off = one_off(p, p.gpu, data_rows(job))
    return cost


def _si(x: float, unit: str) -> str:
    for div, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:,.2f} {prefix}{unit}"
    return f"{x:,.2f} {unit}"


def _seconds(s: float) -> str:
    return f"{s / 3600:,.1f} h" if s >= 3600 else f"{s / 60:,.1f} min" if s >= 60 else f"{s:,.3f} s"


def describe(cost: PreferenceCost, unit: tuple[float, str]) -> list[str]:
    """The report's "Preference optimisation (DPO)" section."""
    u, name = unit
    memory = f"{cost.reference_bytes_per_rank / u:,.2f} {name}"
    if cost.reference == "copy":
        memory += " (its frozen fp32 weights, sharded as the parameters)"
    if cost.reference_host_bytes:
        memory += f"; {cost.reference_host_bytes / u:,.2f} {name} in host memory (offloaded with the parameters)"
    flops = "0 (no reference forward in the step)" if not cost.reference_flops_per_token else (
        f"{_si(cost.reference_flops_per_token, 'FLOP')} (+{cost.reference_flops_per_token / cost.train_flops_per_token:.1%}"
        f" over training's {_si(cost.train_flops_per_token, 'FLOP')}; counted as work in the step's FLOPs and MFU)")
    rows = [("reference", KINDS[cost.reference]), ("reference memory per rank", memory),
            ("reference FLOPs per token", flops)]
    if cost.reference_step_s is not None and cost.reference_flops_per_token:
        rows.append(("reference forwards per step", _seconds(cost.reference_step_s)))
    if cost.mfu_trained_model_only is not None and cost.reference_flops_per_token:
        rows.append(("MFU of the trained model only", f"{cost.mfu_trained_model_only:.1%} (without the reference's "
                     "FLOPs, which the trainer's mfu_pct leaves out)"))
    rows.append(("traced peak", cost.trace))
    o = cost.one_off
    if o is not None:
        if o.tokens is not None:
            secs = f", {_seconds(o.seconds)}" if o.seconds is not None else ""
            rows.append(("precomputed pass (once, before training)", f"{_si(o.flops, 'FLOP')}{secs} over {o.tokens:,.0f} "
                         f"tokens ({o.pairs:,} pairs in {o.rows:,} rows); its table {o.table_bytes / 2**20:,.2f} MiB "
                         "per device"))
        rows.append(("precomputed pass per 1M tokens", f"{_si(o.flops_per_million_tokens, 'FLOP')}" + (
            f", {_seconds(o.seconds_per_million_tokens)}" if o.seconds_per_million_tokens is not None else "")))
    return [f"Preference optimisation (DPO): {cost.loss_type} loss"] + [f"  {k:<46} {v}" for k, v in rows]
