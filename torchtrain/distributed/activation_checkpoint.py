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
* `selective`, "cheap": as "op", but the modules the model declares cheap to recompute
  (`ModelSpec.cheap_to_recompute`: DeepSeek-V3's RMSNorms and MLA up-projections) are recomputed
  whole, matmuls included, and the expert all-to-all outputs are saved (never re-sent): only the
  latents before the up-projections are stored, not the much wider queries, keys and values.
  Which module an operator runs in is tracked by forward hooks on the declared modules (they run
  again during the recomputation, so both passes take the same decisions).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as _checkpoint_module
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtrain.config import ConfigError

# Operators whose outputs selective "op" checkpointing saves instead of recomputing: every matmul --
# plain, float8 (`_scaled_mm`, torchao's Float8Linear), grouped (the MoE experts, bf16 and float8) -- and
# attention; and the whole-tensor maxima float8 scaling takes (torchao's amax: one number each, so
# saving them costs nothing and spares the recomputation a reduction over every activation).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten.max.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
} | {getattr(torch.ops.aten, name).default for name in ("_grouped_mm", "_scaled_grouped_mm")
     if hasattr(torch.ops.aten, name)}  # (newer operators: absent from some torch builds)


# Profiler ranges are not computation: FSDP opens more of them while recomputing a block whose experts
# are an FSDP unit of their own (expert parallelism) than in its forward, and selective checkpointing
# would otherwise count them as ops and refuse the recomputation as "different" ("invocation index N
# encountered during backward but not found in storage"). It ignores them as it ignores detach.
_checkpoint_module.SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                                           torch.ops.profiler._record_function_exit.default,
                                           torch.ops.profiler._record_function_exit._RecordFunction})


# Expert-parallel row exchanges, saved under "cheap" so the recomputation does not send them again.
_SAVE_COMM_OPS = {
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional.wait_tensor.default,
}

# The selective options that keep every block and choose operator by operator.
OP_LEVEL_OPTIONS = ("op", "cheap")


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


class _CheapScope:
    """Counts how deep the running forward is inside the block's declared cheap modules (hooks)."""

    def __init__(self, modules: list[nn.Module]):
        self.depth = 0
        for m in modules:
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._leave)

    def _enter(self, module, args) -> None:
        self.depth += 1

    def _leave(self, module, args, output) -> None:
        self.depth -= 1

    def policy(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if self.depth > 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS or op in _SAVE_COMM_OPS else \
            CheckpointPolicy.PREFER_RECOMPUTE

    def context(self):
        return create_selective_checkpoint_contexts(self.policy)


def cheap_modules(block: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The block's modules among `names` (a name whose module this block lacks or holds as None --
    e.g. full-rank queries without `attention.q_norm` -- is skipped)."""
    out = []
    for name in names:
        try:
            m = block.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(m, nn.Module):
            out.append(m)
    return out


def wrap_block(block: nn.Module, mode: str, option: str, layer_id: int, cheap: tuple[str, ...] = ()) -> nn.Module:
    """The block, checkpoint-wrapped as the mode asks (or unchanged); `cheap`: the model's modules cheap
    to recompute (option "cheap")."""
    if mode == "none":
        return block
    if mode == "full" or (mode == "selective" and option not in OP_LEVEL_OPTIONS and layer_id % int(option) == 0):
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if mode == "selective" and option == "op":
        return checkpoint_wrapper(block, context_fn=_op_selective_context, preserve_rng_state=False)
    if mode == "selective" and option == "cheap":
        scope = _CheapScope(cheap_modules(block, cheap))
        return checkpoint_wrapper(block, context_fn=scope.context, preserve_rng_state=False)
    return block


def apply_activation_checkpointing(blocks: nn.Module, mode: str, option: str, cheap: tuple[str, ...] = ()) -> None:
    """Wrap the blocks of `blocks` (an nn.ModuleDict keyed by global block index, or an nn.ModuleList)
    in place; "every N-th block" counts by that index, so a pipeline stage wraps the same blocks as a
    whole model would. `cheap`: the model's `ModelSpec.cheap_to_recompute` (needed by option "cheap")."""
    if mode == "selective" and option == "cheap" and not cheap:
        raise ConfigError('[activation_checkpoint.selective_ac_option] "cheap": this model declares no modules '
                          'cheap to recompute (ModelSpec.cheap_to_recompute); use "op" or a block interval')
    for key, block in list(blocks.named_children()):
        setattr(blocks, key, wrap_block(block, mode, option, int(key), cheap))


__all__ = ["OP_LEVEL_OPTIONS", "apply_activation_checkpointing", "cheap_modules", "wrap_block"]
