"""The model's shapes as the planner sees them: parameter tensors per FSDP unit (memory, FSDP traffic)
and each block's matmuls and attention (the time model). This is the one place the planner reads a
model family's structure; everything else works on what it returns.

A family states its block in its model arguments, or gets the Llama-family default derived from
`dim`, `n_heads`, `head_dim`, `kv_heads`, the feed-forward size and the MoE fields:

* `planner_matmuls(self) -> list[Matmul]`: one block's weight matmuls, with how tensor and expert
  parallelism split them (`Matmul.kind`);
* `planner_attention(self) -> AttentionShape`: heads and the query/key and value head sizes (MLA has
  different ones);
* `planner_block_params(self, tp) -> [(rows, cols)]`: the TP-local shapes of a block's attention and
  norms (for memory and FSDP traffic);
* `is_moe_layer(self, i) -> bool`: whether block i has experts (DeepSeek-V3's first blocks are dense);
* `mtp_depth`: multi-token-prediction depths, each a block (index n_layers + k) with its projection and
  norms on the last stage, which then also holds a copy of the embedding.

Both are optional; a block with other structure (say latent attention's low-rank projections)
supplies them and the time model needs nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Matmul:
    """One weight matmul of a block: `tokens x in_features @ in_features x out_features`."""

    name: str
    in_features: int
    out_features: int
    kind: str
    """How parallelism splits it: "column" (output features over tp, tokens gathered over the
    sequence: wq/wk/wv, w1/w3), "row" (input features over tp: wo, w2), "local" (whole weight on
    this rank's sequence shard: an MoE router, shared experts), "expert" (one routed expert, applied to
    top-k routed tokens; experts split over ep)."""


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    qk_head_dim: int
    v_head_dim: int
    kv_heads: int


# ------------------------------------------------------------------------------ parameter shapes
def ffn_dim(a) -> int:
    """The dense SwiGLU hidden size (Llama 3: ffn_hidden_dim; Qwen3: hidden_dim)."""
    return getattr(a, "ffn_hidden_dim", None) or a.hidden_dim


def ffn_matmul_params(a, active: bool = True) -> int:
    """Matmul parameters of one block's feed-forward: dense 3 h F; MoE: router, shared and the routed
    experts one token uses (active) or all of them."""
    if getattr(a, "num_experts", 0):
        total, used = a.moe_params(a.dim)
        return used if active else total
    return 3 * a.dim * ffn_dim(a)


def block_shapes(a, tp: int, ep: int, moe: bool = True) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(TP-local shapes of a block's FSDP unit, shapes of its experts unit on one EP rank); `moe`
    False: the model's dense block (a family with some dense blocks)."""
    if hasattr(a, "planner_block_params"):
        attn = list(a.planner_block_params(tp))
    else:
        hd, kv = a.head_dim, a.kv_heads
        attn = [(a.n_heads * hd // tp, a.dim), (kv * hd // tp, a.dim), (kv * hd // tp, a.dim),
                (a.dim, a.n_heads * hd // tp), (a.dim, 1), (a.dim, 1)]
    experts = getattr(a, "num_experts", 0) if moe else 0
    if not experts:
        F = ffn_dim(a)
        return attn + [(F // tp, a.dim), (a.dim, F // tp), (F // tp, a.dim)], []
    H, local, shared = a.moe_intermediate_size, experts // ep, a.moe_intermediate_size * a.num_shared_experts
    dense = attn + [(experts, a.dim)] + ([(shared, a.dim), (a.dim, shared), (shared, a.dim)] if shared else [])
    return dense, [(local * H, a.dim), (local * a.dim, H), (local * H, a.dim)]


def unit_shapes(a, stages, tp: int, ep: int = 1) -> list[tuple[str, list[tuple[int, int]]]]:
    """FSDP units in forward order with the TP-local (rows, cols) of each parameter tensor (an MoE
    block's experts are a unit of their own, "experts i", before their block)."""
    block, experts = block_shapes(a, tp, ep)
    dense_block, _ = block_shapes(a, tp, ep, moe=False)
    table = (math.ceil(a.vocab_size / tp), a.dim)
    units: list[tuple[str, list[tuple[int, int]]]] = []
    tied = getattr(a, "tie_word_embeddings", False)
    for s in stages:
        if s.first and not tied:
            units.append(("embedding", [table]))
        for i in s.layers:
            moe_here = experts and (not hasattr(a, "is_moe_layer") or a.is_moe_layer(i))
            if moe_here:
                units.append((f"experts {i}", list(experts)))
            units.append((f"block {i}", list(block if moe_here else dense_block)))
        depth = getattr(a, "mtp_depth", 0) if s.last else 0  # multi-token prediction on the last stage
        if depth and not s.first:
            units.append(("embedding (MTP copy)", [table]))
        for k in range(depth):
            moe_here = experts and a.is_moe_layer(a.n_layers + k)
            if moe_here:
                units.append((f"experts mtp {k}", list(experts)))
            own = [(a.dim, 2 * a.dim), (a.dim, 1), (a.dim, 1), (a.dim, 1)]  # eh_proj, enorm, hnorm, norm
            units.append((f"mtp {k}", list(block if moe_here else dense_block) + own))
        if s.last:
            units.append(("norm+output", [(a.dim, 1)] + ([] if tied else [table])))
    if tied:
        units.append(("root (tied embedding)", [table]))
    return units


def numel(shapes, n: int = 1) -> int:
    """Elements of these (rows, cols) tensors, each sharded over n ranks by rows (FSDP2 pads)."""
    return sum(math.ceil(r / n) * c for r, c in shapes)


# ------------------------------------------------------------------------------ the block's work
def matmuls(a) -> list[Matmul]:
    """One block's weight matmuls (the family's `planner_matmuls`, else the Llama-family default)."""
    if hasattr(a, "planner_matmuls"):
        return list(a.planner_matmuls())
    h, hq, hkv = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim
    out = [Matmul("wq", h, hq, "column"), Matmul("wk", h, hkv, "column"), Matmul("wv", h, hkv, "column"),
           Matmul("wo", hq, h, "row")]
    if not getattr(a, "num_experts", 0):
        F = ffn_dim(a)
        return out + [Matmul("w1", h, F, "column"), Matmul("w3", h, F, "column"), Matmul("w2", F, h, "row")]
    H, shared = a.moe_intermediate_size, a.moe_intermediate_size * a.num_shared_experts
    out.append(Matmul("router", h, a.num_experts, "local"))
    if shared:
        out += [Matmul("shared.w1", h, shared, "local"), Matmul("shared.w3", h, shared, "local"),
                Matmul("shared.w2", shared, h, "local")]
    return out + [Matmul("expert.w1", h, H, "expert"), Matmul("expert.w3", h, H, "expert"),
                  Matmul("expert.w2", H, h, "expert")]


def attention(a) -> AttentionShape:
    """The block's attention heads (the family's `planner_attention`, else n_heads x head_dim)."""
    if hasattr(a, "planner_attention"):
        return a.planner_attention()
    return AttentionShape(a.n_heads, a.head_dim, a.head_dim, a.kv_heads)


def is_moe(a) -> bool:
    return bool(getattr(a, "num_experts", 0))
