"""The collectives a model's block issues per micro-batch (`BlockCollective`), and those of the
generic parallelisms, stated from shapes alone (the tensor-parallel ones are derived from a family's
plan in `models/contract.py`, which re-exports these names).

Expert parallelism (`distributed/expert_parallel.py`) and context parallelism
(`distributed/context_parallel.py`, `distributed/context_parallel_linear.py`) are generic: `ep_collectives`,
`cp_collectives` and `cp_linear_collectives` state them from the MoE, attention and linear-attention shapes; the expert all-to-alls follow the token dispatcher the job selects
(`parallelism.expert_parallel_comm_backend`, `Dispatch`), with group-limited routing's expected node
count (`expected_nodes`) for the node-limited one.

Sizes (`BlockCollective`): elements per token of the rank's micro-batch (t = batch x seq_len / cp,
before sequence parallelism splits it), per sequence, and fixed; for an all-gather or reduce-scatter
the whole gathered tensor, for an all-reduce the tensor, for an all-to-all what the rank sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def causal_pairs(n: float, window: int | None = None) -> float:
    """(query, key) pairs causal attention over n tokens computes, each query seeing at most `window` keys."""
    if window is None or window >= n:
        return n * n / 2
    return window * n - window * window / 2


@dataclass(frozen=True)
class AttentionShape:
    """A block's attention and its FLOPs: the kernel's (the causal pairs it computes) and the families' count."""

    heads: int
    qk_head_dim: int
    v_head_dim: int
    kv_heads: int
    window: int | None = None
    """Keys a query sees, itself included (a sliding window); None: every earlier key."""
    sinks: bool = False
    """A learned sink logit per head joins each query's softmax (one more logit per head and query)."""

    def pairs(self, seq_len: int, span: int | None = None) -> float:
        """(query, key) pairs the kernel computes for one sequence: causal within runs of `span` tokens (a
        block-causal mask's documents; None: the whole sequence), each query seeing at most `window` keys, and one
        sink logit per query with sinks."""
        span = span or seq_len
        return seq_len / span * causal_pairs(span, self.window) + (seq_len if self.sinks else 0)

    def kernel_flops(self, seq_len: int, span: int | None = None, heads: float | None = None) -> float:
        """Forward FLOPs of the attention kernel for one sequence (`pairs`): its two matmuls, d_qk + d_v per pair and
        head, for `heads` heads (default all of them; a tensor-parallel rank's share)."""
        return 2 * self.pairs(seq_len, span) * (self.qk_head_dim + self.v_head_dim) * (
            self.heads if heads is None else heads)

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of the two matmuls over each query's keys as the families count them (without
        the causal halving): 4 x causal pairs per query x heads x (d_qk + d_v)."""
        return 4 * causal_pairs(seq_len, self.window) / seq_len * self.heads * (self.qk_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class LinearAttentionShape:
    """A linear-attention token mixer (Gated DeltaNet, `models/common/linear_attention.py`)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    """Taps of the causal depthwise convolutions over q, k and v."""
    chunk_size: int
    """Tokens per chunk of the chunked kernel (`models/common/delta_rule.py`)."""
    flops_per_token: int = 0
    """The mixer's training FLOPs per token beyond its projections (the family's own count)."""
    float32: bool = True
    """The kernel computes in float32 (torchtrain's chunked and recurrent kernels; flash-linear-attention's
    runs in the compute dtype)."""

    @property
    def conv_channels(self) -> int:
        """Channels the convolutions mix: q and k (key heads) and v (value heads)."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class BlockCollective:
    """Collectives of one kind a block issues per micro-batch (see the module doc for the sizes)."""

    kind: str
    """"all_gather", "reduce_scatter", "all_reduce" or "all_to_all"."""
    mesh: str
    """"tp", "cp" or "ep"; the node-limited dispatcher's "ep_inter" (one rank per node of the EP
    group) and "ep_intra" (the EP ranks of one node)."""
    backward: bool
    """False: issued in forward (again when activation checkpointing re-runs the forward)."""
    per_token: float = 0.0
    per_sequence: float = 0.0
    fixed: float = 0.0
    dtype: str = "compute"
    """"compute" (the parameters' compute dtype), "float32" or "int64"."""
    count: int = 1

    def elements(self, tokens: float, sequences: float) -> float:
        """Elements of one of these collectives."""
        return self.per_token * tokens + self.per_sequence * sequences + self.fixed

    def nbytes(self, tokens: float, sequences: float, compute_bytes: int) -> float:
        size = {"compute": compute_bytes, "float32": 4, "int64": 8}[self.dtype]
        return self.elements(tokens, sequences) * size


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    hidden: int
    """One routed expert's hidden size."""
    shared: int
    """Shared experts (each of the routed hidden size)."""
    n_group: int = 1
    """Group-limited routing: the experts form this many equal groups (1: none)."""
    topk_group: int = 1
    """Groups a token's experts may come from (read when n_group > 1)."""


@dataclass(frozen=True)
class Dispatch:
    """How routed tokens travel to their experts' ranks (`parallelism.expert_parallel_comm_backend`)."""

    backend: str = "standard"
    """"standard": one all-to-all over the EP group, every routed copy sent separately; "node_limited":
    a token crosses to each selected node once and fans out inside it (the combine mirrors it)."""
    ranks_per_node: int = 0
    """EP ranks per node (`parallelism.expert_parallel_ranks_per_node`; 0: the whole group is one node)."""


def _miss(pool: int, own: int, k: int) -> float:
    """Probability that k experts drawn uniformly without replacement from `pool` miss `own` of them."""
    return math.comb(pool - own, k) / math.comb(pool, k) if pool - own >= k else 0.0


def expected_nodes(moe: MoEShape, nodes: int) -> float:
    """Expected distinct nodes a token's top-k experts sit on, with the E experts spread evenly over
    `nodes` nodes and routing taken as uniform (the planner's balanced-routing assumption). With
    group-limited routing (n_group > 1) the k experts come from the token's topk_group groups, which
    bounds the count: a node holding whole groups is reached when one of its selected groups receives an
    expert; a group spanning several nodes sends to each of them that receives one."""
    e, k = moe.num_experts, moe.top_k
    if nodes <= 1:
        return 1.0
    per_node = e // nodes
    if moe.n_group <= 1:
        return nodes * (1.0 - _miss(e, per_node, k))
    g, pool = moe.n_group, moe.topk_group * (e // moe.n_group)
    if g % nodes == 0:  # each node holds g / nodes whole groups; j of them selected (hypergeometric)
        held = g // nodes
        total = math.comb(g, moe.topk_group)
        reach = sum(math.comb(held, j) * math.comb(g - held, moe.topk_group - j) / total
                    * (1.0 - _miss(pool, j * (e // g), k)) for j in range(1, min(held, moe.topk_group) + 1))
        return nodes * reach
    spans = nodes // g if nodes % g == 0 else 1  # nodes per group
    return min(nodes, moe.topk_group * spans) * (1.0 - _miss(pool, per_node, k))


def ep_collectives(moe: MoEShape, dim: int, tp: int, ep: int, dispatch: Dispatch = Dispatch()) -> list[BlockCollective]:
    """An MoE block's expert-parallel collectives (`distributed/expert_parallel.py`): the per-expert
    row counts exchanged (E integers), then the dispatch and combine all-to-alls of each of the rank's
    t / tp tokens, mirrored by their gradients' in backward.

    "standard" (mesh "ep"): each token's k rows of `dim` values go to their experts' ranks in one
    all-to-all. "node_limited" over n = ep / ranks_per_node > 1 nodes: first one all-to-all among the
    ranks of the same local index on each node (mesh "ep_inter"), carrying each token once per node it
    selects (`expected_nodes` rows, its own node's included as the (n - 1) / n of an all-to-all
    discounts), then one inside the node (mesh "ep_intra") fanning the k rows out to the experts' ranks;
    the combine reduces inside the node first and crosses back once."""
    if ep == 1:
        return []
    counts = BlockCollective("all_to_all", "ep", False, fixed=moe.num_experts, dtype="int64")
    rows = moe.top_k * dim / tp
    node = dispatch.ranks_per_node or ep
    if dispatch.backend != "node_limited" or node >= ep:
        return [counts, BlockCollective("all_to_all", "ep", False, per_token=rows, count=2),
                BlockCollective("all_to_all", "ep", True, per_token=rows, count=2)]
    crossing = expected_nodes(moe, ep // node) * dim / tp
    return [counts] + [BlockCollective("all_to_all", mesh, backward, per_token=size, count=2)
                       for backward in (False, True) for mesh, size in (("ep_inter", crossing), ("ep_intra", rows))]


def cp_collectives(att: AttentionShape, tp: int, cp: int) -> list[BlockCollective]:
    """Context parallelism (`distributed/context_parallel.py`): the keys and values of the whole
    sequence (cp t tokens, this rank's kv_heads / tp heads) all-gathered in forward, their gradients
    reduce-scattered in backward."""
    if cp == 1:
        return []
    kv = 2 * att.kv_heads * att.qk_head_dim * cp / tp
    return [BlockCollective("all_gather", "cp", False, per_token=kv),
            BlockCollective("reduce_scatter", "cp", True, per_token=kv)]


def cp_linear_collectives(lin: LinearAttentionShape, tp: int, cp: int) -> list[BlockCollective]:
    """Context parallelism of a linear-attention layer (`distributed/context_parallel_linear.py`), per
    sequence of the rank's micro-batch, with the load-balanced split (2 cp segments a sequence): one
    all-gather of every segment's state transform (this rank's value_heads / tp heads of d_k x (d_k + d_v)
    float32 values) and one of every segment's convolution context (K - 1 tokens of the channels / tp) in
    forward; their gradients reduce-scattered in backward."""
    if cp == 1:
        return []
    segments = 2 * cp
    state = segments * lin.value_heads * lin.key_head_dim * (lin.key_head_dim + lin.value_head_dim) / tp
    conv = segments * (lin.conv_kernel - 1) * lin.conv_channels / tp
    return [BlockCollective(kind, "cp", backward, per_sequence=size, dtype=dtype)
            for backward, kind in ((False, "all_gather"), (True, "reduce_scatter"))
            for size, dtype in ((state, "float32"), (conv, "compute"))]
