"""The Llama 3 parallel plan: how this model is sharded. Written in plain Python so a researcher can
read and change it; the trainer only calls `parallelize_llama`.

FSDP units, in forward order: the token embedding, each transformer block, and (norm, output)
together; the root takes whatever is left (the RoPE buffer; with tied embeddings also the shared
table, which both ends of the model use).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.config import JobConfig
from torchtrain.distributed.fsdp import DTYPES, apply_fsdp, resolve_param_dtype
from torchtrain.distributed.parallel_dims import ParallelDims


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
    training = job_config.training
    param_dtype = resolve_param_dtype(training.mixed_precision_param, parallel_dims.world_mesh.device_type)
    if parallel_dims.dp_shard > 1 or parallel_dims.dp_replicate > 1 or param_dtype != torch.float32:
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh,
            fsdp_units(model),
            param_dtype=param_dtype,
            reduce_dtype=DTYPES[training.mixed_precision_reduce],
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
        )
    return model
