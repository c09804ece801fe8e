"""Preparing a traced model part: the pipeline stage cut, and checks of what the plan applied.

A stage is the Transformer with the blocks it does not own deleted from `model.layers` (a ModuleDict
keyed by global index, so names stay canonical) and `tok_embeddings` / `norm` / `output` set to None
where not owned -- what `distributed.pipeline.keep_modules` does in the trainer, expressed on the
planner's `Stage` (block indices), which also describes the shortened stages of depth extrapolation.
"""

from __future__ import annotations

from torch import nn

from torchtrain.tools.planner.pipeline import Stage


def cut_to_stage(model: nn.Module, stage: Stage) -> nn.Module:
    """Keep only the stage's blocks and ends (the Transformer supports None ends for pipelining)."""
    for key in list(model.layers.keys()):
        if int(key) not in stage.layers:
            del model.layers[key]
    extra = stage.extra
    for attr, _ in list(model.named_children()):  # other top-level modules: only those the stage lists
        if extra is not None and attr not in ("layers", "tok_embeddings", "norm", "output") and attr not in extra:
            setattr(model, attr, None)
    if not stage.first and "tok_embeddings" not in (extra or ()):
        model.tok_embeddings = None
    if not stage.last:
        model.norm = None
        model.output = None
    return model


def has_ac(model: nn.Module) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def has_tp(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            return True
    return False
