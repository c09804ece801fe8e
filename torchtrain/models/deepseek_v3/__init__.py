"""DeepSeek-V3: model, published shapes, parallel plan, registered as "deepseek_v3"."""

from torchtrain.models.common.spec import register_decoder
from torchtrain.models.deepseek_v3.args import DeepseekV3Args
from torchtrain.models.deepseek_v3.model import CHEAP_TO_RECOMPUTE, Transformer
from torchtrain.models.deepseek_v3.parallelize import apply_tp, fsdp_units, stage_modules, validate_deepseek_v3
from torchtrain.models.deepseek_v3.state_dict_adapter import DeepseekV3StateDictAdapter

# Published shapes. 671B: DeepSeek-V3's config.json (61 blocks, 3 dense; 256 routed + 1 shared experts,
# top-8 from at most 4 of 8 groups, sigmoid scores, routed scale 2.5; YaRN factor 40 over 4,096; the
# bias step 0.001 and sequence-wise balance weight 1e-4 of the V3 report). 16B: the 16B-A2.4B shape
# torchtitan ships (DeepSeek-V2-Lite's: full-rank queries, softmax routing without renormalisation,
# 64 routed + 2 shared experts, one dense block). `debugmodel` is CPU-sized and exercises every part
# of V3 (low-rank queries, group-limited sigmoid routing, the bias, a dense first block).
DEEPSEEK_V3_FLAVORS: dict[str, DeepseekV3Args] = {
    "debugmodel": DeepseekV3Args(
        dim=256, n_layers=4, n_heads=8, vocab_size=2048, hidden_dim=768, first_k_dense_replace=1,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_factor=1.0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, num_shared_experts=1,
        score_func="sigmoid", route_scale=2.5, n_group=4, topk_group=2, moe_aux_loss_coeff=1e-4,
        moe_load_balance_coeff=1e-3),
    "16B": DeepseekV3Args(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, hidden_dim=10944, first_k_dense_replace=1,
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_factor=40.0, rope_mscale=0.707, rope_mscale_all_dim=0.707, num_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=1408, num_shared_experts=2, score_func="softmax", norm_topk_prob=False,
        route_scale=1.0, moe_aux_loss_coeff=1e-3, moe_load_balance_coeff=0.0),
    "671B": DeepseekV3Args(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, hidden_dim=18432, first_k_dense_replace=3,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_factor=40.0, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
        score_func="sigmoid", norm_topk_prob=True, route_scale=2.5, n_group=8, topk_group=4,
        moe_aux_loss_coeff=1e-4, moe_load_balance_coeff=1e-3),
}

register_decoder("deepseek_v3", Transformer, DeepseekV3Args, DEEPSEEK_V3_FLAVORS, tp_plan=apply_tp,
                 validate=validate_deepseek_v3, fsdp_units=fsdp_units, stage_modules=stage_modules,
                 state_dict_adapter=DeepseekV3StateDictAdapter, cheap_to_recompute=CHEAP_TO_RECOMPUTE)

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepseekV3Args", "DeepseekV3StateDictAdapter", "Transformer"]
