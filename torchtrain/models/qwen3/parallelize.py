"""The Qwen3 parallel plan: its tensor-parallel plan and shape checks (the generic applier,
`distributed/parallelize.py`, does the rest; FSDP units and the pipeline split are Llama 3's, whose
module layout Qwen3 shares).

TP is Llama 3's Megatron plan with sequence parallelism, plus the per-head query/key norms: their
weights are replicated and their inputs are sharded over heads (dim 2 of (batch, seq, heads,
head_dim)), so each rank normalises its own heads and the norms' gradients are summed over the TP
ranks (`SequenceParallel(sequence_dim=2)`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from torchtrain.config.fields import ConfigError
from torchtrain.distributed.tensor_parallel import apply_decoder_top, check_divisible, gqa_attention_plan, swiglu_plan
from torchtrain.models import contract
from torchtrain.models.qwen3.args import Qwen3Args


def validate_qwen3(args: Qwen3Args, layout) -> None:
    """Model-shape checks against the layout, before any process group starts."""
    dims = layout.dims
    if dims.pp_enabled and args.tie_word_embeddings:
        raise ConfigError("[model.tie_word_embeddings] tied embeddings cannot be split across pipeline stages "
                          "(the table would live on the first and the last stage); set it false or "
                          "pipeline_parallel_degree = 1")
    tp = dims.tp
    if tp == 1:
        return
    if args.tie_word_embeddings:
        raise ConfigError("[model.tie_word_embeddings] tied embeddings are not supported with tensor parallelism "
                          "in this plan; set model.tie_word_embeddings = false or tensor_parallel_degree = 1")
    sizes = {"model.n_heads": args.n_heads, "model.n_kv_heads": args.kv_heads, "model.vocab_size": args.vocab_size,
             "training.seq_len": layout.batch.seq_len}
    if not getattr(args, "num_experts", 0):
        sizes["model.hidden_dim"] = args.hidden_dim
    check_divisible(tp, sizes, fixes={
        "model.vocab_size": f"pad the vocabulary: --model.vocab_size {-(-args.vocab_size // tp) * tp} "
                            f"(extra rows are never produced by the tokenizer)",
        "training.seq_len": "sequence parallelism splits the sequence evenly; use a multiple of the TP degree",
    })


def attention_plan() -> dict[str, object]:
    """TP styles of one block's attention and its norms (module names relative to the block): the
    decoder family's, plus the per-head query/key norms on head shards."""
    return {
        **gqa_attention_plan(),
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism (see `distributed/tensor_parallel.py`)."""
    apply_decoder_top(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())


def block_plan() -> dict[str, object]:
    return {**attention_plan(), **swiglu_plan()}


def attention_modules(args: Qwen3Args) -> dict[str, contract.Module]:
    """The modules `attention_plan` names, with their widths."""
    return {**contract.gqa_modules(args.dim, args.n_heads, args.kv_heads, args.head_dim),
            "attention.q_norm": contract.norm(args.head_dim), "attention.k_norm": contract.norm(args.head_dim)}


def declared(args: Qwen3Args, dense: contract.Block, moe_block: contract.Block | None,
             num_active_params: int) -> contract.ModelContract:
    """A Qwen3-family contract around its blocks (Qwen3-MoE's too)."""
    return contract.ModelContract(
        dim=args.dim, n_layers=args.n_layers, vocab_size=args.vocab_size, n_heads=args.n_heads,
        head_dim=args.head_dim, kv_heads=args.kv_heads,
        attention=contract.AttentionShape(args.n_heads, args.head_dim, args.head_dim, args.kv_heads),
        dense=dense, moe_block=moe_block, moe_layers=(moe_block is not None,) * args.n_layers,
        num_params=args.num_params(), num_active_params=num_active_params, flops_per_token=args.flops_per_token, ffn_hidden=args.hidden_dim,
        tie_word_embeddings=args.tie_word_embeddings, max_seq_len=args.max_seq_len,
        block_causal=args.attention_mask == "block_causal", qk_norm=True)


@contract.register(Qwen3Args)
def declare(args: Qwen3Args) -> contract.ModelContract:
    """The planner's view: every block is `attention_plan` plus the SwiGLU's."""
    modules = {**attention_modules(args), **contract.swiglu_modules(args.dim, args.hidden_dim)}
    dense = contract.Block(block_plan(), modules, dim=args.dim)
    return declared(args, dense, None, args.num_params())
