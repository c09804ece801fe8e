"""The fewest GPUs that fit a job: world sizes tried in increasing order (powers of two, then multiples
of a node) with the job's layout flags, analytic memory only (fast), until one fits. The planner's
answer to "how few GPUs", printed beside a plan that does not fit; with offload flags the same search
tells how few GPUs offloading needs."""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from torchtrain.config import ConfigError
from torchtrain.planner.core import Job, Plan, plan_from_flags

if TYPE_CHECKING:
    from torchtrain.planner.search import SearchResult

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


OFFLOAD_TIERS = ("cpu", "cpu")
"""(params, optimizer) the search falls back to when no layout fits: ZeRO-Offload's host-memory tiers."""


def offloaded_job(job: Job, params: str = OFFLOAD_TIERS[0], optimizer: str = OFFLOAD_TIERS[1]) -> Job:
    """`job` with its model state offloaded ([offload] params and optimizer)."""
    cfg = copy.deepcopy(job.cfg)
    cfg.offload.params, cfg.offload.optimizer = params, optimizer
    return dataclasses.replace(job, cfg=cfg)


def search_with_offload(job: Job, base_flags: dict[str, Any], world: int, gpu: str, device: list[str] | None,
                        ac_modes: list[str], strategies: list[str], verify: int, peak_tflops: float | None,
                        runnable_only: bool, cp: int | None) -> tuple[Job, "SearchResult"]:
    """`--search` again with the model state in host memory, for when nothing fits on the GPUs alone;
    each fitting layout's step time is the offloaded one (`offload.with_offload_time`), and layouts whose
    node cannot hold the offloaded state are rejected."""
    from torchtrain.planner.core import make_plan, resolve_gpu
    from torchtrain.planner.from_job import inputs_from_config
    from torchtrain.planner.search import search

    off_job = offloaded_job(job)
    device_type, spec = resolve_gpu(gpu, device)
    base = inputs_from_config(off_job.cfg, off_job.args, world, device_type, spec, base_flags)
    result = search(off_job, base, ac_modes, strategies, 0, peak_tflops, runnable_only, show_progress=True, cp=cp)
    kept = []
    for c in result.ranked:
        c.plan = make_plan(off_job, c.inputs, trace=False, peak_tflops=peak_tflops)
        c.throughput = c.plan.throughput
        if c.plan.offload is not None and not c.plan.offload.fits:
            c.reason = "does not fit: the node's host memory / NVMe cannot hold the offloaded state"
            result.rejected.append(c)
        else:
            kept.append(c)
    result.ranked = sorted(kept, key=lambda c: (-c.tokens_per_s, c.peak))
    return off_job, result
