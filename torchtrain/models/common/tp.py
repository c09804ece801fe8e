"""The tensor-parallel styles and plans that model plans are written with (`models/<family>/parallelize.py`):
the pieces the decoder families share, stated once. The math of Megatron-style TP with sequence
parallelism is in `distributed/tensor_parallel.py`; the applier (`distributed/parallelize.py`) calls a
family's `tp_plan` with the TP mesh.

* styles torch does not have: `GatherForLocalHeads` (a sequence-sharded input gathered for the rank's
  heads, its gradient reduce-scattered back), `SequenceFirstLinear` / `sequence_sharded_linear` (a
  replicated linear layer on sequence shards), `LocalShards` (a module's own parameters split over
  the TP ranks on one dimension, read as plain local tensors by its forward: per-head vectors such as
  attention sinks, a linear-attention layer's gates and its depthwise convolution);
* plans by module name: `apply_decoder_top` (embedding, final norm, output head, and with images their scatter
  and the vision encoder: `vision_encoder_plan`), `gqa_attention_plan`,
  `gated_deltanet_plan` (linear attention), `swiglu_plan`, `moe_tp_plan` (an MoE layer on sequence shards);
* checks: `check_divisible` (a size every TP rank must hold an equal share of), `check_tp_has_ep`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.torch_version import TorchVersion

from torchtrain.config.fields import ConfigError
from torchtrain.models.layout_view import DegreesView


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


class LocalShards(ParallelStyle):
    """A module's own parameters (not its children's) split over the TP ranks on dimension `dim` (`Shard(dim)`
    DTensors: initialisation, checkpoints and FSDP see the global tensors), which its forward reads as plain
    local tensors (`models/common/layers.py::local_tensor`): per-head vectors and per-channel weights whose
    heads or channels the rank's other layers already hold (attention sinks beside column-parallel query
    heads; a linear-attention layer's decay and gate parameters and its depthwise convolution). No input or
    output is redistributed; each rank's gradient is that of its own slice."""

    def __init__(self, dim: int = 0, names: tuple[str, ...] | None = None):
        """`names`: the parameters to split (default: all of the module's own)."""
        super().__init__()
        self.dim, self.names = dim, names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if self.names is not None and name not in self.names:
                continue
            sharded = DTensor.from_local(param.detach().chunk(device_mesh.size(), self.dim)[device_mesh.get_local_rank()],
                                         device_mesh, [Shard(self.dim)], run_check=False, shape=param.shape,
                                         stride=param.stride())
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


def apply_decoder_top(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """The embedding (row-parallel into sequence shards), final norm (on sequence shards) and output
    head (column-parallel over the vocabulary; vocabulary-sharded logits with loss parallel) of a
    `Decoder` (models/common/transformer.py: `tok_embeddings`, `norm` and `output`, None on a pipeline stage
    that lacks them; `vision_encoder` and `image_scatter` where the family sees images)."""
    top: dict[str, object] = {}
    scatter = model.image_scatter is not None
    if model.tok_embeddings is not None:
        # With images, the embedded text stays whole until their features join it (the scatter's output is
        # then cut into sequence shards: a local slice, no communication).
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                output_layouts=Replicate() if scatter else Shard(1))
        if scatter:
            top["image_scatter"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1),
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    parallelize_module(model, tp_mesh, top)
    encoder = model.vision_encoder
    if encoder is not None:
        parallelize_module(encoder, tp_mesh, vision_encoder_plan(list(encoder.layers)))


def vision_encoder_plan(block_names: list[str]) -> dict[str, object]:
    """A vision encoder (`models/common/vision.py`) over replicated packed patches: in each block the q/k/v
    projections and the MLP's first layer column-parallel (a rank holds whole heads), the output projections
    row-parallel back to replicated patches (one all-reduce each); the merger's two layers alike. The patch
    embedding, position table and norms are replicated (their inputs are)."""
    plan: dict[str, object] = {"merger.w1": ColwiseParallel(), "merger.w2": RowwiseParallel()}
    for name in block_names:
        plan.update({f"layers.{name}.attention.w{x}": ColwiseParallel() for x in "qkv"})
        plan.update({f"layers.{name}.attention.wo": RowwiseParallel(), f"layers.{name}.feed_forward.w1": ColwiseParallel(),
                     f"layers.{name}.feed_forward.w2": RowwiseParallel()})
    return plan


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


def gated_deltanet_plan() -> dict[str, object]:
    """A block's norms and Gated DeltaNet linear attention at `attention` (`models/common/linear_attention.py`,
    names relative to the block): the input gathered over the sequence; the q/k/v/z/beta/decay projections
    column-parallel, so a rank holds whole heads (H_k / tp key heads and the H_v / tp value heads they
    serve); the convolutions' channels and the per-head decay parameters split alike (`LocalShards`); the
    gated norm over each head with its shared weight replicated (its gradient summed over the ranks); the
    output projection row-parallel into sequence shards. The delta rule runs on the rank's heads alone: no
    communication inside the layer."""
    plan: dict[str, object] = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        **{f"attention.in_proj_{p}": ColwiseParallel() for p in "qkvzba"},
        **{f"attention.conv_{p}": LocalShards(0) for p in "qkv"},
        "attention.decay": LocalShards(0),
        "attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.out_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    return plan


def swiglu_plan(prefix: str = "feed_forward") -> dict[str, object]:
    """A dense SwiGLU at `prefix`: input gathered over the sequence, W_1/W_3 column-, W_2 row-parallel."""
    return {
        prefix: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{prefix}.w1": ColwiseParallel(),
        f"{prefix}.w2": RowwiseParallel(output_layouts=Shard(1)),
        f"{prefix}.w3": ColwiseParallel(),
    }


def check_tp_has_ep(dims: DegreesView) -> None:
    """Tensor parallelism of an MoE model needs expert parallelism over the TP ranks (ConfigError)."""
    if dims.tp_enabled and not dims.ep_enabled:
        raise ConfigError(
            f"[parallelism.expert_parallel_degree] tensor parallelism (tensor_parallel_degree {dims.tp}) of an MoE "
            f"model needs expert parallelism over the TP ranks: experts are not tensor-parallel, and each TP rank "
            f"routes its own sequence shard; set expert_parallel_degree to a multiple of {dims.tp}")


def moe_tp_plan(prefix: str, shared_experts: bool, shared_gate: bool = False) -> dict[str, object]:
    """TP styles of an MoE layer at `prefix` (relative to its block) with sequence parallelism: the
    layer works on this rank's sequence shard (no gather), the router and shared experts are
    replicated with their gradients summed over the TP ranks (their inputs are the rank's tokens, a
    shard of dim 0), and the per-sequence counts of the auxiliary loss are summed over the shards.
    The routed experts are not tensor-parallel (the EP group contains the TP group)."""
    plan: dict[str, object] = {
        prefix: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                   use_local_output=True),
        f"{prefix}.router": SequenceParallel(sequence_dim=0, use_local_output=True),
        f"{prefix}.sequence_sum": PrepareModuleInput(input_layouts=(Partial(),), desired_input_layouts=(Replicate(),),
                                                     use_local_output=True),
    }
    if shared_experts:  # per Linear: SequenceParallel replicates a module's own parameters only
        for name in ("w1", "w2", "w3"):
            plan[f"{prefix}.shared_experts.{name}"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    if shared_gate:
        plan[f"{prefix}.shared_gate"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return plan
