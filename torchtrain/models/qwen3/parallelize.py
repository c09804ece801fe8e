"""The Qwen3 parallel plan: its tensor-parallel plan and shape checks (the generic applier,
`distributed/parallelize.py`, does the rest; FSDP units and the pipeline split are the decoder
family's, `models/common/parallel.py`).

TP is the Megatron plan with sequence parallelism (`distributed/tensor_parallel.py`), plus the per-head
query/key norms on head shards (`models/common/parallel.py::qk_norm_plan`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtrain.models import contract
from torchtrain.models.common.parallel import check_decoder_layout, qk_norm_plan
from torchtrain.models.common.tp import apply_decoder_top, gqa_attention_plan, swiglu_plan
from torchtrain.models.qwen3.args import Qwen3Args


def validate_qwen3(args: Qwen3Args, layout) -> None:
    """Model-shape checks against the layout (`check_decoder_layout` of the heads and the SwiGLU)."""
    check_decoder_layout(args, layout, {"model.n_heads": args.n_heads, "model.n_kv_heads": args.kv_heads,
                                        "model.hidden_dim": args.hidden_dim})


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism (see `distributed/tensor_parallel.py`)."""
    apply_decoder_top(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())


def block_plan() -> dict[str, object]:
    """TP styles of one block: grouped-query attention with per-head query/key norms, and the SwiGLU."""
    return {**gqa_attention_plan(), **qk_norm_plan(), **swiglu_plan()}


@contract.register(Qwen3Args)
def declare(args: Qwen3Args) -> contract.ModelContract:
    """The planner's view: every block is `block_plan`."""
    modules = {**contract.gqa_modules(args.dim, args.n_heads, args.kv_heads, args.head_dim),
               **contract.qk_norm_modules(args.head_dim), **contract.swiglu_modules(args.dim, args.hidden_dim)}
    dense = contract.Block(block_plan(), modules, dim=args.dim, fused=contract.GQA_FUSED)
    return contract.gqa_decoder(args, dense, None, args.num_params(), args.hidden_dim, qk_norm=True)
