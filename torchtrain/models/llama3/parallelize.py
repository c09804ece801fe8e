"""The Llama 3 parallel plan: what is this model's own about sharding it. Plain Python, so a
researcher can read and change it; the generic applier (`distributed/parallelize.py`) calls these in
its fixed order (TP -> activation checkpointing -> compile -> FSDP/HSDP/DDP) from the resolved Layout.
FSDP units and the pipeline split are the decoder family's (`models/common/parallel.py`).

* `apply_tp`: Megatron-style tensor parallelism with sequence parallelism (the model's TP plan);
* `validate_llama`: the model's shape checks against the layout, before any process group starts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtrain.distributed.tensor_parallel import apply_decoder_top, gqa_attention_plan, swiglu_plan
from torchtrain.models.common.parallel import check_decoder_layout
from torchtrain.models.llama3.args import Llama3Args


def validate_llama(args: Llama3Args, layout) -> None:
    """Model-shape checks against the layout (`check_decoder_layout` of the heads and the SwiGLU)."""
    check_decoder_layout(args, layout, {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.kv_heads,
        "model.ffn_hidden_dim (from model.dim, ffn_dim_multiplier, multiple_of)": args.ffn_hidden_dim,
    })


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism (see `distributed/tensor_parallel.py`): the decoder
    family's plans for the top-level modules, attention and the SwiGLU."""
    apply_decoder_top(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {**gqa_attention_plan(), **swiglu_plan()})
