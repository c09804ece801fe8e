"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM` weights and config.json.

Names (HF's, as DeepSeek's published safetensors write them), per block i:

    attention.wq_a / q_norm / wq_b   -> model.layers.i.self_attn.q_a_proj / q_a_layernorm / q_b_proj
    attention.wq  (q_lora_rank = 0)  -> self_attn.q_proj
    attention.wkv_a / kv_norm / wkv_b -> self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj
    attention.wo                     -> self_attn.o_proj
    feed_forward.w1 / w3 / w2        -> mlp.gate_proj / up_proj / down_proj             (dense blocks)
    feed_forward.router              -> mlp.gate                                        (MoE blocks)
    feed_forward.expert_bias         -> mlp.gate.e_score_correction_bias
    feed_forward.experts.w1 [e] ...  -> mlp.experts.{e}.gate_proj / up_proj / down_proj (one per expert)
    feed_forward.shared_experts.w*   -> mlp.shared_experts.gate_proj / up_proj / down_proj

Both keep the RoPE dimensions as interleaved pairs (HF's `rope_interleave = true`), so every tensor is
copied as is. The published checkpoint also holds the multi-token-prediction module as block
`num_hidden_layers` (`model.layers.61.*` in V3): with `mtp_depth` >= 1 it loads into `mtp.depths.0`
(`enorm`, `hnorm`, `eh_proj`, `shared_head.norm` -> `norm`, and the block's names as above; its
copies of the embedding and output head, `embed_tokens` and `shared_head.head`, are the model's own
and skipped), and is exported the same way; with `mtp_depth` 0 those keys are recognised and left
unused (`ignored_hf_prefixes`), as transformers does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.hf import DENSE_FFN_NAMES, LAYER, NORM_NAMES, TOP_NAMES, torch_dtype_name
from torchtrain.models.deepseek_v3.args import DeepseekV3Args
from torchtrain.models.state_dict_adapter import StateDictAdapter, moe_torchtitan_key

_BLOCK = {
    **NORM_NAMES,
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    **DENSE_FFN_NAMES,
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_EXPERTS = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
            "feed_forward.experts.w2": "down_proj"}


_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}


