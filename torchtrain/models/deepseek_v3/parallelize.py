"""The DeepSeek-V3 parallel plan: its tensor-parallel plan and checks against the layout (the generic
applier, `distributed/parallelize.py`, does the rest: expert parallelism splits every `GroupedExperts`;
the pipeline split is the decoder family's, `models/common/parallel.py`, with the multi-token
prediction on the last stage).

TP with sequence parallelism, MLA's way: the block's input stays sharded over the sequence, and
the narrow projections into the latents (W_qa, W_kva: 1,536 and 576 wide against h = 7,168) and their
norms run on each rank's sequence shard with replicated weights (`SequenceParallel`, gradients summed
over the TP ranks; the projections sequence-first before torch 2.13, `sequence_sharded_linear`). The projections that expand the latents to heads (W_qb, W_kvb) are column-parallel
over the heads and gather their *latent* input over the sequence -- r instead of h values per token,
4-12x less traffic than gathering x. The RoPE key (64 wide, shared by the heads) is gathered alone
(`rope_key`). Each rank then attends with its heads and W_o is row-parallel back into sequence
shards. The embedding, final norm and output are the decoder family's; dense feed-forwards are
Megatron's column/row pair; MoE layers use `models/common/tp.py::moe_tp_plan`. FSDP units
are the decoder family's (`models/common/parallel.py`) plus one per multi-token-prediction depth.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtrain.config.fields import ConfigError
from torchtrain.models import contract
from torchtrain.models.common.parallel import check_decoder_layout, decoder_fsdp_units, decoder_stage_modules
from torchtrain.models.common.tp import (
    GatherForLocalHeads,
    apply_decoder_top,
    check_tp_has_ep,
    moe_tp_plan,
    sequence_sharded_linear,
    swiglu_plan,
)
from torchtrain.models.deepseek_v3.args import DeepseekV3Args
from torchtrain.models.deepseek_v3.model import CHEAP_TO_RECOMPUTE


def validate_deepseek_v3(args: DeepseekV3Args, layout) -> None:
    """Model-shape checks against the layout, before any process group starts."""
    dims = layout.dims
    if args.mtp_depth:
        for on, degree, why in ((dims.tp_enabled, "tensor_parallel_degree", "its plan is not written yet"),
                                (dims.cp_enabled, "context_parallel_degree", "the targets one and two tokens ahead "
                                 "of a chunk's end live on another CP rank")):
            if on:
                raise ConfigError(f"[model.mtp_depth] multi-token prediction is not combined with {degree} > 1 "
                                  f"({why}); set model.mtp_depth = 0 or parallelism.{degree} = 1")
        if layout.batch.seq_len < args.mtp_depth + 2:
            raise ConfigError(f"[model.mtp_depth] {args.mtp_depth} needs training.seq_len >= {args.mtp_depth + 2}")
    if dims.tp_enabled and args.first_k_dense_replace < args.n_layers:  # some blocks have experts
        check_tp_has_ep(dims)
    check_decoder_layout(args, layout, {"model.n_heads": args.n_heads, "model.hidden_dim": args.hidden_dim})


def attention_plan(args: DeepseekV3Args) -> dict[str, object]:
    """TP styles of one block's MLA and its norms (module names relative to the block)."""
    plan: dict[str, object] = {
        "attention_norm": SequenceParallel(),
        "attention.wkv_a": sequence_sharded_linear(),  # replicated weights on this rank's sequence shard
        "attention.kv_norm": SequenceParallel(),
        "attention.wkv_b": ColwiseParallel(input_layouts=Shard(1)),
        "attention.rope_key": GatherForLocalHeads(),  # gathered for the local heads, gradient reduce-scattered
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if args.q_lora_rank:
        plan.update({"attention.wq_a": sequence_sharded_linear(), "attention.q_norm": SequenceParallel(),
                     "attention.wq_b": ColwiseParallel(input_layouts=Shard(1))})
    else:
        plan["attention.wq"] = ColwiseParallel(input_layouts=Shard(1))
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    args: DeepseekV3Args = model.args
    apply_decoder_top(model, tp_mesh, loss_parallel)
    for name, block in model.layers.items():
        parallelize_module(block, tp_mesh, block_plan(args, args.is_moe_layer(int(name))))


def block_plan(args: DeepseekV3Args, moe: bool) -> dict[str, object]:
    ffn = moe_tp_plan("feed_forward", args.num_shared_experts > 0) if moe else swiglu_plan()
    return {**attention_plan(args), **ffn}


def attention_modules(args: DeepseekV3Args) -> dict[str, contract.Module]:
    """The modules `attention_plan` names, with their widths (MLA's low-rank projections)."""
    h, n, qk = args.dim, args.n_heads, args.qk_head_dim
    if args.q_lora_rank:
        query = {"attention.wq_a": contract.linear(h, args.q_lora_rank), "attention.q_norm": contract.norm(args.q_lora_rank),
                 "attention.wq_b": contract.linear(args.q_lora_rank, n * qk)}
    else:
        query = {"attention.wq": contract.linear(h, n * qk)}
    return {**query, "attention.wkv_a": contract.linear(h, args.kv_lora_rank + args.qk_rope_head_dim),
            "attention.kv_norm": contract.norm(args.kv_lora_rank),
            "attention.wkv_b": contract.linear(args.kv_lora_rank, n * (args.qk_nope_head_dim + args.v_head_dim)),
            "attention.rope_key": contract.Module(args.qk_rope_head_dim, args.qk_rope_head_dim),
            "attention.wo": contract.linear(n * args.v_head_dim, h),
            "attention_norm": contract.norm(h), "ffn_norm": contract.norm(h)}


@contract.register(DeepseekV3Args)
def declare(args: DeepseekV3Args) -> contract.ModelContract:
    """The planner's view: MLA blocks, dense (SwiGLU) for the first `first_k_dense_replace`, the shared
    MoE layer after; each with its `block_plan`."""
    h, layers = args.dim, args.n_layers + args.mtp_depth
    attention = attention_modules(args)
    dense = contract.Block(block_plan(args, False), {**attention, **contract.swiglu_modules(h, args.hidden_dim)},
                           dim=h)
    moe = contract.MoEShape(args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                            args.num_shared_experts, args.n_group, args.topk_group)
    moe_block = contract.Block(block_plan(args, True), {**attention, **contract.moe_modules(h, moe)}, moe=moe, dim=h)
    flags = tuple(args.is_moe_layer(i) for i in range(layers))
    return contract.ModelContract(
        dim=h, n_layers=args.n_layers, vocab_size=args.vocab_size, n_heads=args.n_heads, head_dim=args.qk_head_dim,
        kv_heads=args.n_heads,
        # values are padded to the query/key width for the flash kernels (model.py), so they cost as much
        attention=contract.AttentionShape(args.n_heads, args.qk_head_dim, max(args.v_head_dim, args.qk_head_dim),
                                          args.n_heads),
        dense=dense, moe_block=moe_block if any(flags) else None, moe_layers=flags,
        num_params=args.num_params(), num_active_params=args.num_active_params(), flops_per_token=args.flops_per_token, ffn_hidden=args.hidden_dim,
        mtp_depth=args.mtp_depth, max_seq_len=args.max_seq_len, block_causal=args.attention_mask == "block_causal",
        cheap_to_recompute=CHEAP_TO_RECOMPUTE)


def fsdp_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """The decoder family's units (embedding, each block, norm + output), with each multi-token-prediction
    depth a unit of its own before the output head (forward order: the head runs once, after the depths)."""
    units = decoder_fsdp_units(model)
    if model.mtp is None:
        return units
    depths = list(model.mtp.depths.values())
    return units[:-1] + depths + units[-1:] if model.output is not None else units + depths


def stage_modules(args: DeepseekV3Args, num_stages: int, first_less: int = 0, last_less: int = 0) -> list[list[str]]:
    """The decoder family's split; with multi-token prediction the last stage also holds the depths and the token
    embedding they share with the first stage (two copies kept as one: `distributed/tied_stages.py`)."""
    stages = decoder_stage_modules(args, num_stages, first_less, last_less)
    if args.mtp_depth:
        stages[-1] = stages[-1] + ["mtp"] + (["tok_embeddings"] if "tok_embeddings" not in stages[-1] else [])
    return stages
