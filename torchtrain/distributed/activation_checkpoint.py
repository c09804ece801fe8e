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
  again during the recomputation, so both passes take the same decisions); in a compiled block, where
  the hooks run while Dynamo traces rather than when the policy is asked, by the module stack Dynamo
  records for each traced operator.

**Compiled blocks, option "op": stand-ins.** A compiled block's forward and backward are one joint graph
that Inductor's partitioner splits, saving only what backward reads. The queries and keys attention
receives are the projections' outputs rotated (RoPE) and cast back to the compute dtype; under "op"
backward rebuilds them from the saved projection outputs (read q, k; write them rotated) before attention's
backward. Where nothing else in backward reads those projection outputs -- plain grouped-query attention:
RoPE's backward needs only the angles, the projections' weight gradients need their input --, saving the
rotated queries and keys instead costs no memory (the same bytes: the partitioner then drops the
projection outputs) and skips that rebuild; likewise, when the q/k/v projections run fused (`fuse_qkv`),
the contiguous copy of the values (otherwise the fused output, queries and keys included, stays saved for
it). A block's attention declares it with `checkpoint_stand_ins` (`models/common/transformer.py::
GQAttention`, unless it has query/key norms, whose backward reads the projection outputs); the rule applies
only while compiling (an eager block would keep both). Values are unchanged: what backward reads is the
forward's own tensor instead of a recomputation of it.
"""

from __future__ import annotations

import torch
import torch._guards
import torch.fx.traceback
import torch.utils.checkpoint as _checkpoint_module
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtrain.config import ConfigError
from torchtrain.models.common.transformer import GQAttention

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


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _tracing() -> bool:
    """Inside torch.compile's tracing of a graph (`torch.compiler.is_compiling` is not set during
    AOTAutograd's trace on every supported torch; the tracing context is)."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


def _rotated(op, args, kwargs) -> bool:
    """The rotated queries or keys cast back to the compute dtype: a 4-d float32 tensor cast to 16 bits."""
    if op is not torch.ops.aten._to_copy.default:
        return False
    x = args[0]
    return x.dim() >= 4 and x.dtype == torch.float32 and kwargs.get("dtype") in _LOW_PRECISION


def _values_copy(op, args, kwargs) -> bool:
    """The values' contiguous copy out of the fused projection's output: a copy of a 3-d tensor."""
    return op is torch.ops.aten.clone.default and args[0].dim() == 3


def _context_fn(traced_policy, eager_policy):
    """A checkpoint's context function choosing, once per checkpointed call, the policy for a compiled graph's
    trace or for an eager run. (A plain function: Dynamo takes no other callable as `context_fn`.)"""
    def context():
        return create_selective_checkpoint_contexts(traced_policy if _tracing() else eager_policy)
    return context


def _stand_ins_policy(kinds: tuple[str, ...]):
    """Selective "op" with the stand-ins `kinds` ("rotated", "values") also saved (module doc)."""
    rules = [{"rotated": _rotated, "values": _values_copy}[k] for k in kinds]

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _SAVE_OPS or any(rule(op, args, kwargs) for rule in rules):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def stand_ins(block: nn.Module) -> tuple[str, ...]:
    """What the block's attention lets a compiled "op" checkpoint save for its projections' outputs
    (`checkpoint_stand_ins`): the rotated queries and keys, and the values' copy when its projections
    are fused; () when it declares none."""
    for m in block.modules():
        if isinstance(m, GQAttention) and m.checkpoint_stand_ins:
            return ("rotated", "values") if m.fuse_qkv else ("rotated",)
    return ()


class _CheapScope:
    """Whether the running operator is inside one of the block's declared cheap modules: eagerly, how deep
    the forward is inside them (forward hooks); while compiling, the module stack Dynamo recorded for the
    traced operator (hooks run when Dynamo traces, not when the policy is asked)."""

    def __init__(self, block: nn.Module, names: tuple[str, ...]):
        self.depth = 0
        self.suffixes = tuple("." + name for name in names)
        for m in cheap_modules(block, names):
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._leave)

    def _enter(self, module, args) -> None:
        if not torch.compiler.is_compiling():  # (traced, the count would be a side effect Dynamo refuses
            self.depth += 1                     # inside a checkpoint; the policy reads the module stack)

    def _leave(self, module, args, output) -> None:
        if not torch.compiler.is_compiling():
            self.depth -= 1

    def _traced_inside(self) -> bool:
        stack = (torch.fx.traceback.get_current_meta() or {}).get("nn_module_stack") or {}
        return any(path.endswith(self.suffixes) for path, *_ in stack.values())

    @staticmethod
    def _policy(inside: bool, op) -> CheckpointPolicy:
        if inside:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS or op in _SAVE_COMM_OPS else \
            CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self):
        """The checkpoint's context function: the module stack while tracing, the hooks' depth eagerly."""
        return _context_fn(lambda ctx, op, *args, **kwargs: self._policy(self._traced_inside(), op),
                           lambda ctx, op, *args, **kwargs: self._policy(self.depth > 0, op))


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
        kinds = stand_ins(block)
        context = _context_fn(_stand_ins_policy(kinds), _save_matmuls_policy) if kinds else _op_selective_context
        return checkpoint_wrapper(block, context_fn=context, preserve_rng_state=False)
    if mode == "selective" and option == "cheap":
        return checkpoint_wrapper(block, context_fn=_CheapScope(block, cheap).context_fn(), preserve_rng_state=False)
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


__all__ = ["OP_LEVEL_OPTIONS", "apply_activation_checkpointing", "cheap_modules", "stand_ins", "wrap_block"]
