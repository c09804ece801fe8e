"""Qwen3.5 (dense and MoE, text decoder alone or with its vision encoder): model, published shapes, parallel
plan, registered as "qwen3_5" (the MoE and vision-language shapes are flavors of it: `--model.flavor 35B-A3B`,
`--model.flavor 9B-VL`)."""

from dataclasses import replace

from torchtrain.models.common.spec import register_decoder
from torchtrain.models.qwen3_5.args import Qwen3_5Args, Qwen3_5MoeArgs
from torchtrain.models.qwen3_5.model import Qwen3_5MoeTransformer, Qwen3_5Transformer
from torchtrain.models.qwen3_5.parallelize import apply_tp, validate_qwen3_5
from torchtrain.models.qwen3_5.state_dict_adapter import Qwen3_5MoeStateDictAdapter, Qwen3_5StateDictAdapter
from torchtrain.models.qwen3_5.vlm_adapter import state_dict_adapter

# Published shapes (Qwen's config.json text_config): vocabulary 248,320, full-attention heads of 256 with RoPE
# on the first 64 dimensions (base 1e7), one full-attention layer in four, linear heads of 128 with 4-tap
# convolutions, RMSNorm eps 1e-6; the three smallest tie their embeddings. `debugmodel` / `debugmodel_moe`
# are CPU-sized (two linear layers, then one full, then one linear).
_Q35 = dict(head_dim=256, vocab_size=248320, rope_theta=1e7)
QWEN3_5_FLAVORS: dict[str, Qwen3_5Args] = {
    "debugmodel": Qwen3_5Args(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=2048,
                              hidden_dim=512, full_attention_interval=3, linear_num_key_heads=4,
                              linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32),
    "0.8B": Qwen3_5Args(dim=1024, n_layers=24, n_heads=8, n_kv_heads=2, hidden_dim=3584, linear_num_value_heads=16,
                        tie_word_embeddings=True, **_Q35),
    "2B": Qwen3_5Args(dim=2048, n_layers=24, n_heads=8, n_kv_heads=2, hidden_dim=6144, linear_num_value_heads=16,
                      tie_word_embeddings=True, **_Q35),
    "4B": Qwen3_5Args(dim=2560, n_layers=32, n_heads=16, n_kv_heads=4, hidden_dim=9216, tie_word_embeddings=True,
                      **_Q35),
    "9B": Qwen3_5Args(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, hidden_dim=12288, **_Q35),
    "27B": Qwen3_5Args(dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, hidden_dim=17408, linear_num_value_heads=48,
                       **_Q35),
}
QWEN3_5_MOE_FLAVORS: dict[str, Qwen3_5MoeArgs] = {
    "debugmodel_moe": Qwen3_5MoeArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=2048,
                                     hidden_dim=512, full_attention_interval=3, linear_num_key_heads=4,
                                     linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128),
    "35B-A3B": Qwen3_5MoeArgs(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, num_experts=256, num_experts_per_tok=8,
                              moe_intermediate_size=512, **_Q35),
    "122B-A10B": Qwen3_5MoeArgs(dim=3072, n_layers=48, n_heads=32, n_kv_heads=2, num_experts=256,
                                num_experts_per_tok=8, moe_intermediate_size=1024, linear_num_value_heads=64, **_Q35),
    "397B-A17B": Qwen3_5MoeArgs(dim=4096, n_layers=60, n_heads=32, n_kv_heads=2, num_experts=512,
                                num_experts_per_tok=10, moe_intermediate_size=1024, linear_num_value_heads=64, **_Q35),
}

# The published checkpoints are vision-language models; their vision towers (Qwen's vision_config): 16-pixel
# patches of 2 frames, 2 x 2 merged per token, a 48 x 48 learned position grid. A "-VL" flavor is the
# decoder above with its tower (`models/common/vision.py`); `debugmodel_vl` / `debugmodel_moe_vl` are CPU-sized.
_VIT_768 = dict(vision_depth=12, vision_dim=768, vision_heads=12, vision_hidden_dim=3072)
_VIT_1024 = dict(vision_depth=24, vision_dim=1024, vision_heads=16, vision_hidden_dim=4096)
_VIT_1152 = dict(vision_depth=27, vision_dim=1152, vision_heads=16, vision_hidden_dim=4304)
_VIT_DEBUG = dict(vision_depth=2, vision_dim=64, vision_heads=4, vision_hidden_dim=128, vision_patch_size=8,
                  vision_num_position_embeddings=64)
_TOWERS = {"debugmodel": _VIT_DEBUG, "debugmodel_moe": _VIT_DEBUG, "0.8B": _VIT_768, "2B": _VIT_1024,
           "4B": _VIT_1024, "9B": _VIT_1152, "27B": _VIT_1152, "35B-A3B": _VIT_1152, "122B-A10B": _VIT_1152,
           "397B-A17B": _VIT_1152}
QWEN3_5_VL_FLAVORS: dict[str, Qwen3_5Args] = {
    (f"{name}_vl" if name.startswith("debug") else f"{name}-VL"): replace(args, **_TOWERS[name])
    for name, args in {**QWEN3_5_FLAVORS, **QWEN3_5_MOE_FLAVORS}.items()
}


def build(args: Qwen3_5Args):
    """The dense or the MoE model, as the flavor's arguments say."""
    return (Qwen3_5MoeTransformer if isinstance(args, Qwen3_5MoeArgs) else Qwen3_5Transformer)(args)


register_decoder("qwen3_5", build, Qwen3_5MoeArgs, {**QWEN3_5_FLAVORS, **QWEN3_5_MOE_FLAVORS, **QWEN3_5_VL_FLAVORS},
                 tp_plan=apply_tp, encoder_blocks="vision_encoder.layers",
                 validate=validate_qwen3_5, state_dict_adapter=state_dict_adapter)

__all__ = ["QWEN3_5_FLAVORS", "QWEN3_5_MOE_FLAVORS", "QWEN3_5_VL_FLAVORS", "Qwen3_5Args", "Qwen3_5MoeArgs", "Qwen3_5MoeStateDictAdapter",
           "Qwen3_5MoeTransformer", "Qwen3_5StateDictAdapter", "Qwen3_5Transformer"]
