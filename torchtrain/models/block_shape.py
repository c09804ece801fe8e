"""One block as its family's parallel plan sees it (`Block`): its TP plan, the modules that plan names with their
widths, its experts and its token mixer; from these it derives its matmuls (`Matmul`, with how parallelism splits
each), its per-rank parameter shapes and the collectives it issues per micro-batch. The model contract
(`contract.py`) and the vision encoder's (`vision_contract.py`) are built of these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torchtrain.models import collectives as coll
from torchtrain.models.block_modules import Module, matmul_kind, tp_collectives
from torchtrain.models.collectives import AttentionShape, BlockCollective, Dispatch, LinearAttentionShape, MoEShape
from torchtrain.models.common.tp import LocalShards


@dataclass(frozen=True)
class Matmul:
    """One weight matmul of a block: `tokens x in_features @ in_features x out_features`."""

    name: str
    in_features: int
    out_features: int
    kind: str
    """How parallelism splits it: "column" (output features over tp, tokens gathered over the
    sequence), "row" (input features over tp), "local" (whole weight on this rank's sequence shard: an
    MoE router, shared experts, MLA's latent projections), "expert" (one routed expert, applied to
    top-k routed tokens; experts split over ep)."""

    @property
    def attention(self) -> bool:
        return self.name.startswith("attention.")


def memoized(obj, name: str, key: tuple, compute: Callable[[], list]) -> list:
    """`compute()` once per (frozen `obj`, name, key): the planner asks a contract the same questions
    for every layout of a search."""
    memo = obj.__dict__.setdefault("_memo", {})
    if (name, key) not in memo:
        memo[(name, key)] = compute()
    return memo[(name, key)]


@dataclass(frozen=True)
class FeedForwardBytes:
    """What a dense feed-forward kind moves and keeps per token, in multiples of d F (d: bytes of an activation
    element, F: its hidden width), for the planner's memory (`block_memory.py`). The default is the SwiGLU's."""

    stored: float = 4.0
    """Kept for backward without checkpointing (SwiGLU: w1 out, silu(w1 out), w3 out, their product)."""
    op_kept: float = 2.0
    """Kept under selective "op" checkpointing: its hidden-wide matmul outputs (SwiGLU: w1's and w3's)."""
    eager: float = 5.0
    """Forward memory traffic of its element-wise kernels, eager (SwiGLU: silu, read and written; the product)."""
    compiled: float = 3.0
    """The same compiled into one kernel (SwiGLU: read w1's and w3's outputs, write the product)."""


SWIGLU = FeedForwardBytes()
"""The SwiGLU's figures: a dense block's default, and every MoE expert's."""


@dataclass(frozen=True)
class Block:
    """One block as its family's plan sees it."""

    plan: dict[str, object]
    """The block's TP plan (module name relative to the block -> style), as `apply_tp` applies it."""
    modules: dict[str, Module]
    """Every module the plan names, and every other parameter-holding module of the block."""
    moe: MoEShape | None = None
    dim: int = 0
    fused: tuple[tuple[str, ...], ...] = ()
    """Groups of the block's matmuls (one input, weights concatenated) that its modules run as one GEMM
    where the layout says so (`Layout.fused_qkv`): `matmuls(fused=True)` gives each group as one."""
    linear: LinearAttentionShape | None = None
    """The block's token mixer is linear attention of this shape (None: softmax attention)."""
    feed_forward: FeedForwardBytes = SWIGLU
    """Its dense feed-forward's kind, as the planner's memory sees it (a SwiGLU unless the family says otherwise)."""

    def matmuls(self, fused: bool = False) -> list[Matmul]:
        return list(memoized(self, "matmuls", (fused,), lambda: self._matmuls(fused)))

    def _matmuls(self, fused: bool) -> list[Matmul]:
        out = [Matmul(name, m.in_features, m.out_features, matmul_kind(self.plan.get(name)))
               for name, m in self.modules.items() if m.linear]
        for group in self.fused if fused else ():
            members = [m for m in out if m.name in group]
            first = out.index(members[0])
            out = [m for m in out if m.name not in group]
            out.insert(first, Matmul("+".join(group), members[0].in_features, sum(m.out_features for m in members),
                                     members[0].kind))
        if self.moe is not None:
            h, H = self.dim, self.moe.hidden
            out += [Matmul("experts.w1", h, H, "expert"), Matmul("experts.w3", h, H, "expert"),
                    Matmul("experts.w2", H, h, "expert")]
        return out

    def params(self, tp: int, ep: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(TP-local (rows, cols) of the block's parameters but the routed experts', those of its
        routed experts on one EP rank)."""
        return memoized(self, "params", (tp, ep), lambda: self._params(tp, ep))

    def _params(self, tp: int, ep: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        dense = []
        for name, m in self.modules.items():
            style = self.plan.get(name)
            kind = matmul_kind(style) if tp > 1 else "local"
            rows = kind == "column" or (tp > 1 and isinstance(style, LocalShards))  # LocalShards: split on dim 0
            for r, c in m.params:  # (a row-parallel layer's bias, (out, 1), is replicated)
                dense.append((r // tp, c) if rows else (r, c // tp) if kind == "row" and c > 1 else (r, c))
        if self.moe is None:
            return dense, []
        local, h, H = self.moe.num_experts // ep, self.dim, self.moe.hidden
        return dense, [(local * H, h), (local * h, H), (local * H, h)]

    def collectives(self, tp: int, cp: int, ep: int, att: AttentionShape,
                    dispatch: Dispatch = Dispatch()) -> list[BlockCollective]:
        return list(memoized(self, "collectives", (tp, cp, ep, att, dispatch),
                          lambda: self._collectives(tp, cp, ep, att, dispatch)))

    def _collectives(self, tp: int, cp: int, ep: int, att: AttentionShape,
                     dispatch: Dispatch) -> list[BlockCollective]:
        cp_own = coll.cp_collectives(att, tp, cp) if self.linear is None else \
            coll.cp_linear_collectives(self.linear, tp, cp)
        out = tp_collectives(self.plan, self.modules, tp) + cp_own
        return out + (coll.ep_collectives(self.moe, self.dim, tp, ep, dispatch) if self.moe is not None else [])
