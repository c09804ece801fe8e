"""Communication time on one rank: each collective from its message size and the link it crosses.

**The link.** Ranks are laid out pp x dp_replicate x dp_shard x cp x tp, tp fastest (the trainer's
mesh, `distributed/parallel_dims.py`), so a group spans `span` consecutive ranks: tp, cp x tp,
dp_shard x cp x tp, and so on. A group inside one node (span <= GPUs per node) runs over NVLink /
Infinity Fabric at `intra_node_gbps` x `intra_node_efficiency` with `intra_node_latency_us` per ring
step; a group across nodes is bound by each GPU's NIC, `inter_node_gbps` x `inter_node_efficiency`,
and `inter_node_latency_us` (the reference systems give every GPU its own NIC, so a ring that leaves
the node runs at the NIC's rate).

**Collectives** (n ranks, B the link's achievable bandwidth, a its per-step latency, S the size of the
whole gathered tensor):

    all-gather, reduce-scatter   (n - 1) (a + S / n / B)
    all-reduce                   2 (n - 1) (a + S / n / B)          (ring: reduce-scatter + all-gather)
    all-to-all (X bytes sent)    (n - 1) a + X (n - 1) / n / B
    point-to-point (X bytes)     a + X / B

**What each parallelism sends** (d compute-dtype bytes, r reduction-dtype bytes, t the micro-batch's
tokens on the rank, h the width):

* TP with sequence parallelism, per block and micro-batch: forward all-gathers the attention and
  feed-forward inputs and reduce-scatters their outputs (4 collectives of S = t h d), backward the
  mirror image (4 more); activation checkpointing that re-runs the forward (full, and selective "op",
  whose policy saves matmul outputs, not collectives) repeats the forward's 4. The embedding's output
  and the head's input add one forward and one backward collective each on their stages.
* CP (all-gather of keys and values, `distributed/context_parallel.py`): per block and micro-batch an
  all-gather of S = 2 (cp t) h_kv d / tp in forward (again when recomputed) and a reduce-scatter of
  its gradient in backward.
* EP: per MoE block and micro-batch, the dispatch and combine all-to-alls, X = (t / tp) k h d each,
  twice in forward (again when recomputed) and twice in backward.
* PP: per micro-batch and virtual stage, the stage output t h d / tp forward and its gradient back.
* FSDP over N = dp_shard x cp: per unit an all-gather of its parameters (d bytes each; 1 byte for
  float8 linears with `enable_fsdp_float8_all_gather`) and a reduce-scatter of its gradients (r bytes);
  experts over their own expert-FSDP group. HSDP adds an all-reduce of the reduced shard over the R
  replicas. DDP and ZeRO-1 all-reduce every gradient over dp; ZeRO-1 also all-gathers the updated fp32
  parameters after the step. FSDP2's copy-in / copy-out around each collective is memory traffic on the
  compute stream (`fsdp_copy_bytes`).

How much of this is hidden behind computation is the schedule's business (`step_time.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.components.hardware import GPUSpec
from torchtrain.tools.planner import shapes
from torchtrain.tools.planner.inputs import PlanInputs
from torchtrain.tools.planner.pipeline import pipeline_of


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float


def link(dev: GPUSpec, span: int) -> Link | None:
    """The link a group spanning `span` consecutive ranks communicates over (None: unknown)."""
    if span <= dev.gpus_per_node:
        gbps, eff, lat = dev.intra_node_gbps, dev.intra_node_efficiency, dev.intra_node_latency_us
    else:
        gbps, eff, lat = dev.inter_node_gbps, dev.inter_node_efficiency, dev.inter_node_latency_us
    if not gbps:
        return None
    return Link(gbps * 1e9 * eff, lat * 1e-6)


def ring(n: int, size: float, ln: Link | None) -> float:
    """All-gather or reduce-scatter of a tensor of `size` bytes (the gathered size) over n ranks."""
    if n <= 1 or not size or ln is None:
        return 0.0
    return (n - 1) * (ln.latency_s + size / n / ln.bytes_per_s)


def all_to_all(n: int, sent: float, ln: Link | None) -> float:
    if n <= 1 or not sent or ln is None:
        return 0.0
    return (n - 1) * ln.latency_s + sent * (n - 1) / n / ln.bytes_per_s


def p2p(size: float, ln: Link | None) -> float:
    return 0.0 if ln is None or not size else ln.latency_s + size / ln.bytes_per_s


# ------------------------------------------------------------------------------ per micro-batch
def _forward_repeats(p: PlanInputs) -> float:
    """Forward passes a block's collectives run per micro-batch: 2 when checkpointing re-runs them."""
    if p.ac_mode == "full" or (p.ac_mode == "selective" and p.ac_option == "op"):
        return 2.0
    if p.ac_mode == "selective":
        return 1.0 + 1.0 / int(p.ac_option)
    return 1.0


def tp_collective(p: PlanInputs, dev: GPUSpec) -> float:
    """One sequence-parallel all-gather or reduce-scatter of a micro-batch's activations."""
    if p.tp == 1:
        return 0.0
    return ring(p.tp, p.microbatch_tokens * p.args.dim * p.param_bytes, link(dev, p.tp))


