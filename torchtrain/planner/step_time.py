"""Step time, tokens/s, MFU and cost of a layout: the schedule that puts compute and communication together.

Read top-down; this module calls `compute_time` (kernels, from shapes and device rates),
`comm_time` (collectives, from message sizes and links) and `pipeline` (the schedule's bubble,
replayed), and nothing calls back.

1. **One micro-batch on one rank** (`_rank_microbatch`): every block of the rank's stages, each kind of
   block (`ModelContract.kinds`: its feed-forward, its token mixer, its attention window) costed once
   and counted (`compute_time.block_time`: GEMMs, attention, memory-bound kernels, recomputation) plus the
   embedding and the head on the first and last stage, plus the collectives that sit on the critical
   path between kernels: tensor-parallel all-gathers / reduce-scatters (with
   `parallelism.enable_async_tensor_parallel` each is hidden behind the GEMM next to it, and only what
   the GEMM cannot cover is exposed), context parallelism's key/value exchange and expert
   parallelism's all-to-alls, of which chunked overlap and DualPipeV's paired micro-batches hide
   what their computation covers (`expert_overlap.py`). A vision-language model's encoder runs the
   micro-batch's images on the stage that holds it (`vision.py`): its compute and TP collectives add to
   that rank's, which may make it the slowest.
2. **The schedule.** Without pipelining a step is `accumulation` micro-batches back to back. With
   pipelining, the slowest pipeline rank sets the pace: m micro-batches of it, stretched by the
   schedule's bubble b (replayed from torch's own schedule, `pipeline.py`): m t / (1 - b), plus the
   point-to-point sends of every micro-batch.
3. **Data parallelism** (`comm_time.data_parallel`) overlaps with computation: FSDP's all-gathers with
   the forward (and, resharding, the backward) of a micro-batch, its reduce-scatters with the last
   micro-batch's backward; only what exceeds that window is exposed, plus the first unit's gather
   (nothing to overlap with yet) and the last unit's reduction (nothing after it). Without
   pipelining, gathers repeat every micro-batch; a pipeline stage keeps its parameters gathered for the
   step (`layout.effective_reshard`), so it gathers once. DDP's all-reduce overlaps the last backward.
   FSDP2's copy-in/out is memory traffic on the compute stream.
4. **The optimizer step** over the rank's shard (memory-bound), and ZeRO-1's parameter all-gather.
5. **The host** (`host_time.py`): the CPU dispatching the step's operators (counted in the traced step)
   and the GPU overlap imperfectly: the step is the larger of the two where one is well ahead, and more
   where they are close (`host_time.step_seconds`).
6. **Interruptions** (`interruptions.py`): the run's wall-clock time, GPU-hours and cost with the
   expected failures, each costing a restart and half a checkpoint interval of steps.

    GPU = schedule + exposed data-parallel communication + optimizer
    step = sqrt(GPU^2 + host dispatch time^2)
    tokens/s = global batch x seq_len / step;  MFU = tokens/s x model FLOPs/token / GPUs / bf16 peak
    (model FLOPs/token: the family's, + the vision encoder's images / seq_len, + a DPO reference's forward)
7. **Preference optimisation** (`preference.py`): a live DPO reference runs one no-grad forward per micro-batch
   before the trained one, its compute, TP collectives and exposed FSDP all-gathers on the critical path (a
   pipelined copy's kept units gathered once per step).

There is no efficiency knob: the rates are the device table's (`components/hardware.py`, overridable
with `--device key=value`). `planner/published_runs.py` checks the result against measured runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchtrain.components.hardware import GPUSpec
from torchtrain.models.contract import LayerKind
from torchtrain.planner import comm_time, compute_time, expert_overlap, preference, shapes, vision
from torchtrain.planner.host_time import HostTime, step_seconds
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.interruptions import Interruptions, expected_interruptions
from torchtrain.planner.pipeline import pipeline_of


@dataclass
class StepTime:
    flops_per_token: float
    """Model FLOPs per token (6N + attention, + a vision encoder's images: what MFU counts)."""
    recompute_flops_per_token: float
    """Forward FLOPs activation checkpointing repeats, per token."""
    tokens_per_step: int
    peak_tflops: float | None
    """The device's dense peak for the compute dtype (bf16 also under float8: MFU's convention)."""
    bubble: float
    device: str = ""
    compute_s: float | None = None
    """Computation on the critical path of the step (the slowest pipeline rank, bubble excluded)."""
    compute_breakdown_s: dict[str, float] = field(default_factory=dict)
    """compute_s by kind: matmuls, attention, memory-bound kernels, recomputation, embedding + head."""
    bubble_s: float | None = None
    comm_s: dict[str, float] = field(default_factory=dict)
    """Exposed communication per kind (tensor parallel, context parallel, expert all-to-all, pipeline
    p2p, data parallel), seconds per step."""
    optimizer_s: float | None = None
    gpu_s: float | None = None
    """The GPU's seconds per step: compute + bubble + exposed communication + optimizer."""
    host_s: float | None = None
    """The host's seconds per step dispatching it (`host_time.py`; None: not known -- no traced step,
    or a device without host costs)."""
    host_breakdown_s: dict[str, float] = field(default_factory=dict)
    host_ops: float | None = None
    """Operators the host dispatches a step (compiled graphs count as one each)."""
    step_s: float | None = None
    """Predicted seconds per step: the GPU's and the host's combined (`host_time.step_seconds`)."""
    tokens_per_s: float | None = None
    effective_mfu: float | None = None
    expert_all_to_all_bytes: float = 0.0
    """Bytes one rank sends through the expert-parallel all-to-alls per step (0 without EP)."""
    expert_link_bytes: dict[str, float] = field(default_factory=dict)
    """The same by link class: "inter-node" (the NIC) and "intra-node" (NVLink)."""
    expert_all_to_all_hidden_s: float = 0.0
    """Expert all-to-all seconds per step hidden behind computation (the exposed ones are in comm_s)."""
    encoder_flops_per_token: float = 0.0
    """The vision encoder's share of flops_per_token: its images' training FLOPs / seq_len (`vision.py`)."""
    reference_flops_per_token: float = 0.0
    """A DPO reference's forward per token, counted in flops_per_token (`preference.py`)."""
    reference_s: float | None = None
    """The DPO reference's forwards in the step (compute, TP collectives, exposed all-gathers)."""
    budget_tokens: float = 0.0
    """The run's token budget (`--tokens`; without it, 20 tokens a parameter: Chinchilla's rule)."""
    steps: int = 0
    """Optimizer steps the budget takes (rounded up)."""
    train_s: float | None = None
    gpu_hours: float | None = None
    cost: float | None = None
    """train_s, gpu_hours, cost: failure-free. With the expected interruptions (`interruptions.py`):"""
    interruptions: Interruptions | None = None
    gpu_hours_with_interruptions: float | None = None
    cost_with_interruptions: float | None = None


def model_flops_per_token(p: PlanInputs, prof) -> float:
    """The family's model FLOPs per token (6 N + attention); under LoRA the frozen weights get no
    weight gradient (4 N) and every adapter parameter costs 6."""
    a = p.model
    flops = float(a.flops(p.seq_len)) + vision.flops_per_token(p)  # the encoder: per image, not in the family's
    if p.lora is None:
        return flops
    stages = [s for rank in prof.stages.values() for s in rank]
    adapters = shapes.numel([s for _, sh in shapes.adapter_units(a, stages, p.lora) for s in sh])
    return flops - a.flops(0) / 3 + 6 * adapters  # flops_per_token(0) = 6 N


def recompute_flops_per_token(p: PlanInputs) -> float:
    """Matmul and attention FLOPs per token that activation checkpointing repeats (memory-bound work is
    counted in time only)."""
    if p.ac_mode not in ("full", "selective"):
        return 0.0
    return _decoder_recompute_flops(p) + vision.recompute_flops_per_token(p)


def _decoder_recompute_flops(p: PlanInputs) -> float:
    a = p.model
    matmul = mixer = cheap = 0.0  # per token, summed over the layers
    for kind, n in a.kinds(range(a.n_layers)):
        mms = kind.block.matmuls()
        matmul += n * 2 * sum(m.in_features * m.out_features * (a.num_experts_per_tok if m.kind == "expert" else 1)
                              for m in mms)
        mixer += n * compute_time.mixer_forward_flops(p, kind)
        cheap += n * 2 * sum(m.in_features * m.out_features for m in mms if m.name in a.cheap_to_recompute)
    if p.ac_mode == "full":
        return matmul + mixer
    if p.ac_option == "op":
        return p.sac_matmul_share * matmul
    if p.ac_option == "cheap":
        return cheap
    return (a.n_layers // int(p.ac_option)) / a.n_layers * (matmul + mixer)


@dataclass
class _Microbatch:
    seconds: float
    forward_s: float
    backward_s: float
    breakdown: dict[str, float]
    comm: dict[str, float]
    ep_hidden: float = 0.0


def stage_blocks(p: PlanInputs, stages) -> list[int]:
    """The blocks of these stages; the multi-token-prediction depths (blocks n_layers + k) with the last."""
    a = p.model
    mtp = range(a.n_layers, a.n_layers + a.mtp_depth) if any(s.last for s in stages) else range(0)
    return [i for s in stages for i in s.layers] + list(mtp)


def _tp_exposed(p: PlanInputs, dev: GPUSpec, kind: LayerKind, block: compute_time.BlockTime) -> tuple[float, float]:
    """(exposed, hidden) seconds of one block's tensor-parallel collectives for one micro-batch."""
    tp_fwd, tp_bwd = comm_time.tp_block(p, dev, kind)
    if not (p.async_tp and p.tp > 1):
        return tp_fwd + tp_bwd, 0.0
    # each activation collective is cut into tp chunks pipelined with the GEMM it feeds (forward) or
    # follows (input gradient): the first chunk waits, the rest hide as far as that GEMM lasts
    once = comm_time.tp_forward_activations(p, dev, kind)
    c, repeats = sum(once) / max(1, len(once)), comm_time.forward_repeats(p)

    def exposed(gemm: float) -> float:
        return c / p.tp + max(0.0, c * (p.tp - 1) / p.tp - gemm)

    pairs = [v for v in block.tp_gemm.values() if v[0]][:len(once)]
    tp_exposed = sum(repeats * exposed(fwd) + exposed(dgrad) for fwd, dgrad in pairs) + \
        comm_time.tp_unpaired(p, dev, kind)
    return tp_exposed, tp_fwd + tp_bwd - tp_exposed


def _rank_microbatch(p: PlanInputs, dev: GPUSpec, times: dict[LayerKind, compute_time.BlockTime], stages,
                     overlapped: float = 0.0) -> _Microbatch:
    """One micro-batch through this rank's stages (step 1 of the module docstring): `times` the seconds
    of one block of each kind."""
    mtp = p.model.mtp_depth * sum(s.last for s in stages)  # MTP depths: one block + head each
    comm = {"tensor parallel": 0.0, "context parallel": 0.0, "expert all-to-all": 0.0}
    breakdown = {"matmuls": 0.0, "attention": 0.0, "memory-bound": 0.0, "recomputation": 0.0}
    hidden = ep_hidden_all = forward = 0.0
    for kind, n in p.model.kinds(stage_blocks(p, stages)):
        block = times[kind]
        tp_exposed, tp_hidden = _tp_exposed(p, dev, kind, block)
        ep_exposed, ep_hidden = expert_overlap.block_all_to_all(p, dev, block, overlapped, kind)
        hidden += n * (tp_hidden + ep_hidden)
        ep_hidden_all += n * ep_hidden
        for key, value in (("tensor parallel", tp_exposed), ("context parallel", comm_time.cp_block(p, dev, kind)),
                           ("expert all-to-all", ep_exposed)):
            comm[key] += n * value
        for key, value in (("matmuls", block.gemm_fwd + block.gemm_bwd), ("attention", block.attn_fwd + block.attn_bwd),
                           ("memory-bound", block.mem_fwd + block.mem_bwd), ("recomputation", block.recompute)):
            breakdown[key] += n * value
        forward += n * (block.gemm_fwd + block.attn_fwd + block.mem_fwd)
    if any(vision.holds_encoder(p, s) for s in stages):  # the micro-batch's images (stage imbalance)
        enc = vision.encoder_time(p, dev)
        breakdown["vision encoder"] = enc.total
        comm["tensor parallel"] += enc.tp_s
        forward += enc.forward
    edges = sum(s.first for s in stages) + sum(s.last for s in stages)
    comm["tensor parallel"] += edges * 2 * comm_time.tp_edge(p, dev)
    breakdown["embedding + head"] = ((sum(s.first for s in stages) + mtp) * compute_time.embedding_seconds(p, dev)
                                     + (sum(s.last for s in stages) + mtp) * compute_time.head_seconds(p, dev))
    if hidden:
        breakdown["slowdown under overlapped communication"] = hidden * dev.comm_sm_share
    compute = sum(breakdown.values())
    return _Microbatch(compute + sum(comm.values()), forward, compute - forward, breakdown, comm, ep_hidden_all)


def _data_parallel_exposed(p: PlanInputs, traffic: comm_time.DataParallelTraffic, mb: _Microbatch,
                           passes: int) -> tuple[float, float]:
    """(exposed, hidden) data-parallel seconds per step (step 3 of the module docstring)."""
    gathers, reduces = traffic.gathers, traffic.reduces
    if not gathers:  # DDP / ZeRO-1: bucketed all-reduce behind the last backward
        total = sum(reduces)
        exposed = max(0.0, total - mb.backward_s) + (reduces[0] if reduces else 0.0)
        return exposed + traffic.after_step, total - min(total, exposed)
    gather = sum(gathers)
    backward_gather = gather if p.reshard != "never" else 0.0
    forward = gathers[0] + max(0.0, gather - mb.forward_s)
    last_backward = max(0.0, backward_gather + sum(reduces) - mb.backward_s) + reduces[0]
    rounds = 1 if p.pp > 1 else passes  # a pipeline stage keeps its parameters gathered for the step
    total = rounds * (gather + backward_gather) + sum(reduces)
    exposed = rounds * forward + (rounds - 1) * max(0.0, backward_gather - mb.backward_s) + last_backward
    return exposed, max(0.0, total - exposed)


def estimate_step(p: PlanInputs, host: HostTime | None = None) -> StepTime:
    """The step time of layout `p` on its device (see the module docstring); no times without a device.
    `host`: the host's dispatch time of the step (`host_time.py`, from the traced step's operators),
    combined with the GPU's time by `host_time.step_seconds`."""
    a = p.model
    tokens = p.global_batch_size * p.seq_len
    prof = pipeline_of(p)
    dev = p.gpu
    peak = dev.matmul_tflops(p.param_dtype) if dev is not None else None
    out = StepTime(model_flops_per_token(p, prof), recompute_flops_per_token(p), tokens, peak, prof.bubble,
                   device=dev.name if dev is not None else "", budget_tokens=p.token_budget,
                   expert_link_bytes=comm_time.expert_link_bytes(p))
    out.expert_all_to_all_bytes = sum(out.expert_link_bytes.values())
    out.encoder_flops_per_token = vision.flops_per_token(p)
    out.reference_flops_per_token = preference.reference_flops_per_token(p)
    out.flops_per_token += out.reference_flops_per_token
    out.steps = math.ceil(out.budget_tokens / tokens)
    if not peak or (dev.hbm_tbps is None and dev.key != "cpu"):
        return out
    times = {kind: compute_time.block_time(p, dev, kind) for kind, _ in a.kinds(range(a.n_layers + a.mtp_depth))}
    per_rank = {r: _rank_microbatch(p, dev, times, prof.stages[r], prof.overlapped.get(r, 0.0))
                for r in _distinct_ranks(prof)}
    slow_rank = max(per_rank, key=lambda r: per_rank[r].seconds)
    mb = per_rank[slow_rank]
    passes = p.n_microbatches if p.pp > 1 else p.grad_accum_steps
    stages = list(prof.stages[slow_rank])
    units = shapes.unit_shapes(a, stages, p.tp, p.ep, p.lora)
    trainable = units if p.lora is None else shapes.adapter_units(a, stages, p.lora, p.tp)  # LoRA: adapters only
    traffic = comm_time.data_parallel(p, dev, units, dict(trainable))
    copies = compute_time.memory_seconds(dev, traffic.copy_bytes) * (1 if p.pp > 1 else passes)
    out.compute_breakdown_s = {k: v * passes for k, v in mb.breakdown.items()}
    if copies:
        out.compute_breakdown_s["FSDP copy-in/out" if not p.compute_copy else "compute copy casts"] = copies
    out.compute_s = sum(out.compute_breakdown_s.values())
    schedule = passes * mb.seconds + copies
    out.bubble_s = schedule * prof.bubble / (1 - prof.bubble) if p.pp > 1 else 0.0
    out.comm_s = {k: v * passes for k, v in mb.comm.items() if v}
    out.expert_all_to_all_hidden_s = mb.ep_hidden * passes
    if p.dpo is not None and p.dpo.live:  # one reference forward before every micro-batch's
        ref = preference.microbatch_time(p, dev, preference.compute_dtype(p))
        out.reference_s = ref.per_step(passes)
        out.compute_breakdown_s["reference forward (DPO)"] = passes * ref.compute_s
        out.compute_s += passes * ref.compute_s
        for key, value in (*((k, passes * v) for k, v in ref.comm_s.items()),
                           ("reference all-gathers (DPO)", passes * ref.gather_s + ref.step_gather_s)):
            if value:
                out.comm_s[key] = out.comm_s.get(key, 0.0) + value
        schedule += out.reference_s
    if p.pp > 1:
        out.comm_s["pipeline p2p"] = passes * prof.stages_per_rank * comm_time.pp_microbatch(p, dev)
    dp, dp_hidden = _data_parallel_exposed(p, traffic, mb, passes)
    if dp:
        out.comm_s["data parallel"] = dp
    if dp_hidden:
        slow = dp_hidden * dev.comm_sm_share
        out.compute_breakdown_s["slowdown under overlapped communication"] = \
            out.compute_breakdown_s.get("slowdown under overlapped communication", 0.0) + slow
        out.compute_s += slow
        schedule += slow
    local_params = sum(shapes.numel(u, _shard_degree(p, name)) for name, u in trainable)
    out.optimizer_s = compute_time.optimizer_seconds(p, dev, local_params)
    out.gpu_s = schedule + out.bubble_s + out.optimizer_s + dp + out.comm_s.get("pipeline p2p", 0.0)
    out.step_s = out.gpu_s
    if host is not None:
        out.host_s, out.host_breakdown_s, out.host_ops = host.seconds, host.breakdown, host.ops
        out.step_s = step_seconds(out.gpu_s, host.seconds)
    out.tokens_per_s = tokens / out.step_s
    out.effective_mfu = tokens * out.flops_per_token / p.world_size / out.step_s / (peak * 1e12)
    out.train_s = out.steps * out.step_s
    out.gpu_hours = out.train_s / 3600 * p.world_size
    out.cost = out.gpu_hours * p.price
    out.interruptions = expected_interruptions(out.train_s, p.world_size, out.step_s, p.checkpoint_interval,
                                               p.failure_rate, p.restart_s)
    if out.interruptions.wall_s is not None:
        out.gpu_hours_with_interruptions = out.interruptions.wall_s / 3600 * p.world_size
        out.cost_with_interruptions = out.gpu_hours_with_interruptions * p.price
    return out


def _shard_degree(p: PlanInputs, unit: str) -> int:
    """Ranks the optimizer state of `unit` is split over."""
    if p.sharded:
        return p.expert_fsdp if unit.startswith("experts") and p.ep > 1 else p.fsdp_degree
    return p.dp if p.dp_strategy.zero1 else 1


def _distinct_ranks(prof) -> list[int]:
    """One pipeline rank per distinct stage structure (the others take the same time)."""
    seen, out = set(), []
    for r, stages in prof.stages.items():
        key = tuple((len(s.layers), s.first, s.last, s.extra) for s in stages)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out
