"""The Llama 3 parallel plan: how this model is sharded. Written in plain Python so a researcher can
read and change it; the trainer only calls `parallelize_llama` (and `validate_llama_parallel` before
start-up).

Order: tensor parallelism -> activation checkpointing -> compile -> data parallelism (FSDP2 or
DDP). FSDP units, in forward order: the token embedding, each transformer block, and (norm, output)
together; the root takes whatever is left (the RoPE buffer; with tied embeddings the shared table,
which both ends of the model use).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from torchtrain.config import ConfigError, JobConfig
from torchtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtrain.distributed.compile import compile_blocks
from torchtrain.distributed.data_parallel import apply_ddp
from torchtrain.distributed.fsdp import DTYPES, apply_fsdp, resolve_param_dtype
from torchtrain.distributed.parallel_dims import ParallelDims
from torchtrain.distributed.tensor_parallel import check_divisible, enable_async_tp
from torchtrain.models.llama3.args import Llama3Args


def validate_llama_parallel(args: Llama3Args, parallel_dims: ParallelDims, job_config: JobConfig) -> None:
    """Model-shape checks against the layout, before any process group starts."""
    if parallel_dims.pp_enabled and args.tie_word_embeddings:
        raise ConfigError("[model.tie_word_embeddings] tied embeddings cannot be split across pipeline stages "
                          "(the table would live on the first and the last stage); set it false or "
                          "pipeline_parallel_degree = 1")
    tp = parallel_dims.tp
    if tp == 1:
        return
    if args.tie_word_embeddings:
        raise ConfigError("[model.tie_word_embeddings] tied embeddings are not supported with tensor parallelism "
                          "in this plan; set model.tie_word_embeddings = false or tensor_parallel_degree = 1")
    check_divisible(tp, {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.kv_heads,
        "model.ffn_hidden_dim (from model.dim, ffn_dim_multiplier, multiple_of)": args.ffn_hidden_dim,
        "model.vocab_size": args.vocab_size,
        "training.seq_len": job_config.training.seq_len,
    }, fixes={
        "model.vocab_size": f"pad the vocabulary: --model.vocab_size {-(-args.vocab_size // tp) * tp} "
                            f"(extra rows are never produced by the tokenizer)",
        "training.seq_len": "sequence parallelism splits the sequence evenly; use a multiple of the TP degree",
    })


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism (see `distributed/tensor_parallel.py`)."""
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1),
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def materialize_async_output(module: nn.Module, inputs, output):
    """The embedding's reduce-scatter result arrives as an AsyncCollectiveTensor (a lazily waited
    tensor subclass). Hand compiled blocks a plain tensor: given the subclass as input, they send
    its gradient past the subclass's autograd node (wrong gradients, or a crash in DTensor's
    redistribute backward; seen on torch 2.13 with gloo). The clone is one (batch, seq/tp, dim) copy."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def fsdp_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    units: list[nn.Module | list[nn.Module]] = []
    if model.tok_embeddings is not None and not model.args.tie_word_embeddings:
        units.append(model.tok_embeddings)
    units += list(model.layers.values())
    tail = [m for m in (model.norm, model.output) if m is not None]
    if tail and not model.args.tie_word_embeddings:
        units.append(tail)
    return units


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    training, par = job_config.training, job_config.parallelism
    mesh = parallel_dims.world_mesh
    if parallel_dims.tp_enabled:
        apply_tp(model, mesh["tp"], loss_parallel=parallel_dims.loss_parallel_enabled)
        if par.enable_async_tensor_parallel:
            enable_async_tp(mesh["tp"])
    ac = job_config.activation_checkpoint
    apply_activation_checkpointing(model.layers, ac.mode, ac.selective_ac_option)
    if job_config.compile.enable and "model" in job_config.compile.components:
        compile_blocks(model.layers, with_collectives=parallel_dims.tp_enabled)
        if parallel_dims.tp_enabled and model.tok_embeddings is not None:
            model.tok_embeddings.register_forward_hook(materialize_async_output)

    param_dtype = resolve_param_dtype(training.mixed_precision_param, mesh.device_type)
    reshard = par.fsdp_reshard_after_forward
    if parallel_dims.pp_enabled and reshard == "default":
        reshard = "never"  # each micro-batch's forward would otherwise all-gather the stage again
    if par.data_parallel_strategy in ("ddp", "zero1"):
        if parallel_dims.dp_enabled:
            apply_ddp(model, parallel_dims.dp_mesh)
    elif parallel_dims.dp_enabled or param_dtype != torch.float32 or training.enable_cpu_offload:
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh,
            fsdp_units(model),
            param_dtype=param_dtype,
            reduce_dtype=DTYPES[training.mixed_precision_reduce],
            reshard_after_forward=reshard,
            zero2=par.data_parallel_strategy == "zero2",
            cpu_offload=training.enable_cpu_offload,
        )
    return model
