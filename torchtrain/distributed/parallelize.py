"""From a model on the meta device to this rank's parallelised, materialised, initialised model parts.

`apply_parallelism(model, spec, layout)` is the one place that turns a Layout into wrappers, for any
model. It applies, in this fixed order:

0. **model converters**: float8 training swaps nn.Linear for torchao's Float8Linear
   (`models/converters/float8.py`, when `layout.float8` says so) and wraps the selected MoE experts' weights for float8
   grouped GEMMs (when `layout.float8_experts` says so), so that every wrapper below sees the float8 layers;
   attention modules that can fuse their q/k/v projections (a `fuse_qkv` attribute) do so where
   `layout.fused_qkv` says;
1. **tensor parallelism**: the model's own plan (`spec.tp_plan`) over the "tp" mesh dimension, plus
   async TP when the layout asks for it;
2. **context parallelism**: the model's attention modules become their sequence-sharded version over
   the "cp" mesh dimension (`context_parallel.py`; models whose spec says `context_parallel`);
3. **expert parallelism** (MoE models): every `GroupedExperts` module's experts split over the "ep"
   mesh, with the all-to-all dispatch and combine around it (`expert_parallel.py`);
4. **activation checkpointing** per block (`spec.blocks`, and an encoder's `spec.encoder_blocks`), as the
   layout's mode/option say;
5. **compile** per block (identical blocks share one compiled graph; an encoder's blocks with dynamic
   lengths), and the modules the model names in `spec.compile_also` (its final norm) when there is no TP;
6. **data parallelism**: FSDP2 / HSDP `fully_shard` of the model's units (`spec.fsdp_units`, default
   each block) over dp_shard x cp, with the layout's mixed-precision, reshard and offload policies --
   under EP each experts module first becomes its own unit over the expert-FSDP mesh; or DDP
   (`replicate`) for replicated strategies; or nothing (one rank in float32).

The order matters: float8 conversion comes first so that every wrapper sees the float8 layers (a
`Float8Linear` is an `nn.Linear`); TP must see the `nn.Linear` modules unwrapped; CP swaps modules inside the blocks before they
are wrapped; checkpoint wrappers must sit inside the compiled region so the recomputation is compiled
too; FSDP must wrap last so that it shards the DTensors TP made (2-D FSDP x TP) and its hooks see the
checkpointed, compiled blocks. A model therefore supplies
only what is its own (see `models/registry.py::ModelSpec`); every strategy, precision, AC mode and
compile setting comes from here.

`build_model_parts` builds the model on the meta device, cuts this rank's pipeline stages out of it
(or keeps it whole), applies the above to each part, then materialises and initialises them with
layout-independent values (`param_init.py`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from torchtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtrain.distributed.compile import compile_blocks, compile_modules
from torchtrain.distributed.context_parallel import apply_context_parallel
from torchtrain.distributed.data_parallel import apply_ddp
from torchtrain.distributed.expert_parallel import apply_expert_parallel
from torchtrain.distributed.fsdp import apply_fsdp
from torchtrain.distributed.layout import Layout
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.distributed.tensor_parallel import enable_async_tp
from torchtrain.distributed.token_dispatch import install_dispatchers
from torchtrain.models.base import BaseModelArgs
from torchtrain.models.common.experts import GroupedExperts
from torchtrain.models.common.parallel import keep_modules
from torchtrain.models.common.transformer import GQAttention
from torchtrain.models.converters.float8 import convert_experts, convert_linears
from torchtrain.models.converters.lora import apply_lora, tp_plan_with_adapters
from torchtrain.models.registry import ModelSpec
from torchtrain.utils.parameters import parameter_places


def _beside(model: nn.Module, blocks: nn.Module) -> list[nn.Module]:
    """The modules beside the blocks: the model's children but the one holding the blocks, whose own
    children are taken the same way (the blocks may sit deeper, e.g. `model.layers` of a transformers model)."""
    out = []
    for child in model.children():
        if child is blocks:
            continue
        if any(m is blocks for m in child.modules()):
            out += _beside(child, blocks)
        else:
            out.append(child)
    return out


def materialize_async_output(module: nn.Module, inputs, output):
    """Under TP, a sequence-parallel output (e.g. the embedding's reduce-scatter) arrives as an
    AsyncCollectiveTensor (a lazily waited tensor subclass). Hand compiled blocks a plain tensor:
    given the subclass as input, they send its gradient past the subclass's autograd node (wrong
    gradients, or a crash in DTensor's redistribute backward; seen on torch 2.13 with gloo). The
    clone is one (batch, seq/tp, dim) copy, only when such a tensor appears."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def apply_parallelism(model: nn.Module, spec: ModelSpec, layout: Layout, frozen: bool = False) -> nn.Module:
    """Apply the model's own adaptations -> LoRA adapters -> converters -> TP -> CP -> EP -> AC -> compile ->
    FSDP/HSDP/DDP to `model` in place, as `layout` decides. `frozen`: a model that never trains (a preference
    loss's reference copy): no DDP wrapper (it has no gradients to synchronise; its replicas stay equal)."""
    dims = layout.dims
    if spec.adapt is not None:
        spec.adapt(model, layout)
    if layout.lora is not None:
        apply_lora(model, layout.lora)
    if layout.float8 is not None:
        convert_linears(model, layout.float8)
    if layout.float8_experts is not None:
        convert_experts(model, layout.float8_experts)
    for module in model.modules():
        if isinstance(module, GQAttention):  # (the attention that can run its q/k/v projections as one GEMM)
            module.fuse_qkv = layout.fused_qkv
    blocks = spec.blocks_of(model)
    if dims.tp_enabled:
        tp_mesh = dims.world_mesh["tp"]
        if layout.lora is not None:
            tp_plan_with_adapters(model, tp_mesh, lambda m: spec.tp_plan(m, tp_mesh, layout.loss_parallel))
        else:
            spec.tp_plan(model, tp_mesh, layout.loss_parallel)
        if layout.async_tp:
            enable_async_tp(tp_mesh)
    if dims.cp_enabled:
        apply_context_parallel(model, dims.cp_mesh, layout.cp_balanced)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if dims.ep_enabled:
        apply_expert_parallel(experts, dims.ep_mesh)
        install_dispatchers(experts, dims.ep_mesh, grad_scale=dims.dp_shard_in_ep, comm=layout.expert_comm)
    apply_activation_checkpointing(blocks, layout.ac_mode, layout.ac_option, spec.cheap_to_recompute)
    encoder = spec.encoder_blocks_of(model)
    if encoder is not None:  # the encoder declares no cheap modules: its selective option falls back to "op"
        apply_activation_checkpointing(encoder, layout.ac_mode, "op" if layout.ac_option == "cheap" else
                                       layout.ac_option)
    if layout.compile_model:
        compile_blocks(blocks, with_collectives=dims.tp_enabled or dims.cp_enabled or dims.ep_enabled,
                       fullgraph=spec.compile_fullgraph and not experts)
        if encoder is not None:  # packed images of any count and size: one graph for every length
            compile_blocks(encoder, with_collectives=dims.tp_enabled, fullgraph=False, dynamic=True)
        compile_modules(compiled_beside_blocks(model, spec, dims.tp_enabled))
        if dims.tp_enabled:  # what feeds the blocks (embedding, ...) runs eagerly: see the hook's doc
            for module in _beside(model, blocks):
                module.register_forward_hook(materialize_async_output)
    if layout.ddp:
        if not frozen:
            apply_ddp(model, dims.dp_mesh)
    elif layout.fsdp:
        units = spec.fsdp_units(model) if spec.fsdp_units is not None else list(blocks.children())
        apply_fsdp(model, dims.fsdp_mesh, units, param_dtype=layout.param_dtype, reduce_dtype=layout.reduce_dtype,
                   reshard_after_forward=layout.reshard_after_forward, cpu_offload=layout.cpu_offload,
                   expert_units=experts if dims.ep_enabled else (),
                   expert_mesh=dims.expert_fsdp_mesh if dims.ep_enabled else None)
    return model


def compiled_beside_blocks(model: nn.Module, spec: ModelSpec, tp_enabled: bool) -> list[nn.Module]:
    """The modules a compiling job compiles besides its blocks (each block is compiled): those the model
    names in `spec.compile_also` (its final norm), not under TP, where they carry the plan's
    redistribution hooks and stay eager. Read by the planner too (`planner/compiled.py`)."""
    if tp_enabled:
        return []
    return spec.compiled_also_of(model)


def materialize(part: nn.Module, device: torch.device, cpu_offload: bool, seed: int,
                loaded: bool = False) -> nn.Module:
    """Allocate a meta-device part on its device and initialise it (values independent of the layout).
    Under CPU offload the sharded state lives in host memory and the buffers (RoPE tables) on the GPU.
    A parameter several modules hold (tied embeddings) stays one parameter. `loaded`: every base weight
    is loaded right after (`init_model_weights`)."""
    shared = [places for _, places in parameter_places([part]) if len(places) > 1]
    part.to_empty(device="cpu" if cpu_offload else device)
    for (first, first_name), *others in shared:
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    if cpu_offload:
        for module in part.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)
    init_model_weights(part, seed, loaded)
    return part.train()


def stage_parts(whole: nn.Module, layout: Layout) -> list[tuple[int, nn.Module]]:
    """(stage index, module) of this rank's pipeline stages, cut from `whole` (or the whole model)."""
    split, dims = layout.pipeline, layout.dims
    if split is None:
        return [(0, whole)]
    return [(s, keep_modules(whole, split.modules_per_stage[s])) for s in split.stage_ids(dims.pp_rank, dims.pp)]


def build_model_parts(spec: ModelSpec, args: BaseModelArgs, layout: Layout, device: torch.device,
                      seed: int, loaded: bool = False, frozen: bool = False) -> list[nn.Module]:
    """This rank's model parts (one, or one per pipeline stage it runs), parallelised and initialised
    (`loaded`: every base weight is loaded right after, `init_model_weights`; `frozen`: see `apply_parallelism`)."""
    with torch.device("meta"):
        whole = spec.build(args)
    return [materialize(apply_parallelism(part, spec, layout, frozen), device, layout.cpu_offload, seed, loaded)
            for _, part in stage_parts(whole, layout)]
