"""The model's parameter tensors per FSDP unit as the planner sees them (memory, FSDP traffic), from
what the model's family declares (`models/contract.py`: each block's modules with their TP split,
which blocks have experts, multi-token-prediction depths, tied embeddings). The time model reads each
block's matmuls, attention and collectives from the same declaration (`PlanInputs.model`).
"""

from __future__ import annotations

import math

from torchtrain.models.contract import ModelContract


# ------------------------------------------------------------------------------ parameter shapes
def block_shapes(a: ModelContract, tp: int, ep: int, moe: bool = True) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(TP-local shapes of a block's FSDP unit, shapes of its experts unit on one EP rank); `moe`
    False: the model's dense block (a family with some dense blocks)."""
    block = a.moe_block if moe and a.moe_block is not None else a.dense
    return block.params(tp, ep)


def unit_shapes(a: ModelContract, stages, tp: int, ep: int = 1) -> list[tuple[str, list[tuple[int, int]]]]:
    """FSDP units in forward order with the TP-local (rows, cols) of each parameter tensor (an MoE
    block's experts are a unit of their own, "experts i", before their block)."""
    block, experts = block_shapes(a, tp, ep)
    dense_block, _ = block_shapes(a, tp, ep, moe=False)
    table = (math.ceil(a.vocab_size / tp), a.dim)
    units: list[tuple[str, list[tuple[int, int]]]] = []
    tied = a.tie_word_embeddings
    for s in stages:
        if s.first and not tied:
            units.append(("embedding", [table]))
        for i in s.layers:
            moe_here = experts and a.is_moe_layer(i)
            if moe_here:
                units.append((f"experts {i}", list(experts)))
            units.append((f"block {i}", list(block if moe_here else dense_block)))
        depth = a.mtp_depth if s.last else 0  # multi-token prediction on the last stage
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
