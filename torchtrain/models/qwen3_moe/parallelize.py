"""The Qwen3-MoE parallel plan: Qwen3's attention TP plan (the decoder family's with per-head query/key
norms, `models/common/parallel.py::qk_norm_plan`) with the MoE layer's
(`models/common/tp.py::moe_tp_plan`: sequence-sharded tokens, replicated router), and its
checks against the layout. Expert parallelism itself is generic (the applier splits every
`GroupedExperts`); FSDP units and the pipeline split are the decoder family's.
"""

from __future__ import annotations

from torchtrain.models import contract
from torchtrain.models.common.parallel import check_moe_decoder_layout, decoder_tp, qk_norm_plan
from torchtrain.models.common.tp import gqa_attention_plan, moe_tp_plan
from torchtrain.models.qwen3_moe.args import Qwen3MoeArgs


def block_plan(args: Qwen3MoeArgs) -> dict[str, object]:
    """TP styles of one block: Qwen3's attention and the MoE layer's."""
    return {**gqa_attention_plan(), **qk_norm_plan(), **moe_tp_plan("feed_forward", args.num_shared_experts > 0)}


@contract.register(Qwen3MoeArgs)
def declare(args: Qwen3MoeArgs) -> contract.ModelContract:
    """The planner's view: every block is `block_plan`, Qwen3's attention and the shared MoE layer."""
    moe = contract.MoEShape(args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                            args.num_shared_experts, args.n_group, args.topk_group)
    modules = {**contract.gqa_modules(args.dim, args.n_heads, args.kv_heads, args.head_dim),
               **contract.qk_norm_modules(args.head_dim), **contract.moe_modules(args.dim, moe)}
    block = contract.Block(block_plan(args), modules, moe=moe, dim=args.dim, fused=contract.GQA_FUSED)
    return contract.gqa_decoder(args, block, block, args.num_active_params(), args.hidden_dim, qk_norm=True)


validate_qwen3_moe = check_moe_decoder_layout
apply_tp = decoder_tp(block_plan)
