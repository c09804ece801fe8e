"""The Llama 3 parallel plan: what is this model's own about sharding it. Plain Python, so a
researcher can read and change it; the generic applier (`distributed/parallelize.py`) calls these in
its fixed order (TP -> activation checkpointing -> compile -> FSDP/HSDP/DDP) from the resolved Layout.

* `apply_tp`: Megatron-style tensor parallelism with sequence parallelism (the model's TP plan);
* `fsdp_units`: the FSDP units in forward order -- the token embedding, each transformer block, and
  (norm, output) together; the root takes whatever is left (the RoPE buffer; with tied embeddings the
  shared table, which both ends of the model use);
* `validate_llama`: the model's shape checks against the layout, before any process group starts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtrain.config.fields import ConfigError
from torchtrain.distributed.tensor_parallel import apply_decoder_top, check_divisible, gqa_attention_plan, swiglu_plan
from torchtrain.models import contract
from torchtrain.models.llama3.args import Llama3Args


def validate_llama(args: Llama3Args, layout) -> None:
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
    check_divisible(tp, {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.kv_heads,
        "model.ffn_hidden_dim (from model.dim, ffn_dim_multiplier, multiple_of)": args.ffn_hidden_dim,
        "model.vocab_size": args.vocab_size,
        "training.seq_len": layout.local_seq_len,
    }, fixes={
        "model.vocab_size": f"pad the vocabulary: --model.vocab_size {-(-args.vocab_size // tp) * tp} "
                            f"(extra rows are never produced by the tokenizer)",
        "training.seq_len": "sequence parallelism splits each rank's sequence evenly; use a multiple of the TP "
                            "degree (x the context parallel degree, whose ranks each hold seq_len / cp tokens)",
    })


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism (see `distributed/tensor_parallel.py`): the decoder
    family's plans for the top-level modules, attention and the SwiGLU."""
    apply_decoder_top(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())


def block_plan() -> dict[str, object]:
    return {**gqa_attention_plan(), **swiglu_plan()}


@contract.register(Llama3Args)
def declare(args: Llama3Args) -> contract.ModelContract:
    """The planner's view: every block is `block_plan` over grouped-query attention and a SwiGLU."""
    h = args.dim
    modules = {**contract.gqa_modules(h, args.n_heads, args.kv_heads, args.head_dim),
               **contract.swiglu_modules(h, args.ffn_hidden_dim)}
    return contract.ModelContract(
        dim=h, n_layers=args.n_layers, vocab_size=args.vocab_size, n_heads=args.n_heads, head_dim=args.head_dim,
        kv_heads=args.kv_heads,
        attention=contract.AttentionShape(args.n_heads, args.head_dim, args.head_dim, args.kv_heads),
        dense=contract.Block(block_plan(), modules, dim=h), moe_block=None, moe_layers=(False,) * args.n_layers,
        num_params=args.num_params(), num_active_params=args.num_params(), flops_per_token=args.flops_per_token, ffn_hidden=args.ffn_hidden_dim,
        tie_word_embeddings=args.tie_word_embeddings, max_seq_len=args.max_seq_len,
        block_causal=args.attention_mask == "block_causal")


def fsdp_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    units: list[nn.Module | list[nn.Module]] = []
    if model.tok_embeddings is not None and not model.args.tie_word_embeddings:
        units.append(model.tok_embeddings)
    units += list(model.layers.values())
    tail = [m for m in (model.norm, model.output) if m is not None]
    if tail and not model.args.tie_word_embeddings:
        units.append(tail)
    return units
