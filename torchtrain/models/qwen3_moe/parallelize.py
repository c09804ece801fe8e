"""The Qwen3-MoE parallel plan: Qwen3's attention TP plan with the MoE layer's
(`distributed/expert_parallel.py::moe_tp_plan`: sequence-sharded tokens, replicated router), and
its checks against the layout. Expert parallelism itself is generic (the applier splits every
`GroupedExperts`); FSDP units and the pipeline split are Llama 3's.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtrain.distributed.expert_parallel import check_tp_has_ep, moe_tp_plan
from torchtrain.distributed.tensor_parallel import apply_decoder_top
from torchtrain.models import contract
from torchtrain.models.qwen3.parallelize import attention_modules, attention_plan, declared, validate_qwen3
from torchtrain.models.qwen3_moe.args import Qwen3MoeArgs


def validate_qwen3_moe(args: Qwen3MoeArgs, layout) -> None:
    validate_qwen3(args, layout)
    check_tp_has_ep(layout.dims)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    apply_decoder_top(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(model.args))


def block_plan(args: Qwen3MoeArgs) -> dict[str, object]:
    return {**attention_plan(), **moe_tp_plan("feed_forward", args.num_shared_experts > 0)}


@contract.register(Qwen3MoeArgs)
def declare(args: Qwen3MoeArgs) -> contract.ModelContract:
    """The planner's view: every block is `block_plan`, Qwen3's attention and the shared MoE layer."""
    moe = contract.MoEShape(args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                            args.num_shared_experts)
    modules = {**attention_modules(args), **contract.moe_modules(args.dim, moe)}
    block = contract.Block(block_plan(args), modules, moe=moe, dim=args.dim)
    return declared(args, block, block, args.num_active_params())
