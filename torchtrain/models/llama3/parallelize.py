"""The Llama 3 parallel plan: what is this model's own about sharding it. Plain Python, so a
researcher can read and change it; the generic applier (`distributed/parallelize.py`) calls these in
its fixed order (TP -> activation checkpointing -> compile -> FSDP/HSDP/DDP) from the resolved Layout.
FSDP units and the pipeline split are the decoder family's (`models/common/parallel.py`).

* `apply_tp`: Megatron-style tensor parallelism with sequence parallelism (the model's TP plan);
* `validate_llama`: the model's shape checks against the layout, before any process group starts;
* `declare`: what the plan implies for the planner (`models/contract.py`), read from `block_plan`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtrain.models import contract
from torchtrain.models.common.parallel import check_decoder_layout
from torchtrain.models.common.tp import apply_decoder_top, gqa_attention_plan, swiglu_plan
from torchtrain.models.layout_view import LayoutView
from torchtrain.models.llama3.args import Llama3Args


def validate_llama(args: Llama3Args, layout: LayoutView) -> None:
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
        parallelize_module(block, tp_mesh, block_plan())


def block_plan() -> dict[str, object]:
    """TP styles of one block (module names relative to it): grouped-query attention and the SwiGLU."""
    return {**gqa_attention_plan(), **swiglu_plan()}


@contract.register(Llama3Args)
def declare(args: Llama3Args) -> contract.ModelContract:
    """The planner's view: every block is `block_plan` over grouped-query attention and a SwiGLU."""
    modules = {**contract.gqa_modules(args.dim, args.n_heads, args.kv_heads, args.head_dim),
               **contract.swiglu_modules(args.dim, args.ffn_hidden_dim)}
    dense = contract.Block(block_plan(), modules, dim=args.dim, fused=contract.GQA_FUSED)
    return contract.gqa_decoder(args, dense, None, args.num_params(), args.ffn_hidden_dim)
