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
        parallelize_module(block, tp_mesh, {**attention_plan(), **swiglu_plan()})
