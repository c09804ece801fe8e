"""Offload in the plan ([offload], training.enable_cpu_offload; docs/offload.md): where each component
of a rank's model state lives (GPU / CPU memory / NVMe), whether a node's host memory and NVMe hold it,
and what moving it costs in the step.

Tiers. `params` cpu is FSDP2's CPUOffloadPolicy (the same as training.enable_cpu_offload): fp32 master
parameters, gradients and the optimizer state of the rank's shard in host memory, the optimizer step on
the CPU; `params` nvme keeps the parameter shards on NVMe instead. `optimizer` cpu/nvme with parameters
on the GPU keeps only the optimizer state off the GPU, streamed through it bucket by bucket
(`components/offload/optimizer.py`): the GPU holds about three buckets of it.

Time (per step, per rank; `gpus_per_node` ranks share a node's host memory and NVMe bandwidth):
* optimizer state streamed to the GPU: 8 B/param each way over PCIe (full duplex: the larger way),
  from/to NVMe at the node's read/write rates shared by its ranks; the GPU's own step overlaps it;
* CPUOffloadPolicy: parameters copied to the GPU for each all-gather (4 B/param, forward and the
  backward re-gather), gradients back (reduce dtype); these run on FSDP's streams beside compute, so
  only what exceeds the compute time is exposed; the optimizer step runs on the CPU, bound by host
  memory bandwidth (the 28 B/param of AdamW, the node's bandwidth shared by its ranks);
* nvme parameters: read for each all-gather and for the step, written after it, at the node's rates.
Both are added to the step; `optimizer_s` becomes the offloaded optimizer step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtrain.components.hardware import GPUSpec
from torchtrain.planner.analytic import MemoryEstimate, Row
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.step_time import StepTime

BUCKET_BYTES = 64 * 2**20  # offload.bucket_mb's default
ADAM_STEP_BYTES = 28  # AdamW reads param, grad, m, v and writes param, m, v (fp32)


def active(p: PlanInputs) -> bool:
    return p.cpu_offload or p.offload_optimizer != "none" or p.offload_params != "none"


@dataclass
class TierRow:
    component: str
    gpu: float
    cpu: float
    nvme: float


@dataclass
class OffloadPlan:
    rows: list[TierRow]
    """Bytes per rank of each component in each tier."""
    ranks_per_node: int
    host_capacity: float | None
    nvme_capacity: float | None
    optimizer_s: float
    """The offloaded optimizer step (I/O included)."""
    base_optimizer_s: float
    """The same step without offload (the model's usual GPU step)."""
    exposed_s: float
    """Transfers outside the optimizer step that compute does not hide."""
    notes: list[str] = field(default_factory=list)

    @property
    def host_per_node(self) -> float:
        return self.ranks_per_node * sum(r.cpu for r in self.rows)

    @property
    def nvme_per_node(self) -> float:
        return self.ranks_per_node * sum(r.nvme for r in self.rows)

    @property
    def fits(self) -> bool:
        host_ok = self.host_capacity is None or self.host_per_node <= self.host_capacity
        return host_ok and (self.nvme_capacity is None or self.nvme_per_node <= self.nvme_capacity)


def _state_rows(est: MemoryEstimate) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes of the rank's shard, from the analytic rows."""
    rows = {r.name.split(" (")[0]: r.bytes for rows in est.moments.values() for r in rows}
    return rows.get("parameters", 0.0), rows.get("gradients", 0.0), rows.get("optimizer state", 0.0)


def adjust_memory(est: MemoryEstimate, p: PlanInputs) -> MemoryEstimate:
    """The GPU rows with the optimizer state streamed (parameters on the GPU): the state row becomes
    the working buckets; the peak and its phase are recomputed. Other tiers are already in `est`
    (CPUOffloadPolicy keeps the whole state in host memory: `analytic.estimate_memory`)."""
    if p.offload_optimizer == "none" or p.cpu_offload:
        return est
    _, _, state = _state_rows(est)
    working = min(state, 3.0 * BUCKET_BYTES)
    where = "host memory" if p.offload_optimizer == "cpu" else "NVMe"

    def moved(rows: list[Row]) -> list[Row]:
        return [Row(f"optimizer state: streamed buckets (the rest in {where})", working, "3 x offload.bucket_mb")
                if r.name.startswith("optimizer state") else r for r in rows]

    moments = {k: moved(v) for k, v in est.moments.items()}
    phase, rows = max(moments.items(), key=lambda kv: sum(r.bytes for r in kv[1]))
    others = [(k, sum(r.bytes for r in v)) for k, v in moments.items() if k != phase]
    return dataclasses.replace(est, rows=rows, peak=sum(r.bytes for r in rows), phase=phase, moments=moments,
                               other_phase=max(others, key=lambda x: x[1]) if others else est.other_phase)


def _gbps(value: float | None, efficiency: float) -> float | None:
    return value * 1e9 * efficiency if value else None


def plan_offload(p: PlanInputs, est: MemoryEstimate, step: StepTime) -> OffloadPlan:
    """The tiers, capacities and offload times of layout `p` (its analytic memory `est`, before
    `adjust_memory`: the state rows of a rank)."""
    dev: GPUSpec | None = p.gpu
    per_node = min(p.world_size, dev.gpus_per_node if dev else 1)
    params, grads, state = _state_rows(est)
    if p.cpu_offload:  # the analytic rows of CPUOffloadPolicy are 0 on the GPU; host_bytes holds the three
        n = est.host_bytes / 16.0 if est.host_bytes else 0.0
        params, grads, state = 4 * n, 4 * n, est.host_bytes - 8 * n
    on_nvme = {"params": p.offload_params == "nvme", "state": p.offload_optimizer == "nvme"}
    if p.cpu_offload:
        rows = [TierRow("parameters (fp32 master)", 0.0, 0.0 if on_nvme["params"] else params,
                        params if on_nvme["params"] else 0.0),
                TierRow("gradients", 0.0, grads, 0.0),
                TierRow("optimizer state", 0.0, 0.0 if on_nvme["state"] else state, state if on_nvme["state"] else 0.0)]
    else:
        working = min(state, 3.0 * BUCKET_BYTES) if p.offload_optimizer != "none" else state
        rest = state - working
        rows = [TierRow("parameters (fp32 master)", params, 0.0, 0.0), TierRow("gradients", grads, 0.0, 0.0),
                TierRow("optimizer state", working, rest if p.offload_optimizer == "cpu" else 0.0,
                        rest if on_nvme["state"] else 0.0)]
    notes: list[str] = []
    base_opt = step.optimizer_s or 0.0
    if dev is None or step.step_s is None:
        return OffloadPlan(rows, per_node, None, None, base_opt, base_opt, 0.0, ["no device rates: no offload times"])
    pcie = _gbps(dev.pcie_gbps, dev.pcie_efficiency)
    host_bw = _gbps(dev.host_memory_gbps, dev.memory_efficiency)
    nvme_r, nvme_w = (_gbps(dev.nvme_read_gbps, 1.0), _gbps(dev.nvme_write_gbps, 1.0))
    nvme_r = nvme_r / per_node if nvme_r else None
    nvme_w = nvme_w / per_node if nvme_w else None
    n_params = params / 4.0
    exposed = 0.0
    if p.cpu_offload:
        cpu_step = ADAM_STEP_BYTES * n_params * per_node / host_bw if host_bw else 0.0
        opt = cpu_step
        h2d = 2 * params / pcie if pcie else 0.0  # forward gather + backward re-gather
        d2h = grads / pcie if pcie else 0.0
        transfer = max(h2d, d2h)
        if on_nvme["params"] and nvme_r:
            transfer = max(transfer, 2 * params / nvme_r)
            opt += params / nvme_r + params / nvme_w
        if on_nvme["state"] and nvme_r:
            opt = max(opt, state / nvme_r + state / nvme_w)
        exposed = max(0.0, transfer - (step.compute_s or 0.0))
        notes.append(f"optimizer step on the CPU (FSDP2 CPUOffloadPolicy): {ADAM_STEP_BYTES} B/param at "
                     f"{(host_bw or 0) / 1e9 / per_node:.0f} GB/s of host memory bandwidth per rank")
    else:
        io = state / pcie if pcie else 0.0
        if on_nvme["state"] and nvme_r:  # the drives share reads and writes
            io = max(io, state / nvme_r + state / nvme_w)
        opt = max(base_opt, io) + (min(state, BUCKET_BYTES) / pcie if pcie else 0.0)  # + the first bucket's read
    host_cap = dev.host_memory_gib * 2**30 if dev.host_memory_gib else None
    nvme_cap = dev.nvme_gib * 2**30 if dev.nvme_gib else None
    return OffloadPlan(rows, per_node, host_cap, nvme_cap, opt, base_opt, exposed, notes)


def with_offload_time(step: StepTime, off: OffloadPlan) -> StepTime:
    """The step time with the offloaded optimizer step and the exposed transfers."""
    if step.step_s is None:
        return step
    step_s = step.step_s - (step.optimizer_s or 0.0) + off.optimizer_s + off.exposed_s
    out = dataclasses.replace(step, optimizer_s=off.optimizer_s, step_s=step_s,
                              comm_s={**step.comm_s, **({"offload transfers": off.exposed_s} if off.exposed_s else {})})
    if step.tokens_per_s:
        scale = step.step_s / step_s
        out.tokens_per_s = step.tokens_per_s * scale
        out.effective_mfu = step.effective_mfu * scale if step.effective_mfu is not None else None
        for name in ("train_s", "gpu_hours", "cost", "gpu_hours_with_interruptions", "cost_with_interruptions"):
            value = getattr(step, name)
            if value is not None:
                setattr(out, name, value / scale)
    return out


def format_offload(off: OffloadPlan, base: StepTime, step: StepTime) -> list[str]:
    gib = 2**30
    lines = ["Offload: model state per rank by tier (GiB)",
             f"  {'component':<32} {'GPU':>9} {'CPU':>9} {'NVMe':>9}"]
    for r in off.rows:
        lines.append(f"  {r.component:<32} {r.gpu / gib:>9.2f} {r.cpu / gib:>9.2f} {r.nvme / gib:>9.2f}")
    cap = lambda c: f"{c / gib:,.0f} GiB" if c else "unknown"  # noqa: E731
    lines.append(f"  per node ({off.ranks_per_node} ranks): host memory {off.host_per_node / gib:,.1f} of "
                 f"{cap(off.host_capacity)}, NVMe {off.nvme_per_node / gib:,.1f} of {cap(off.nvme_capacity)}"
                 + ("" if off.fits else "  -> DOES NOT FIT the node"))
    if base.step_s is not None and step.step_s is not None:
        lines.append(f"  optimizer step {off.optimizer_s:,.2f} s (without offload {off.base_optimizer_s:,.2f} s, "
                     f"x{off.optimizer_s / max(off.base_optimizer_s, 1e-12):,.1f}); whole step {step.step_s:,.2f} s "
                     f"(without offload {base.step_s:,.2f} s, +{step.step_s / base.step_s - 1:.0%})")
    lines += [f"  - {n}" for n in off.notes]
    return lines
