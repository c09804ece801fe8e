"""Preparing the traced model part: pipeline stage cut, activation checkpointing, feature checks.

Until the pipeline and activation-checkpointing features land in the model's own plan, the planner
does both itself, the way torchtitan does: a stage is the Transformer with the blocks it does not own
deleted from `model.layers` (a ModuleDict keyed by global index, so names stay canonical) and
`tok_embeddings` / `norm` / `output` set to None where not owned; AC wraps each block (or every N-th)
in `checkpoint_wrapper`, with op-level selective AC saving every other matmul and attention outputs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from torchtrain.tools.planner.pipeline import Stage


def cut_to_stage(model: nn.Module, stage: Stage) -> nn.Module:
    """Keep only the stage's blocks and ends (the Transformer supports None ends for pipelining)."""
    for key in list(model.layers.keys()):
        if int(key) not in stage.layers:
            del model.layers[key]
    if not stage.first:
        model.tok_embeddings = None
    if not stage.last:
        model.norm = None
        model.output = None
    return model


def _sac_policy():
    """torchtitan-style op-level selective AC: save matmuls (every other one) and attention outputs."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    save = {aten.mm.default, aten.max.default}
    save |= {getattr(aten, n).default for n in names if hasattr(aten, n)}
    if hasattr(torch.ops, "_c10d_functional"):
        save.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func == aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_ac_locally(model: nn.Module, mode: str, option: str) -> None:
    """Wrap blocks for activation checkpointing, as torchtitan does (used until the build's plan does it)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    for n, (key, block) in enumerate(list(model.layers.items()), start=1):
        if mode == "full" or (mode == "selective" and option != "op" and n % int(option) == 0):
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif mode == "selective" and option == "op":
            context = functools.partial(create_selective_checkpoint_contexts, _sac_policy())
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context)


def has_ac(model: nn.Module) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def has_tp(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            return True
    return False
