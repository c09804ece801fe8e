"""Step time, tokens/s, time to train a token budget, GPU-hours and cost -- a documented simple model.

    model FLOPs/token   F_m = model_args.flops_per_token(seq_len)    (6 N + attention; what MFU counts)
    recompute/token     F_r = forward FLOPs of the blocks AC recomputes (full: every checkpointed
                        block's forward, 2 N_block + 4 h s; selective "op": the matmuls it does not
                        save -- wk, wo, w3 -- 2 (h h_kv + h h + h F) per block)
    compute time        T_c = tokens/step x (F_m + F_r) / world / (peak x kernel MFU)
    pipeline            T_p = T_c / (1 - bubble)     (bubble replayed from the real schedule: `pipeline.py`)
    communication       ring volumes per rank, at the GPU's intra-node bandwidth when the group fits
                        in a node, else its inter-node bandwidth:
                        * TP (sequence parallel): 8 collectives of t h d x (tp-1)/tp bytes per block
                          per micro-batch (2 all-gathers + 2 reduce-scatters, forward and backward),
                          not overlapped;
                        * CP: per block and micro-batch, keys and values all-gathered in forward
                          and their gradients reduce-scattered in backward (again in forward when
                          AC recomputes the block): 2 x 2 t h_kv d (cp-1) / tp bytes, not overlapped
                          (t: the rank's tokens, seq_len / cp per sequence);
                        * FSDP (over dp_shard x cp): all-gather d x params (forward, and again in backward unless
                          reshard is "never") per micro-batch, reduce-scatter r x params per step,
                          x (N-1)/N; HSDP adds an all-reduce 2 r params/N x (R-1)/R; DDP/ZeRO an
                          all-reduce 2 r params x (dp-1)/dp. Overlapped with compute: only the part
                          longer than T_c is exposed, plus one unit's gather and reduce-scatter;
                        * PP: activations t h d sent forward and back per micro-batch, not overlapped;
                        * EP (MoE): the dispatch and combine all-to-alls, 4 k h d x (ep-1)/ep bytes
                          per routed token and MoE block (forward and backward; x 1.5 with full AC,
                          which repeats the forward's two), over the EP group, not overlapped
                          (`distributed/expert_parallel.py`). Expert weights' FSDP traffic uses
                          the expert-FSDP group (dp_shard / dp_shard_in_ep ranks).
    step time           T = T_p + exposed communication
    effective MFU       tokens/step x F_m / world / T / peak

The kernel MFU (default 40%, `--mfu`) is the efficiency of the computation itself; everything the
layout adds (bubble, recomputation, exposed communication) is on top, so layouts compare fairly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchtrain.tools.planner.inputs import PlanInputs
from torchtrain.tools.planner.pipeline import pipeline_of


@dataclass
class Throughput:
    flops_per_token: float
    recompute_flops_per_token: float
    tokens_per_step: int
    peak_tflops: float | None
    bubble: float
    compute_s: float | None = None
    comm_s: dict[str, float] = field(default_factory=dict)
    step_s: float | None = None
    tokens_per_s: float | None = None
    effective_mfu: float | None = None
    expert_all_to_all_bytes: float = 0.0
    """Bytes one rank sends through the expert-parallel all-to-alls per step (0 without EP)."""
    budget_tokens: float = 0.0
    steps: int = 0
    train_s: float | None = None
    gpu_hours: float | None = None
    cost: float | None = None


def recompute_flops_per_token(p: PlanInputs) -> float:
    from torchtrain.tools.planner.analytic import ffn_matmul_params

    a = p.args
    hkv, hq = a.kv_heads * a.head_dim, a.n_heads * a.head_dim
    ffn = ffn_matmul_params(a)  # an MoE block: the routed experts one token uses (+ router, shared)
    block_matmul = 2 * a.dim * hq + 2 * a.dim * hkv + ffn
    block_fwd = 2 * block_matmul + 4 * hq * p.seq_len
    if p.ac_mode == "full":
        return a.n_layers * block_fwd
    if p.ac_mode == "selective":
        if p.ac_option == "op":
            return a.n_layers * 2 * (a.dim * hkv + a.dim * hq + ffn / 3)
        return (a.n_layers // int(p.ac_option)) * block_fwd
    return 0.0


def expert_all_to_all_bytes(p: PlanInputs) -> float:
    """Bytes one rank sends through the EP all-to-alls per step (see the module doc)."""
    a = p.args
    if p.ep == 1 or not p.num_experts:
        return 0.0
    blocks = sum(len(s.layers) for s in pipeline_of(p).stages[0])
    tokens = p.microbatch_tokens / p.tp * p.grad_accum_steps * p.n_microbatches  # routed on this rank
    per_token = 4 * a.num_experts_per_tok * a.dim * p.param_bytes * (p.ep - 1) / p.ep
    return per_token * tokens * blocks * (1.5 if p.ac_mode == "full" else 1.0)


def peak_tflops(p: PlanInputs, override: float | None = None) -> float | None:
    if override is not None:
        return override
    if p.gpu is None:
        return None
    if p.param_dtype == "float32":
        return p.gpu.fp32_tflops
    return p.gpu.bf16_tflops


def _bandwidth(p: PlanInputs, group_span: int) -> float | None:
    """GB/s of a group whose ranks span `group_span` consecutive ranks."""
    if p.gpu is None:
        return None
    bw = p.gpu.intra_node_gbps if group_span <= p.gpu.gpus_per_node else p.gpu.inter_node_gbps
    return bw * 1e9 if bw else None


def kv_exchange_bytes(p: PlanInputs) -> float:
    """Context parallelism: bytes one rank receives (all-gather of keys and values in forward, again
    when AC recomputes the block) and sends (reduce-scatter of their gradients in backward) per block
    and micro-batch (`distributed/context_parallel.py`)."""
    if p.cp == 1:
        return 0.0
    a = p.args
    once = 2 * p.microbatch_tokens * a.kv_heads * a.head_dim * p.param_bytes * (p.cp - 1) / p.tp
    forwards = 2 if p.ac_mode == "full" else 1
    return once * (forwards + 1)


def communication(p: PlanInputs, compute_s: float) -> dict[str, float]:
    """Exposed communication seconds per step, by kind (see the module docstring)."""
    a, d, r = p.args, p.param_bytes, p.reduce_bytes
    from torchtrain.tools.planner.analytic import _numel, _unit_shapes

    stages = list(pipeline_of(p).stages[0])
    units = _unit_shapes(a, stages, p.tp, p.ep)
    numel = _numel([s for _, sh in units for s in sh])
    expert_numel = _numel([s for name, sh in units if name.startswith("experts") for s in sh])
    biggest_unit = max(_numel(sh) for _, sh in units)
    blocks = sum(len(s.layers) for s in stages)
    passes = p.grad_accum_steps * p.n_microbatches  # forward passes per step on one rank
    t = p.microbatch_tokens
    out: dict[str, float] = {}
    if p.tp > 1:
        bw = _bandwidth(p, p.tp)
        if bw:
            out["tensor parallel"] = 8 * t * a.dim * d * (p.tp - 1) / p.tp * blocks * passes / bw
    if p.cp > 1:
        bw = _bandwidth(p, p.cp * p.tp)
        if bw:
            out["context parallel"] = kv_exchange_bytes(p) * blocks * passes / bw
    dp_s = dp_s_floor = 0.0
    n_fsdp = p.fsdp_degree
    if p.sharded and n_fsdp > 1:
        bw = _bandwidth(p, n_fsdp * p.tp)
        gathers = 1 if p.reshard == "never" else 2
        ring = (n_fsdp - 1) / n_fsdp
        if bw:
            if p.ep > 1:  # expert weights travel within their expert-FSDP group only
                expert_ring = (p.expert_fsdp - 1) / p.expert_fsdp
                dp_s += (gathers * d * passes + r) * ((numel - expert_numel) * ring + expert_numel * expert_ring) / bw
            else:
                dp_s += (gathers * d * numel * passes + r * numel) * ring / bw
            dp_s_floor = (d + r) * biggest_unit * ring / bw
        if p.dp_replicate > 1:
            bw2 = _bandwidth(p, p.dp_replicate * n_fsdp * p.tp)
            if bw2:
                dp_s += 2 * r * numel / n_fsdp * (p.dp_replicate - 1) / p.dp_replicate / bw2
    elif p.dp > 1:
        bw = _bandwidth(p, p.dp * p.tp)
        if bw:
            dp_s += 2 * r * numel * (p.dp - 1) / p.dp / bw
            dp_s_floor = r * biggest_unit / bw
    if dp_s:
        out["data parallel"] = max(0.0, dp_s - compute_s) + dp_s_floor
    if p.pp > 1:
        bw = _bandwidth(p, p.world_size)
        if bw:
            out["pipeline p2p"] = 2 * t * a.dim * d * passes / bw
    a2a = expert_all_to_all_bytes(p)
    if a2a:
        bw = _bandwidth(p, p.ep)  # the EP group: dp_shard_in_ep x tp neighbouring ranks
        if bw:
            out["expert all-to-all"] = a2a / bw
    return out


def estimate_throughput(p: PlanInputs, peak_override: float | None = None) -> Throughput:
    a = p.args
    f_model = float(a.flops_per_token(p.seq_len))
    f_rec = recompute_flops_per_token(p)
    tokens = p.global_batch_size * p.seq_len
    peak = peak_tflops(p, peak_override)
    bubble = pipeline_of(p).bubble
    out = Throughput(f_model, f_rec, tokens, peak, bubble, expert_all_to_all_bytes=expert_all_to_all_bytes(p),
                     budget_tokens=p.token_budget)
    out.steps = math.ceil(out.budget_tokens / tokens)
    if not peak:
        return out
    out.compute_s = tokens * (f_model + f_rec) / p.world_size / (peak * 1e12 * p.mfu)
    out.comm_s = communication(p, out.compute_s)
    out.step_s = out.compute_s / (1 - bubble) + sum(out.comm_s.values())
    out.tokens_per_s = tokens / out.step_s
    out.effective_mfu = tokens * f_model / p.world_size / out.step_s / (peak * 1e12)
    out.train_s = out.steps * out.step_s
    out.gpu_hours = out.train_s / 3600 * p.world_size
    out.cost = out.gpu_hours * p.price
    return out