def tp_block(p: PlanInputs, dev: GPUSpec) -> tuple[float, float]:
    """(forward collectives' seconds including recomputation, backward collectives' seconds) of one block."""
    c = tp_collective(p, dev)
    return 4 * c * _forward_repeats(p), 4 * c


def kv_exchange_bytes(p: PlanInputs) -> float:
    """Context parallelism: bytes one rank receives (keys and values gathered in forward, again when
    recomputed) and sends (their gradients reduce-scattered in backward) per block and micro-batch."""
    if p.cp == 1:
        return 0.0
    att = shapes.attention(p.args)
    once = 2 * p.microbatch_tokens * att.kv_heads * att.qk_head_dim * p.param_bytes * (p.cp - 1) / p.tp
    return once * (_forward_repeats(p) + 1)


def expert_all_to_all_bytes(p: PlanInputs) -> float:
    """Bytes one rank sends through the EP all-to-alls per step (dispatch + combine, forward, recomputed
    forward, backward) over the MoE blocks of its stages."""
    a = p.args
    if p.ep == 1 or not shapes.is_moe(a):
        return 0.0
    blocks = sum(len(s.layers) for s in pipeline_of(p).stages[0])
    passes = p.n_microbatches if p.pp > 1 else p.grad_accum_steps
    per_pass = 2 * p.microbatch_tokens / p.tp * a.num_experts_per_tok * a.dim * p.param_bytes * (p.ep - 1) / p.ep
    return per_pass * (_forward_repeats(p) + 1) * blocks * passes


def cp_block(p: PlanInputs, dev: GPUSpec) -> float:
    """Key/value all-gathers and their gradients' reduce-scatter for one block and micro-batch."""
    if p.cp == 1:
        return 0.0
    att = shapes.attention(p.args)
    size = 2 * p.microbatch_tokens * p.cp * att.kv_heads * att.qk_head_dim * p.param_bytes / p.tp
    one = ring(p.cp, size, link(dev, p.cp * p.tp))
    return one * (_forward_repeats(p) + 1)


def ep_block(p: PlanInputs, dev: GPUSpec) -> float:
    """Dispatch and combine all-to-alls of one MoE block for one micro-batch (forward, recompute, backward)."""
    a = p.args
    if p.ep == 1 or not shapes.is_moe(a):
        return 0.0
    sent = p.microbatch_tokens / p.tp * a.num_experts_per_tok * a.dim * p.param_bytes
    one = all_to_all(p.ep, sent, link(dev, p.ep))
    return 2 * one * (_forward_repeats(p) + 1)


def pp_microbatch(p: PlanInputs, dev: GPUSpec) -> float:
    """One stage boundary's activation send plus its gradient coming back, for one micro-batch."""
    if p.pp == 1:
        return 0.0
    size = p.microbatch_tokens * p.args.dim * p.param_bytes / p.tp
    return 2 * p2p(size, link(dev, p.world_size))


# ------------------------------------------------------------------------------ per step: data parallel
@dataclass
class DataParallelTraffic:
    """Seconds of this rank's data-parallel collectives, unit by unit (forward order)."""

    gathers: list[float]
    """One all-gather of each FSDP unit (empty without FSDP)."""
    reduces: list[float]
    """One gradient reduction of each unit (reduce-scatter, + HSDP's all-reduce), or DDP's buckets."""
    after_step: float = 0.0
    """Collectives after the optimizer step (ZeRO-1's parameter all-gather), never overlapped."""
    copy_bytes: float = 0.0
    """FSDP2's copy-in / copy-out bytes per full all-gather + reduce round (memory traffic)."""


def data_parallel(p: PlanInputs, dev: GPUSpec, units: list[tuple[str, list[tuple[int, int]]]]) -> DataParallelTraffic:
    """The gathers and reductions of this rank's units (see the module docstring)."""
    d, r = p.param_bytes, p.reduce_bytes
    out = DataParallelTraffic([], [])
    fp8_gather = p.float8 and p.float8_all_gather
    if p.sharded and p.fsdp_degree > 1:
        n = p.fsdp_degree
        ln = link(dev, n * p.tp)
        rep_ln = link(dev, p.dp_replicate * n * p.tp)
        for name, unit in units:
            count = shapes.numel(unit)
            group = p.expert_fsdp if name.startswith("experts") and p.ep > 1 else n  # experts: their expert-FSDP group
            gather_bytes = count * d
            if fp8_gather and name.startswith("block"):
                gather_bytes = count * 1  # the float8 linears' weights (norms are negligible)
            out.gathers.append(ring(group, gather_bytes, ln))
            reduce = ring(group, count * r, ln)
            if p.dp_replicate > 1:
                reduce += 2 * ring(p.dp_replicate, count * r / group, rep_ln)
            out.reduces.append(reduce)
            out.copy_bytes += count * (2 * d + r) + count / group * (4 + d + 2 * r)
    elif p.dp > 1:
        ln = link(dev, p.dp * p.tp)
        out.reduces = [2 * ring(p.dp, shapes.numel(unit) * r, ln) for _, unit in units]
        if p.dp_strategy.zero1:
            out.after_step = ring(p.dp, 4 * sum(shapes.numel(u) for _, u in units), ln)
    return out
