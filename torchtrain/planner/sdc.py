"""What the silent data corruption check costs ([fault] sdc_check_freq; components/fault/replica_check.py).

A check digests the state one replica rank holds: its parameters and, with `sdc_check_optimizer` (not under
ZeRO-1, whose ranks hold different shards of it), its optimizer state -- the two rows the memory model
already counts for the rank (`analytic.py`: "parameters ..." and "optimizer state ..."). The digest moves
about 5 bytes through memory per byte of state (the tensor read for each of its two sums, the cached
weights read, their product written and read again), so at the device's streaming bandwidth

    t_check = 5 x state bytes / (HBM bandwidth x streaming efficiency)      (compute_time.memory_seconds)

plus one all-gather of 16 bytes a tensor over the replicas, a few collective latencies, left out. The run
checks every `sdc_check_freq` steps and before every checkpoint save, so per step it costs

    t_check x (1 / sdc_check_freq + 1 / checkpoint.interval).

On a CPU the model is only the shape of it: there the planner has no bandwidth, and benchmarks/sdc_check.py
measures the digest's rate (2.2 GB/s on 2 cores, about 1.4x what 5 passes at a copy's rate would take).

Without replicas (`Layout.replicas` = 1) a check runs the first micro-batch's forward again instead: a
forward is a third of a micro-batch's forward and backward (2 of 6 FLOPs per parameter and token), so

    t_check = compute on the critical path / (3 x micro-batches a step)

(the logits' digests are small beside it). Under pipeline parallelism the trainer cannot re-execute a
forward and the check is off; for a model whose forward counts what it sees (MoE balancing) it is off too,
which the planner does not know: its figure is then an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.planner.compute_time import memory_seconds

PASSES = 5
"""Bytes the digest moves through memory per byte of state (above)."""


@dataclass
class CheckCost:
    every: int
    """Steps between scheduled checks (`fault.sdc_check_freq`)."""
    replicas: int
    """Ranks compared with each other (`Layout.replicas`; 1: the forward re-executed instead)."""
    state_bytes: float
    """Bytes one rank digests a check (its parameters and, when compared, its optimizer state; 0 re-executing)."""
    check_s: float | None
    """Seconds of one check (None: no bandwidth known for the device)."""
    per_step_s: float | None
    """Seconds a step on average, the saves' checks included."""
    step_share: float | None
    """`per_step_s` over the predicted step time."""


def summarize(p, ranks, step) -> CheckCost | None:
    """The check's cost on the pipeline rank that holds the most state; None when the job does not check
    (`sdc_check_freq` 0, or pipeline parallelism without replicas)."""
    layout = p.layout
    if not p.sdc_check_freq or layout is None or not ranks or (layout.replicas == 1 and p.pp > 1):
        return None
    rate = 1 / p.sdc_check_freq + (1 / p.checkpoint_interval if p.checkpoint_interval else 0.0)
    if layout.replicas == 1:  # re-execution of one micro-batch's forward
        check_s = step.compute_s / (3 * p.grad_accum_steps) if step.compute_s else None
        return _cost(p, 1, 0.0, check_s, rate, step)
    compares_optimizer = p.sdc_check_optimizer and not layout.zero1
    prefixes = ("parameters", "optimizer state") if compares_optimizer else ("parameters",)
    state = max(sum(row.bytes for row in rank.analytic.rows if row.name.startswith(prefixes)) for rank in ranks)
    check_s = memory_seconds(p.gpu, PASSES * state) if p.gpu is not None and p.gpu.hbm_tbps else None
    return _cost(p, layout.replicas, state, check_s, rate, step)


def _cost(p, replicas: int, state: float, check_s: float | None, rate: float, step) -> CheckCost:
    per_step = None if check_s is None else check_s * rate
    share = per_step / step.step_s if per_step is not None and step.step_s else None
    return CheckCost(p.sdc_check_freq, replicas, state, check_s, per_step, share)


def describe(cost: CheckCost) -> str:
    """One line of the step-time table."""
    state = f"{cost.state_bytes / 1e9:,.2f} GB a rank, {cost.replicas} replicas compared" if cost.replicas > 1 \
        else "no replicas: one micro-batch's forward run again"
    if cost.check_s is None:
        return f"every {cost.every} steps and before each save ({state}; no bandwidth known for this device)"
    share = f", {cost.step_share:.2%} of a step" if cost.step_share is not None else ""
    return (f"every {cost.every} steps and before each save: {cost.check_s * 1e3:,.1f} ms a check ({state}); "
            f"{cost.per_step_s * 1e3:,.3f} ms a step{share}")
