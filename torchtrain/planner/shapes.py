"""The model's parameter tensors per FSDP unit as the planner sees them (memory, FSDP traffic), from
what the model's family declares (`models/contract.py`: each block's modules with their TP split,
which blocks have experts or linear attention -- `ModelContract.layer_block` --, multi-token-prediction
depths, tied embeddings, a vision encoder's blocks and rest on the stage that holds it). The time
model reads each block's matmuls, attention and collectives from the same declaration (`PlanInputs.model`).

With LoRA ([lora]) each targeted linear layer also holds its adapter, A (r x in) and B (out x r), in
the unit of its layer; the targets are the declared linear modules whose full names
(`layers.{i}.attention.wq`, `output`) the job's patterns select (`models/converters/lora.py::is_target`, the
trainer's own rule). Adapters are the only trainable parameters then (`adapter_units`); under tensor
parallelism each follows its base weight's split.
"""

from __future__ import annotations

import math

from torchtrain.config.lora import Lora
from torchtrain.models.contract import ModelContract, matmul_kind
from torchtrain.models.converters.lora import is_target
from torchtrain.planner.pipeline import ENCODER


# ------------------------------------------------------------------------------ parameter shapes
def block_shapes(a: ModelContract, i: int, tp: int, ep: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(TP-local shapes of block i's FSDP unit, shapes of its experts unit on one EP rank: [] without)."""
    return a.layer_block(i).params(tp, ep)


def unit_shapes(a: ModelContract, stages, tp: int, ep: int = 1,
                lora: Lora | None = None) -> list[tuple[str, list[tuple[int, int]]]]:
    """FSDP units in forward order with the TP-local (rows, cols) of each parameter tensor (an MoE
    block's experts are a unit of their own, "experts i", before their block); with `lora`, each
    unit's adapters after its own parameters."""
    units = _base_units(a, stages, tp, ep)
    if lora is None:
        return units
    adapters = dict(adapter_units(a, stages, lora, tp))
    return [(name, shapes + adapters.get(name, [])) for name, shapes in units]


def adapter_units(a: ModelContract, stages, lora: Lora, tp: int = 1) -> list[tuple[str, list[tuple[int, int]]]]:
    """The LoRA adapters' TP-local (rows, cols) per FSDP unit (units without adapters left out): A
    (r x in) and B (out x r) of every declared linear module the patterns select (module doc). Under
    TP they follow the base weight (`models/converters/lora.py`): a column-parallel layer's B holds out / tp
    rows, a row-parallel layer's A in / tp columns, the other factor is replicated."""
    r = lora.rank
    out = []
    for s in stages:
        for i in s.layers:
            block = a.layer_block(i)
            shapes = []
            for name, m in block.modules.items():
                if m.linear and is_target(f"layers.{i}.{name}", lora):
                    kind = matmul_kind(block.plan.get(name))
                    cols = math.ceil(m.in_features / tp) if kind == "row" else m.in_features
                    rows = math.ceil(m.out_features / tp) if kind == "column" else m.out_features
                    shapes += [(r, cols), (rows, r)]
            if shapes:
                out.append((f"block {i}", shapes))
        if s.last and not a.tie_word_embeddings and is_target("output", lora):  # the head: column-parallel
            out.append(("norm+output", [(r, a.dim), (math.ceil(a.vocab_size / tp), r)]))
    return out


def _base_units(a: ModelContract, stages, tp: int, ep: int) -> list[tuple[str, list[tuple[int, int]]]]:
    table = (math.ceil(a.vocab_size / tp), a.dim)
    units: list[tuple[str, list[tuple[int, int]]]] = []
    tied = a.tie_word_embeddings
    for s in stages:
        if a.vision is not None and s.holds(ENCODER):  # FSDP units: each encoder block, then the encoder's rest
            units += [(f"vision block {k}", list(a.vision.block.params(tp, 1)[0])) for k in range(a.vision.depth)]
            units.append(("vision encoder", list(a.vision.rest.params(tp, 1)[0])))
        if s.first and not tied:
            units.append(("embedding", [table]))
        for i in s.layers:
            block, experts = block_shapes(a, i, tp, ep)
            if experts:
                units.append((f"experts {i}", list(experts)))
            units.append((f"block {i}", list(block)))
        depth = a.mtp_depth if s.last else 0  # multi-token prediction on the last stage
        if depth and not s.first:
            units.append(("embedding (MTP copy)", [table]))
        for k in range(depth):
            block, experts = block_shapes(a, a.n_layers + k, tp, ep)
            if experts:
                units.append((f"experts mtp {k}", list(experts)))
            own = [(a.dim, 2 * a.dim), (a.dim, 1), (a.dim, 1), (a.dim, 1)]  # eh_proj, enorm, hnorm, norm
            units.append((f"mtp {k}", list(block) + own))
        if s.last:
            units.append(("norm+output", [(a.dim, 1)] + ([] if tied else [table])))
    if tied:
        units.append(("root (tied embedding)", [table]))
    return units


def numel(shapes, n: int = 1) -> int:
    """Elements of these (rows, cols) tensors, each sharded over n ranks by rows (FSDP2 pads)."""
    return sum(math.ceil(r / n) * c for r, c in shapes)
