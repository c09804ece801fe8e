"""The gpt-oss parallel plan: the decoder family's grouped-query attention plan with the sinks split over
the query heads beside them (`LocalShards`: rank r holds the sinks of its own heads), and the MoE
layer's plan (sequence-sharded tokens, replicated biased router); its checks against the layout; the
planner's contract. Expert parallelism is generic (every `GroupedExperts`, biases included, is split
on its expert dimension); FSDP units and the pipeline split are the decoder family's. Context
parallelism needs nothing of its own: sliding windows and sinks are the attention core's.
"""

from __future__ import annotations

from dataclasses import replace

from torchtrain.models import contract
from torchtrain.models.common.parallel import check_moe_decoder_layout, decoder_tp
from torchtrain.models.common.tp import LocalShards, gqa_attention_plan, moe_tp_plan
from torchtrain.models.gpt_oss.args import GptOssArgs


def block_plan(args: GptOssArgs) -> dict[str, object]:
    """TP styles of one block: grouped-query attention with its sinks, and the MoE layer's."""
    return {**gqa_attention_plan(), "attention.sinks": LocalShards(0), **moe_tp_plan("feed_forward", False)}


@contract.register(GptOssArgs)
def declare(args: GptOssArgs) -> contract.ModelContract:
    """The planner's view: every block is `block_plan` over biased attention with sinks and the MoE layer;
    the sliding layers' attention windowed (`windows`)."""
    moe = contract.MoEShape(args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size, 0)
    modules = {**contract.gqa_modules(args.dim, args.n_heads, args.kv_heads, args.head_dim),
               "attention.sinks": contract.Module(0, 0, ((args.n_heads, 1),)),
               **contract.moe_modules(args.dim, moe),
               "feed_forward.router": contract.Module(args.dim, args.num_experts,
                                                      ((args.num_experts, args.dim), (args.num_experts, 1)), linear=True)}
    block = contract.Block(block_plan(args), modules, moe=moe, dim=args.dim, fused=contract.GQA_FUSED)
    out = contract.gqa_decoder(args, block, block, args.num_active_params(), args.moe_intermediate_size)
    return replace(out, attention=replace(out.attention, sinks=True),
                   windows=tuple(args.sliding_window if args.is_sliding(i) else None for i in range(args.n_layers)))


validate_gpt_oss = check_moe_decoder_layout
apply_tp = decoder_tp(block_plan)
