"""Tensor parallelism (Megatron-style) with sequence parallelism, via DTensor parallelize plans.

For a block y = x + W_o attn(W_qkv norm(x)) with tp ranks:

* column-parallel W_q, W_k, W_v (and W_1, W_3): each rank holds n_heads / tp heads (ffn / tp
  hidden units) and computes them from the full input; no communication;
* row-parallel W_o (and W_2): each rank multiplies its slice of heads / hidden units and the partial
  sums are reduce-scattered over the sequence dimension;
* sequence parallelism: between blocks, activations (residual stream, norms) are sharded over the
  sequence, so each rank stores 1/tp of them; an all-gather over the sequence precedes the
  column-parallel matmuls.

Per block and direction that is one all-gather and one reduce-scatter of batch x seq x dim for the
attention and the same for the MLP. The output projection is column-parallel over the vocabulary and,
with loss parallel, the cross-entropy runs on vocabulary shards (a max and a sum all-reduced per
token), so the full logits are never gathered.

The model's plan itself is model code (e.g. `models/llama3/parallelize.py`); this module holds the
model-independent pieces, and the plans of the parts the decoder families share by module name:
`apply_decoder_top` (embedding, final norm, output head), `gqa_attention_plan` (W_q/W_k/W_v/W_o and
the block's norms) and `swiglu_plan` (a dense feed-forward).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.torch_version import TorchVersion

from torchtrain.config.fields import ConfigError


class GatherForLocalHeads(ParallelStyle):
    """A module's first input, sharded over the sequence (`Shard(1)`), gathered whole for this rank's heads.

    Forward: an all-gather over the sequence, handed on as a plain tensor. Its consumers are this rank's
    heads only (e.g. MLA's RoPE key, shared by all heads and expanded to the local ones), so each rank's
    gradient is a partial sum over its heads: the backward reduce-scatters it back into sequence shards.
    (`PrepareModuleInput(..., use_local_output=True)` would treat that gradient as replicated and cut it
    locally, dropping the other ranks' heads.)
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module, inputs):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            whole = x.redistribute(device_mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
            return (whole, *inputs[1:])

        module.register_forward_pre_hook(gather)
        return module


class SequenceFirstLinear(SequenceParallel):
    """A linear layer with replicated weights on each rank's sequence shard, computed sequence-first.

    `SequenceParallel` on a linear layer hands `F.linear` a [batch, seq / tp, in] DTensor, which it flattens
    to [batch x seq / tp, in]: a DTensor sharded on the second of the flattened dimensions, which torch
    before 2.13 cannot flatten ("Attempted to flatten multiple dimensions, with dimension 1 being
    sharded"). Here the input is transposed to [seq / tp, batch, in] (sharded on the first dimension,
    which every version flattens) and the output back to [batch, seq / tp, out]; the weights are
    replicated DTensors as under `SequenceParallel` (whose collectives the model contract reads for it:
    one all-reduce of each weight's gradient), so their gradients are summed over the ranks alike.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(_name, mod, mesh):
            for name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(DTensor.from_local(param, mesh, (Replicate(),),
                                                                             run_check=False)))

        def sequence_first(_mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
            elif x.placements != (Shard(1),):
                x = x.redistribute(mesh, (Shard(1),))
            return (x.transpose(0, 1), *inputs[1:])

        def batch_first(_mod, outputs, _mesh):
            return outputs.transpose(0, 1)

        return distribute_module(module, device_mesh, replicate, sequence_first, batch_first)


def sequence_sharded_linear() -> ParallelStyle:
    """The style of a linear layer with replicated weights applied to each rank's sequence shard:
    `SequenceParallel` where torch flattens a DTensor sharded on an inner dimension (2.13 on),
    `SequenceFirstLinear` before."""
    return SequenceParallel() if TorchVersion(torch.__version__) >= "2.13" else SequenceFirstLinear()


def check_divisible(tp: int, sizes: dict[str, int], fixes: dict[str, str] | None = None) -> None:
    """Raise ConfigError naming the first `key` whose size is not divisible by the TP degree."""
    for key, size in sizes.items():
        if size % tp:
            fix = (fixes or {}).get(key, f"choose a tensor_parallel_degree that divides {size}")
            raise ConfigError(
                f"[{key}] {size} is not divisible by parallelism.tensor_parallel_degree {tp}: each TP rank "
                f"must hold an equal share; {fix}"
            )


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Micro-pipelined async TP: Inductor splits matmuls to overlap them with TP collectives, using
    symmetric memory on the TP group (CUDA only; the trainer rejects other cases before start-up)."""
    import warnings

    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    with warnings.catch_warnings():  # needed on torch 2.11, a deprecated no-op later
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


@contextlib.contextmanager
def maybe_loss_parallel(enabled: bool) -> Iterator[None]:
    """Cross-entropy on vocabulary-sharded logits (forward and backward) when enabled."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def apply_decoder_top(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """The embedding (row-parallel into sequence shards), final norm (on sequence shards) and output
    head (column-parallel over the vocabulary; vocabulary-sharded logits with loss parallel) of a
    decoder whose top-level modules are `tok_embeddings`, `norm` and `output` (None on a pipeline
    stage that lacks them)."""
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1),
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    parallelize_module(model, tp_mesh, top)


def gqa_attention_plan() -> dict[str, object]:
    """A block's norms and grouped-query attention `attention.w{q,k,v,o}` (names relative to the block):
    the input gathered over the sequence, heads column-parallel, W_o row-parallel into sequence shards."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }


def swiglu_plan(prefix: str = "feed_forward") -> dict[str, object]:
    """A dense SwiGLU at `prefix`: input gathered over the sequence, W_1/W_3 column-, W_2 row-parallel."""
    return {
        prefix: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{prefix}.w1": ColwiseParallel(),
        f"{prefix}.w2": RowwiseParallel(output_layouts=Shard(1)),
        f"{prefix}.w3": ColwiseParallel(),
    }
