"""Qwen3-MoE: model, published shapes, parallel plan, registered as "qwen3_moe"."""

from torchtrain.models.common.spec import register_decoder
from torchtrain.models.qwen3_moe.args import Qwen3MoeArgs
from torchtrain.models.qwen3_moe.model import MoETransformer
from torchtrain.models.qwen3_moe.parallelize import apply_tp, validate_qwen3_moe
from torchtrain.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter

# Published shapes (Qwen's HF config.json files): 128 experts, top-8, renormalised gate weights,
# softmax router, no shared experts, head_dim 128, RoPE base 1e6, router_aux_loss_coef 0.001.
# `debugmodel` is CPU-sized.
QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeArgs] = {
    "debugmodel": Qwen3MoeArgs(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=32, vocab_size=2048,
                               hidden_dim=768, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256),
    "30B-A3B": Qwen3MoeArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768),
    "235B-A22B": Qwen3MoeArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288, num_experts=128,
                              num_experts_per_tok=8, moe_intermediate_size=1536),
}

register_decoder("qwen3_moe", MoETransformer, Qwen3MoeArgs, QWEN3_MOE_FLAVORS, tp_plan=apply_tp,
                 validate=validate_qwen3_moe, state_dict_adapter=Qwen3MoeStateDictAdapter)

__all__ = ["QWEN3_MOE_FLAVORS", "Qwen3MoeArgs", "Qwen3MoeStateDictAdapter", "MoETransformer"]
