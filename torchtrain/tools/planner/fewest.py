"""The fewest GPUs that fit a job: world sizes tried in increasing order (powers of two, then multiples
of a node) with the job's layout flags, analytic memory only (fast), until one fits. The planner's
answer to "how few GPUs", printed beside a plan that does not fit; with offload flags the same search
tells how few GPUs offloading needs."""

from __future__ import annotations

from typing import Any

from torchtrain.config import ConfigError
from torchtrain.tools.planner.core import Job, Plan, plan_from_flags

WITHOUT_OFFLOAD = {"cpu_offload": False, "offload_optimizer": "none", "offload_params": "none"}


def world_sizes(limit: int, per_node: int) -> list[int]:
    small = [n for n in (1, 2, 4) if n < per_node]
    return small + list(range(per_node, limit + 1, per_node))


def fewest_gpus(job: Job, gpu: str, flags: dict[str, Any], device: list[str] | None = None,
                limit: int = 4096, offload: bool = False) -> tuple[int, Plan] | None:
    """(world size, its plan) of the smallest world that fits with `flags` (offload switched off unless
    `offload`); None when nothing up to `limit` GPUs does."""
    flags = dict(flags, **({} if offload else WITHOUT_OFFLOAD))
    per_node = 8
    for world in world_sizes(limit, per_node):
        try:
            plan = plan_from_flags(job, world, gpu, flags, trace=False, device=device)
        except ConfigError:
            continue
        if plan.valid and plan.fits:
            return world, plan
    return None
