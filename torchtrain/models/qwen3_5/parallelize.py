"""The Qwen3.5 parallel plan: per block, its token mixer's -- gated full attention (the decoder family's
grouped-query plan with per-head query/key norms: W_q's rows per head hold the query and its gate, so the
column split keeps them together) or Gated DeltaNet (`models/common/tp.py::gated_deltanet_plan`: heads
split with their convolution channels and decay parameters) -- and its feed-forward's (a SwiGLU or the MoE
layer with its gated shared expert); the checks against the layout. FSDP units and the pipeline split
(hybrid stages: any layers per stage) are the decoder family's; context parallelism shards both mixers
(`distributed/context_parallel.py`, `distributed/context_parallel_linear.py`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtrain.config.fields import ConfigError
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


def validate_qwen3_5(args: Qwen3_5Args, layout) -> None:
    """`check_decoder_layout` of both mixers' heads and the SwiGLU; context parallelism's chunks at least as long
    as the linear layers' convolution (each chunk takes its left context from the one before it)."""
    moe = isinstance(args, Qwen3_5MoeArgs)
    sizes = {"model.n_heads": args.n_heads, "model.n_kv_heads": args.kv_heads,
             "model.linear_num_key_heads": args.linear_num_key_heads,
             "model.linear_num_value_heads": args.linear_num_value_heads}
    if not moe:
        sizes["model.hidden_dim"] = args.hidden_dim
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
