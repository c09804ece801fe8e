"""Preparing a traced model part: the planner's `Stage` as the simulation's `PartCut`, and checks of
what the plan applied.

The cut itself is the trainer's (`models.common.parallel.keep_modules`, by module name, through
`simulation/parts.py`); a `Stage` (block indices, ends, extra modules) also describes the shortened
stages of depth extrapolation, whose model is built with fewer blocks.
"""

from __future__ import annotations

from torch import nn

from torchtrain.planner.pipeline import Stage
from torchtrain.simulation.parts import PartCut


def part_cut(stage: Stage, n_layers: int) -> PartCut:
    """The simulation's cut of a traced stage: its blocks, ends and extra modules by name, the model
    built with just enough blocks to hold them (`n_layers` of the job: the whole model, when it is
    the only stage and keeps everything)."""
    n_built = max(stage.layers) + 1
    if stage.extra is None:  # no pipeline: the whole model, possibly shortened
        return PartCut(stage.index, None, stage.first, stage.last, n_built if n_built != n_layers else None)
    names = [f"layers.{i}" for i in stage.layers]
    names += ["tok_embeddings"] if stage.first else []
    names += list(stage.extra)
    names += ["norm", "output"] if stage.last else []
    return PartCut(stage.index, tuple(dict.fromkeys(names)), stage.first, stage.last, n_built)


def has_ac(model: nn.Module) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def has_tp(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            return True
    return False