class DeepseekV3StateDictAdapter(StateDictAdapter):
    model_args: DeepseekV3Args
    architecture, model_type = "DeepseekV3ForCausalLM", "deepseek_v3"

    def hf_key(self, key: str) -> str:
        if key in TOP_NAMES:
            return TOP_NAMES[key]
        if key.startswith("mtp.depths."):
            k, _, rest = key.removeprefix("mtp.depths.").partition(".")
            if rest in _MTP:
                return f"model.layers.{self.model_args.n_layers + int(k)}.{_MTP[rest]}"
        match = LAYER.match(self.model_args.as_block_fqn(key))
        if match and match.group(2) in _BLOCK:
            return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}"
        raise KeyError(f"no Hugging Face name for deepseek_v3 parameter {key!r}")

    def hf_keys(self, key: str) -> list[str]:
        match = LAYER.match(self.model_args.as_block_fqn(key))
        if match and match.group(2) in _EXPERTS:
            layer, name = match.groups()
            return [f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[name]}.weight"
                    for e in range(self.model_args.num_experts)]
        return [self.hf_key(key)]

    def ignored_hf_prefixes(self) -> tuple[str, ...]:
        a = self.model_args
        if not a.mtp_depth:  # the published MTP module, stored as the block after the last one: not built
            return (f"model.layers.{a.n_layers}.",)
        # the MTP blocks' copies of the shared embedding and output head (the model's own are loaded)
        return tuple(f"model.layers.{a.n_layers + k}.{name}" for k in range(a.mtp_depth)
                     for name in ("embed_tokens.", "shared_head.head."))

    # ------------------------------------------------------------------ config.json
    def torchtitan_key(self, key: str, version: str) -> str:
        """MLA's projections keep their names (wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo) in both
        torchtitan versions; the MoE layer is `moe_torchtitan_key`'s."""
        return moe_torchtitan_key(key, version)

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        a = self.model_args
        if a.score_func != "sigmoid":
            raise ConfigError("[model.score_func] Hugging Face's DeepseekV3ForCausalLM scores experts with a sigmoid; "
                              "this model uses a softmax (the 16B flavor's routing), so it cannot be exported as "
                              "DeepSeek-V3")
        rope = ({"rope_type": "yarn", "rope_theta": a.rope_theta, "factor": a.rope_factor,
                 "original_max_position_embeddings": a.rope_original_max_seq_len, "beta_fast": a.rope_beta_fast,
                 "beta_slow": a.rope_beta_slow, "mscale": a.rope_mscale, "mscale_all_dim": a.rope_mscale_all_dim}
                if a.rope_factor > 1 else {"rope_type": "default", "rope_theta": a.rope_theta})
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "hidden_size": a.dim, "intermediate_size": a.hidden_dim, "moe_intermediate_size": a.moe_intermediate_size,
            "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_heads,
            "n_shared_experts": a.num_shared_experts, "n_routed_experts": a.num_experts,
            "num_experts_per_tok": a.num_experts_per_tok, "routed_scaling_factor": a.route_scale,
            "n_group": a.n_group, "topk_group": a.topk_group if a.n_group > 1 else 1,
            "norm_topk_prob": a.norm_topk_prob, "first_k_dense_replace": a.first_k_dense_replace,
            "q_lora_rank": a.q_lora_rank or None, "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim, "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps,
            "rope_parameters": rope, "rope_interleave": True, "max_position_embeddings": a.context_window(),
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "num_nextn_predict_layers": a.mtp_depth, "initializer_range": 0.02,
            "torch_dtype": torch_dtype_name(dtype),
        }

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        a = self.model_args
        structural = {
            "hidden_size": ("dim", a.dim), "intermediate_size": ("hidden_dim", a.hidden_dim),
            "moe_intermediate_size": ("moe_intermediate_size", a.moe_intermediate_size),
            "num_hidden_layers": ("n_layers", a.n_layers), "num_attention_heads": ("n_heads", a.n_heads),
            "n_shared_experts": ("num_shared_experts", a.num_shared_experts),
            "n_routed_experts": ("num_experts", a.num_experts),
            "num_experts_per_tok": ("num_experts_per_tok", a.num_experts_per_tok),
            "first_k_dense_replace": ("first_k_dense_replace", a.first_k_dense_replace),
            "q_lora_rank": ("q_lora_rank", a.q_lora_rank or None), "kv_lora_rank": ("kv_lora_rank", a.kv_lora_rank),
            "qk_nope_head_dim": ("qk_nope_head_dim", a.qk_nope_head_dim),
            "qk_rope_head_dim": ("qk_rope_head_dim", a.qk_rope_head_dim),
            "v_head_dim": ("v_head_dim", a.v_head_dim), "vocab_size": ("vocab_size", a.vocab_size),
        }
        for hf_name, (ours, value) in structural.items():
            if hf_name in config and config[hf_name] != value:
                raise ConfigError(f"[checkpoint.initial_load_path] {source}: config.json has {hf_name} = "
                                  f"{config[hf_name]} but this model has {value} (model.{ours}); set the [model] "
                                  f"arguments to match the HF model")
        if a.score_func != "sigmoid":
            raise ConfigError(f"[model.score_func] {source} is a DeepSeek-V3 checkpoint, which scores experts with a "
                              f"sigmoid; set model.score_func = \"sigmoid\"")
        if config.get("rope_interleave", True) is False:
            raise ConfigError(f"[checkpoint.initial_load_path] {source}: rope_interleave = false is not supported "
                              f"(torchtrain's DeepSeek-V3 rotates interleaved RoPE pairs, as the published weights)")
        warnings = []
        routing = {"routed_scaling_factor": ("route_scale", a.route_scale), "n_group": ("n_group", a.n_group),
                   "topk_group": ("topk_group", a.topk_group if a.n_group > 1 else 1),
                   "norm_topk_prob": ("norm_topk_prob", a.norm_topk_prob), "rms_norm_eps": ("norm_eps", a.norm_eps)}
        for hf_name, (ours, value) in routing.items():
            theirs = config.get(hf_name)
            if theirs is not None and not (theirs == value or (isinstance(theirs, float) and math.isclose(theirs, value))):
                warnings.append(f"{hf_name} {theirs} in {source} differs from model.{ours} {value}")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = rope.get("rope_theta", config.get("rope_theta"))
        if theta is not None and not math.isclose(theta, a.rope_theta):
            warnings.append(f"rope_theta {theta} in {source} differs from model.rope_theta {a.rope_theta}")
        factor = rope.get("factor") if rope.get("rope_type", rope.get("type")) == "yarn" else 1.0
        if factor is not None and not math.isclose(factor, a.rope_factor):
            warnings.append(f"YaRN factor {factor} in {source} differs from model.rope_factor {a.rope_factor}")
        if a.moe_load_balance_coeff == 0:
            warnings.append(f"{source}'s e_score_correction_bias is not used: model.moe_load_balance_coeff = 0 builds "
                            f"no routing bias (set it > 0, e.g. 0.001)")
        return warnings
