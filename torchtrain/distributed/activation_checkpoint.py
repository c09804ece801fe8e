"""Activation checkpointing: trade recomputation for activation memory.

A transformer block stores many batch x seq x dim activations (inputs of every matmul, norm and
activation function) for backward.
Checkpointing a block keeps only its input and re-runs its forward during backward:

* `full`: every block is checkpointed. Activation memory drops to one block's worth plus the block
  inputs; compute grows by about one forward pass (~33% of a training step).
* `selective`, every N-th block: a middle ground (memory and recompute scale with 1/N).
* `selective`, "op": no block is fully recomputed; inside every block the outputs of matmuls and
  attention (expensive to recompute) are saved and only element-wise work (norms, SiLU, RoPE) is
  recomputed, saving the many element-wise intermediates for little compute.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as _checkpoint_module
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Operators whose outputs selective "op" checkpointing saves instead of recomputing.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


# Profiler ranges are not computation: FSDP opens more of them while recomputing a block whose experts
# are an FSDP unit of their own (expert parallelism) than in its forward, and selective checkpointing
# would otherwise count them as ops and refuse the recomputation as "different" ("invocation index N
# encountered during backward but not found in storage"). It ignores them as it ignores detach.
_checkpoint_module.SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                                           torch.ops.profiler._record_function_exit.default,
                                           torch.ops.profiler._record_function_exit._RecordFunction})


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def wrap_block(block: nn.Module, mode: str, option: str, layer_id: int) -> nn.Module:
    """The block, checkpoint-wrapped as the mode asks (or unchanged)."""
    if mode == "none":
        return block
    if mode == "full" or (mode == "selective" and option != "op" and layer_id % int(option) == 0):
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if mode == "selective" and option == "op":
        return checkpoint_wrapper(block, context_fn=_op_selective_context, preserve_rng_state=False)
    return block


def apply_activation_checkpointing(blocks: nn.Module, mode: str, option: str) -> None:
    """Wrap the blocks of `blocks` (an nn.ModuleDict keyed by global block index, or an nn.ModuleList)
    in place; "every N-th block" counts by that index, so a pipeline stage wraps the same blocks as a
    whole model would."""
    for key, block in list(blocks.named_children()):
        setattr(blocks, key, wrap_block(block, mode, option, int(key)))


__all__ = ["apply_activation_checkpointing", "wrap_block"]
