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

* TP, CP and EP, per block and micro-batch: the collectives the model's family declares for its block
  (`models/contract.py`, derived from its TP plan and the generic CP and EP ones), each sized from
  its elements per token, per sequence and fixed. For a Llama block with sequence parallelism that is
  4 collectives of t h d in forward (attention and feed-forward inputs gathered, outputs
  reduce-scattered) and the mirror image in backward, plus the all-reduce of each replicated norm's
  gradient; DeepSeek-V3's latent attention gathers its narrow latents instead of the block's input.
  Each layer's own: a linear-attention layer's CP exchange is its state transforms and convolution
  context (`cp_linear_collectives`) rather than attention's keys and values, a dense layer sends no
  expert all-to-all.
  Forward collectives run again when activation checkpointing re-runs the forward (full, and
  selective "op", whose policy saves matmul outputs, not collectives). The embedding's output and
  the head's input add one forward and one backward collective of t h d each on their stages.
* EP, by link class: the dispatcher the job selects (`parallelism.expert_parallel_comm_backend`,
  `models/contract.py::ep_collectives`) decides what crosses the network. With r EP ranks per node
  (`expert_parallel_ranks_per_node`, default the device's GPUs per node), "standard" sends every
  routed copy of a token separately: of the X bytes a rank sends, X (ep - r) / ep leave the node on its
  NIC while X (r - 1) / ep go over NVLink at the same time, so one all-to-all takes
  (n - 1) a + max(inter bytes / B_inter, intra bytes / B_intra). "node_limited" runs two all-to-alls
  one after the other: across the ep / r nodes (one row per selected node, `expected_nodes`) on the
  NIC, then inside the node (k rows) on NVLink. With `expert_parallel_overlap_chunks` C each pass is C
  all-to-alls of 1 / C of the tokens (each paying its latency), and `debug.expert_comm_delay_ms` adds
  its delay to every dispatch and combine that crosses the network, split over the chunks as the
  trainer's simulated link does (a chunk occupies it for 1 / C of the delay) -- how much of that is
  hidden is `expert_overlap.py`'s business.
* PP: per micro-batch and virtual stage, the stage output t h d / tp forward and its gradient back.
* FSDP over N = dp_shard x cp: per unit an all-gather of its parameters (d bytes each; 1 byte for
  float8 linears with `enable_fsdp_float8_all_gather`) and a reduce-scatter of its gradients (r bytes);
  experts over their own expert-FSDP group (FSDP2 on a single rank, which only casts, runs the same
  copies and no collective; the compute copy that replaces it casts every parameter once a step and adds
  every gradient into its float32 one). HSDP adds an all-reduce of the reduced shard over the R
  replicas. DDP and ZeRO-1 all-reduce every gradient over dp; ZeRO-1 also all-gathers the updated fp32
  parameters after the step. FSDP2's copy-in / copy-out around each collective is memory traffic on the
  compute stream (`fsdp_copy_bytes`).

How much of this is hidden behind computation is the schedule's business (`step_time.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.components.hardware import GPUSpec
from torchtrain.models.contract import BlockCollective, LayerKind
from torchtrain.planner import shapes
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.pipeline import pipeline_of


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
def forward_repeats(p: PlanInputs, expert: bool = False) -> float:
    """Forward passes a block's collectives run per micro-batch: 2 when checkpointing re-runs them.
    `expert`: the expert all-to-alls, which selective "cheap" saves instead of sending again."""
    if p.ac_mode == "selective" and p.ac_option == "cheap":
        return 1.0 if expert else 2.0
    if p.ac_mode == "full" or (p.ac_mode == "selective" and p.ac_option == "op"):
        return 2.0
    if p.ac_mode == "selective":
        return 1.0 + 1.0 / int(p.ac_option)
    return 1.0


def _group(p: PlanInputs, mesh: str) -> tuple[int, int]:
    """(ranks, span of consecutive ranks) of a mesh dimension's group."""
    r = p.ep_ranks_per_node
    return {"tp": (p.tp, p.tp), "cp": (p.cp, p.cp * p.tp), "ep": (p.ep, p.ep), "ep_inter": (p.ep // r, p.ep),
            "ep_intra": (r, r)}[mesh]


def _link_class(dev: GPUSpec, inter: bool) -> Link | None:
    """The inter-node (NIC) or intra-node (NVLink) link, whatever the group's span."""
    return link(dev, dev.gpus_per_node + 1 if inter else 1)


def collective_bytes(p: PlanInputs, c: BlockCollective, share: float = 1.0) -> float:
    """Bytes of one of the declared collectives `c` for one micro-batch (module doc of models/contract.py),
    or for `share` of its tokens (an overlap chunk)."""
    t = p.microbatch_tokens * share
    return c.nbytes(t, t * p.cp / p.seq_len, p.param_bytes)


def expert_link_shares(p: PlanInputs, mesh: str) -> tuple[float, float]:
    """(inter-node, intra-node) shares of the bytes a rank hands an expert all-to-all over `mesh` that
    leave it (the rest stay on the rank)."""
    ep, r = p.ep, p.ep_ranks_per_node
    if mesh == "ep_inter":
        return (ep // r - 1) / (ep // r), 0.0
    if mesh == "ep_intra":
        return 0.0, (r - 1) / r
    return ((ep - r) / ep, (r - 1) / ep) if ep > r else (0.0, (ep - 1) / ep)


def _expert_all_to_all(p: PlanInputs, dev: GPUSpec, c: BlockCollective, size: float) -> float:
    """One expert all-to-all of `size` bytes sent by the rank, by link class (module doc)."""
    n, _ = _group(p, c.mesh)
    if c.mesh == "ep" and p.ep <= p.ep_ranks_per_node:
        return all_to_all(n, size, link(dev, p.ep))
    inter_ln, intra_ln = _link_class(dev, True), _link_class(dev, False)
    if c.mesh != "ep":
        return all_to_all(n, size, inter_ln if c.mesh == "ep_inter" else intra_ln)
    if n <= 1 or not size or inter_ln is None:
        return 0.0
    inter, intra = expert_link_shares(p, c.mesh)
    intra_s = size * intra / intra_ln.bytes_per_s if intra_ln is not None else 0.0
    return (n - 1) * inter_ln.latency_s + max(size * inter / inter_ln.bytes_per_s, intra_s)


def collective_seconds(p: PlanInputs, dev: GPUSpec, c: BlockCollective, share: float = 1.0) -> float:
    """Seconds of the `c.count` collectives `c` for one micro-batch (or `share` of its tokens)."""
    n, span = _group(p, c.mesh)
    size = collective_bytes(p, c, share)
    if c.kind == "all_to_all" and c.mesh.startswith("ep"):
        one = _expert_all_to_all(p, dev, c, size)
    elif c.kind == "all_to_all":
        one = all_to_all(n, size, link(dev, span))
    else:
        one = ring(n, size, link(dev, span)) * (2 if c.kind == "all_reduce" else 1)
    return c.count * one


def block_collectives(p: PlanInputs, mesh: str, kind: LayerKind | None = None) -> list[BlockCollective]:
    """The collectives over `mesh` the model declares for one block of `kind` (default: its representative
    block; its plans, `models/contract.py`); "ep": all expert-parallel ones (the node-limited dispatcher's
    "ep_inter" and "ep_intra" included)."""
    kind = kind or p.model.layer_kind()
    return [c for c in kind.collectives(p.tp, p.cp, p.ep, p.dispatch)
            if c.mesh == mesh or (mesh == "ep" and c.mesh.startswith("ep"))]


def _per_block(p: PlanInputs, dev: GPUSpec, mesh: str, kind: LayerKind | None = None) -> tuple[float, float]:
    """(forward seconds including recomputation, backward seconds) of one block's `mesh` collectives."""
    fwd = bwd = 0.0
    for c in block_collectives(p, mesh, kind):
        s = collective_seconds(p, dev, c)
        if c.backward:
            bwd += s
        else:
            fwd += s
    return fwd * forward_repeats(p, mesh.startswith("ep")), bwd


def tp_edge(p: PlanInputs, dev: GPUSpec) -> float:
    """One sequence-parallel all-gather or reduce-scatter of a micro-batch's activations: what the
    embedding's output and the head's input cost each way (`distributed/tensor_parallel.py`'s
    `apply_decoder_top`)."""
    if p.tp == 1:
        return 0.0
    return ring(p.tp, p.microbatch_tokens * p.model.dim * p.param_bytes, link(dev, p.tp))


def tp_block(p: PlanInputs, dev: GPUSpec, kind: LayerKind | None = None) -> tuple[float, float]:
    """(forward collectives' seconds including recomputation, backward collectives' seconds) of one block."""
    return _per_block(p, dev, "tp", kind)


def tp_forward_activations(p: PlanInputs, dev: GPUSpec, kind: LayerKind | None = None) -> list[float]:
    """Seconds of each forward sequence-parallel collective of a block's activations, once (async TP
    overlaps these with the GEMMs they feed)."""
    return [collective_seconds(p, dev, c) / c.count for c in block_collectives(p, "tp", kind)
            if not c.backward and c.per_token for _ in range(c.count)]


def tp_unpaired(p: PlanInputs, dev: GPUSpec, kind: LayerKind | None = None) -> float:
    """Seconds of a block's TP collectives that no GEMM overlaps under async TP (those not sized by the
    tokens, e.g. the replicated norms' gradients), forward ones including recomputation."""
    return sum(collective_seconds(p, dev, c) * (1.0 if c.backward else forward_repeats(p))
               for c in block_collectives(p, "tp", kind) if not c.per_token)


def kv_exchange_bytes(p: PlanInputs) -> float:
    """Context parallelism: bytes one rank receives (keys and values gathered in forward, again when
    recomputed) and sends (their gradients reduce-scattered in backward) per block and micro-batch."""
    return sum(collective_bytes(p, c) * c.count * (p.cp - 1) / p.cp * (1.0 if c.backward else forward_repeats(p))
               for c in block_collectives(p, "cp"))


def expert_link_bytes(p: PlanInputs) -> dict[str, float]:
    """Bytes of routed rows one rank sends through the EP all-to-alls per step (dispatch + combine,
    forward, recomputed forward, backward) over the MoE blocks of its stages, by link class."""
    out = {"inter-node": 0.0, "intra-node": 0.0}
    if p.ep == 1 or p.model.moe is None:
        return out
    passes = p.n_microbatches if p.pp > 1 else p.grad_accum_steps
    for kind, blocks in p.model.kinds(i for s in pipeline_of(p).stages[0] for i in s.layers):
        for c in block_collectives(p, "ep", kind):
            if c.per_token:
                sent = collective_bytes(p, c) * c.count * (1.0 if c.backward else forward_repeats(p, True)) * blocks * passes
                inter, intra = expert_link_shares(p, c.mesh)
                out["inter-node"] += sent * inter
                out["intra-node"] += sent * intra
    return out


def expert_all_to_all_bytes(p: PlanInputs) -> float:
    """Bytes of routed rows one rank sends through the EP all-to-alls per step, all links together."""
    return sum(expert_link_bytes(p).values())


def cp_block(p: PlanInputs, dev: GPUSpec, kind: LayerKind | None = None) -> float:
    """Key/value all-gathers (a linear layer: its state exchange) and their gradients' reduce-scatter for
    one block and micro-batch."""
    return sum(_per_block(p, dev, "cp", kind))


def ep_passes(p: PlanInputs, dev: GPUSpec, kind: LayerKind | None = None) -> tuple[float, float]:
    """(one forward pass's, the backward's) seconds of one MoE block's expert all-to-alls for one
    micro-batch: `ep_overlap_chunks` C all-to-alls of 1 / C of the tokens each, plus the injected delay
    of every dispatch and combine that crosses the network (C chunks of delay / C each; module doc)."""
    chunks, delay = p.ep_overlap_chunks, p.ep_comm_delay_ms / 1e3
    fwd = bwd = 0.0
    for c in block_collectives(p, "ep", kind):
        s = chunks * collective_seconds(p, dev, c, 1.0 / chunks)
        if c.per_token and c.mesh != "ep_intra" and p.ep > 1:
            s += c.count * delay
        if c.backward:
            bwd += s
        else:
            fwd += s
    return fwd, bwd


def ep_block(p: PlanInputs, dev: GPUSpec) -> float:
    """Dispatch and combine all-to-alls of one MoE block for one micro-batch (forward, recompute, backward)."""
    fwd, bwd = ep_passes(p, dev)
    return fwd * forward_repeats(p, True) + bwd


def pp_microbatch(p: PlanInputs, dev: GPUSpec) -> float:
    """One stage boundary's activation send plus its gradient coming back, for one micro-batch."""
    if p.pp == 1:
        return 0.0
    size = p.microbatch_tokens * p.model.dim * p.param_bytes / p.tp
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


def data_parallel(p: PlanInputs, dev: GPUSpec, units: list[tuple[str, list[tuple[int, int]]]],
                  trainable: dict[str, list[tuple[int, int]]] | None = None) -> DataParallelTraffic:
    """The gathers and reductions of this rank's units (see the module docstring); `trainable`: the
    parameters of each unit that get gradients, when not all (LoRA's adapters)."""
    d, r = p.param_bytes, p.reduce_bytes

    def grads(name: str, unit: list[tuple[int, int]]) -> int:
        return shapes.numel(unit if trainable is None else trainable.get(name, []))

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
            g = grads(name, unit)
            reduce = ring(group, g * r, ln)
            if p.dp_replicate > 1:
                reduce += 2 * ring(p.dp_replicate, g * r / group, rep_ln)
            out.reduces.append(reduce)
            out.copy_bytes += count * 2 * d + g * r + count / group * (4 + d) + g / group * 2 * r
    elif p.fsdp_wraps and not p.cpu_offload:  # FSDP2 on one rank (it casts): its copies, no collective
        for name, unit in units:
            out.copy_bytes += shapes.numel(unit) * (3 * d + 4) + grads(name, unit) * 3 * r
    elif p.compute_copy:  # a micro-batch's share of: the compute copy refreshed once a step (read 4, write d)
        # unless the compiled optimizer step writes it; each gradient upcast (read d, write 4), from the
        # second micro-batch on added into float32 (read d, read and write 4), unless kept in the compute dtype
        m = p.grad_accum_steps
        refresh = 0 if p.compiled_optimizer_step else (4 + d) / m
        upcast = 0 if p.grads_in_compute_dtype else d + 4 + 4 * (m - 1) / m
        for name, unit in units:
            out.copy_bytes += shapes.numel(unit) * refresh + grads(name, unit) * upcast
    elif p.dp > 1:
        ln = link(dev, p.dp * p.tp)
        out.reduces = [2 * ring(p.dp, grads(name, unit) * r, ln) for name, unit in units]
        if p.dp_strategy.zero1:
            out.after_step = ring(p.dp, 4 * sum(grads(name, u) for name, u in units), ln)
    return out
