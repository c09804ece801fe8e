"""What failures add to a long run's time and cost: expected interruptions, restart time, lost work.

At scale failures are the normal case. Meta reports 419 unexpected interruptions in 54 days of Llama 3
405B pre-training on 16,384 H100s (The Llama 3 Herd of Models, 2024, section 3.3.4 and Table 5): a rate
of 419 / (54 x 24 h x 16,384) = 1.97e-5 interruptions per GPU-hour, one every ~3 hours for the job. The
rate per GPU is what carries over to another size: a job of N GPUs sees r N interruptions per hour.

Each interruption costs the job, in wall-clock time,

    c = restart + interval / 2

the restart (detection, torchrun's restart of every worker, start-up, loading the last checkpoint:
docs/resilience.md; `--restart-minutes`, default 10 at scale) and the work since the last checkpoint,
half a checkpoint interval on average (`checkpoint.interval` steps x the step time). With U hours of
useful training the wall-clock time W satisfies W = U + r N W c / 3600, so

    W = U / (1 - r N c / 3600)

and the run never ends when r N c >= 3600 s (interruptions come faster than the job recovers): then
checkpoint more often or restart faster. Without checkpointing (`checkpoint.enable = false`) every
interruption restarts from step 0: the figure is not given, and the report says why.

Replica-group fault tolerance (`fault.replica_ft`) loses less (the surviving groups go on, only a
lost group's share of the batch is missing for a few steps); the planner counts it like a restart, an
upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA3_405B_RATE = 419 / (54 * 24 * 16384)
"""Unexpected interruptions per GPU-hour in Llama 3 405B's pre-training (Meta, 2024)."""
DEFAULT_RESTART_S = 600.0


@dataclass
class Interruptions:
    rate_per_gpu_hour: float
    restart_s: float
    checkpoint_interval_s: float | None
    """Seconds between checkpoints (None: checkpointing off)."""
    expected: float | None = None
    """Expected interruptions over the run (None: not bounded)."""
    lost_share: float | None = None
    """Share of the wall-clock time lost to interruptions (None: not bounded)."""
    wall_s: float | None = None
    """Wall-clock time of the run with interruptions (None: it never ends, or checkpointing is off)."""
    reason: str = ""
    """Why there is no figure, when there is none."""


def expected_interruptions(useful_s: float, world_size: int, step_s: float, checkpoint_interval_steps: int | None,
                           rate_per_gpu_hour: float = LLAMA3_405B_RATE,
                           restart_s: float = DEFAULT_RESTART_S) -> Interruptions:
    """The run's wall-clock time with interruptions (see the module docstring); `checkpoint_interval_steps`
    None when the job does not checkpoint."""
    interval_s = checkpoint_interval_steps * step_s if checkpoint_interval_steps else None
    out = Interruptions(rate_per_gpu_hour, restart_s, interval_s)
    if rate_per_gpu_hour <= 0:
        out.expected, out.lost_share, out.wall_s = 0.0, 0.0, useful_s
        return out
    if interval_s is None:
        out.reason = "checkpointing is off: every interruption restarts the run from step 0 (checkpoint.enable)"
        return out
    per_hour = rate_per_gpu_hour * world_size
    lost = per_hour * (restart_s + interval_s / 2) / 3600
    if lost >= 1:
        out.reason = (f"interruptions come every {3600 / per_hour / 60:,.0f} min and each costs "
                      f"{(restart_s + interval_s / 2) / 60:,.0f} min: the run never ends (checkpoint more often)")
        return out
    out.wall_s = useful_s / (1 - lost)
    out.lost_share = lost
    out.expected = per_hour * out.wall_s / 3600
    return out


def summary(i: Interruptions, world_size: int) -> str:
    """One line for the plan's report."""
    if i.wall_s is None:
        return i.reason
    if not i.rate_per_gpu_hour:
        return "none (--failure-rate 0)"
    every_h = 1 / (i.rate_per_gpu_hour * world_size)
    when = f"{every_h:,.1f} h" if every_h >= 1 else f"{every_h * 60:,.0f} min"
    return (f"{i.expected:,.1f} (one every {when} at {i.rate_per_gpu_hour:.3g} per GPU-hour); each costs "
            f"{i.restart_s / 60:,.0f} min restart + {i.checkpoint_interval_s / 120:,.1f} min of lost steps "
            f"-> {i.lost_share:.1%} of the wall-clock time")


def is_finite(i: Interruptions) -> bool:
    return i.wall_s is not None and math.isfinite(i.wall_s)
