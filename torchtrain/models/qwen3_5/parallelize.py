"""The Qwen3.5 parallel plan: per block, its token mixer's -- gated full attention (the decoder family's
grouped-query plan with per-head query/key norms: W_q's rows per head hold the query and its gate, so the
column split keeps them together) or Gated DeltaNet (`models/common/tp.py::gated_deltanet_plan`: heads
split with their convolution channels and decay parameters) -- and its feed-forward's (a SwiGLU or the MoE
layer with its gated shared expert); the checks against the layout; the planner's contract (`declare`:
each layer's block by its mixer, and the vision encoder). FSDP units and the pipeline split (hybrid stages:
any layers per stage) are the decoder family's; context parallelism shards both mixers
(`distributed/context_parallel.py`, `distributed/context_parallel_linear.py`).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtrain.config.fields import ConfigError
from torchtrain.models import contract
from torchtrain.models.common.parallel import check_decoder_layout, qk_norm_plan
from torchtrain.models.common.tp import (
    apply_decoder_top,
    check_tp_has_ep,
    gated_deltanet_plan,
    gqa_attention_plan,
    moe_tp_plan,
    swiglu_plan,
)
from torchtrain.models.qwen3_5.args import Qwen3_5Args, Qwen3_5MoeArgs
from torchtrain.models.vision_contract import declare_vision


def validate_qwen3_5(args: Qwen3_5Args, layout) -> None:
    """`check_decoder_layout` of both mixers' heads and the SwiGLU; context parallelism's chunks at least as long
    as the linear layers' convolution (each chunk takes its left context from the one before it)."""
    moe = isinstance(args, Qwen3_5MoeArgs)
    sizes = {"model.n_heads": args.n_heads, "model.n_kv_heads": args.kv_heads,
             "model.linear_num_key_heads": args.linear_num_key_heads,
             "model.linear_num_value_heads": args.linear_num_value_heads}
    if not moe:
        sizes["model.hidden_dim"] = args.hidden_dim
    if args.vision:
        sizes.update({"model.vision_heads": args.vision_heads, "model.vision_hidden_dim": args.vision_hidden_dim})
    check_decoder_layout(args, layout, sizes)
    if moe:
        check_tp_has_ep(layout.dims)
    chunk = layout.cp_chunk_len if layout.dims.cp_enabled else None
    if chunk is not None and chunk < args.linear_conv_kernel_dim:
        raise ConfigError(f"[training.seq_len] context parallelism cuts each sequence into chunks of {chunk} tokens, "
                          f"shorter than the linear layers' convolution (model.linear_conv_kernel_dim "
                          f"{args.linear_conv_kernel_dim}), whose left context must come from one chunk; use a longer "
                          f"seq_len or a smaller context_parallel_degree")


def block_plan(args: Qwen3_5Args, full: bool) -> dict[str, object]:
    """TP styles of one block (module names relative to it)."""
    mixer = {**gqa_attention_plan(), **qk_norm_plan()} if full else gated_deltanet_plan()
    if isinstance(args, Qwen3_5MoeArgs):
        ffn = moe_tp_plan("feed_forward", args.num_shared_experts > 0, args.shared_expert_gate)
    else:
        ffn = swiglu_plan()
    return {**mixer, **ffn}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    apply_decoder_top(model, tp_mesh, loss_parallel)
    for name, block in model.layers.items():
        parallelize_module(block, tp_mesh, block_plan(model.args, model.args.is_full(int(name))))


@contract.register(Qwen3_5Args)
def declare(args: Qwen3_5Args) -> contract.ModelContract:
    """The planner's view: per layer `block_plan` over gated full attention (W_q gives each head its query
    and its output gate) or Gated DeltaNet (`linear_layers`, `linear_block`), each with the SwiGLU or the
    MoE layer with its gated shared expert; with `vision_depth` > 0 the vision encoder (`declare_vision`: its
    modules under `vision_encoder_plan`)."""
    h, hq = args.dim, args.n_heads * args.head_dim
    if isinstance(args, Qwen3_5MoeArgs):
        moe = contract.MoEShape(args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                                args.num_shared_experts)
        ffn, ffn_hidden = contract.moe_modules(h, moe, shared_gate=args.shared_expert_gate), args.moe_intermediate_size
    else:
        moe, ffn, ffn_hidden = None, contract.swiglu_modules(h, args.hidden_dim), args.hidden_dim
    full = {**contract.gqa_modules(h, args.n_heads, args.kv_heads, args.head_dim),
            "attention.wq": contract.linear(h, 2 * hq), **contract.qk_norm_modules(args.head_dim)}
    lin = contract.LinearAttentionShape(args.linear_num_key_heads, args.linear_num_value_heads,
                                        args.linear_key_head_dim, args.linear_value_head_dim,
                                        args.linear_conv_kernel_dim, args.linear_attn_chunk_size,
                                        args.linear_mixer_flops(), float32=args.linear_attn_kernel != "fla")
    full_block = contract.Block(block_plan(args, True), {**full, **ffn}, moe=moe, dim=h)
    linear_block = contract.Block(block_plan(args, False), {**contract.linear_attention_modules(h, lin), **ffn},
                                  moe=moe, dim=h, linear=lin)
    dense = contract.gqa_decoder(args, full_block, full_block if moe else None, args.num_active_params(), ffn_hidden,
                                 qk_norm=True)
    return replace(dense, linear_block=linear_block,
                   linear_layers=tuple(not args.is_full(i) for i in range(args.n_layers)),
                   vision=declare_vision(args, h))
