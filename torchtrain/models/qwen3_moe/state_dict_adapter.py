"""Qwen3-MoE <-> Hugging Face `Qwen3MoeForCausalLM` weights and config.json.

Qwen3's names (`models/common/hf.py`) for attention, norms, embeddings and output; for
the MoE layer HF's per-expert layout -- the one Qwen's checkpoints use and transformers 5 loads (it
fuses the experts itself in memory, `mlp.experts.gate_up_proj`, and writes them back per expert):

    feed_forward.router.weight      (E, D)      -> mlp.gate.weight
    feed_forward.experts.w1 [e]     (E, H, D)   -> mlp.experts.{e}.gate_proj.weight   (H, D)
    feed_forward.experts.w3 [e]                 -> mlp.experts.{e}.up_proj.weight     (H, D)
    feed_forward.experts.w2 [e]     (E, D, H)   -> mlp.experts.{e}.down_proj.weight   (D, H)

(HF's Qwen3-MoE has no shared experts and routes with a softmax: a model configured otherwise is
refused on export.)

The auxiliary-loss-free routing bias (`feed_forward.expert_bias`, when moe_load_balance_coeff > 0)
has no Hugging Face counterpart: it is not exported, and it starts at zero on import.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.hf import ATTENTION_NAMES, GQAStateDictAdapter, expert_hf_keys
from torchtrain.models.qwen3_moe.args import Qwen3MoeArgs
from torchtrain.models.state_dict_adapter import moe_torchtitan_key

_MOE_NAMES = {"feed_forward.router.weight": "mlp.gate.weight"}


class Qwen3MoeStateDictAdapter(GQAStateDictAdapter):
    model_args: Qwen3MoeArgs
    architecture, model_type = "Qwen3MoeForCausalLM", "qwen3_moe"
    layer_names = {**ATTENTION_NAMES, **_MOE_NAMES}

    def hf_keys(self, key: str) -> list[str]:
        experts = expert_hf_keys(key, self.model_args.num_experts)
        return [self.hf_key(key)] if experts is None else experts

    def torchtitan_key(self, key: str, version: str) -> str:
        return moe_torchtitan_key(key, version)

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        a = self.model_args
        if a.score_func != "softmax" or a.num_shared_experts or a.route_scale != 1.0:
            raise ConfigError("[model] Hugging Face's Qwen3MoeForCausalLM routes with a softmax, no shared experts "
                              "and route_scale 1; this model differs (score_func / num_shared_experts / route_scale), "
                              "so it cannot be exported as Qwen3-MoE")
        return {
            **super().hf_config(dtype),
            "num_experts": a.num_experts,
            "num_experts_per_tok": a.num_experts_per_tok,
            "moe_intermediate_size": a.moe_intermediate_size,
            "norm_topk_prob": a.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": a.moe_aux_loss_coeff,
            "output_router_logits": False,
        }

    def structural_keys(self, config: dict[str, Any]) -> dict[str, tuple[str, Any, Any]]:
        a = self.model_args
        keys = super().structural_keys(config)
        keys.pop("intermediate_size")  # only used by dense layers, which this model has none of
        keys.update({
            "num_experts": ("num_experts", a.num_experts, config.get("num_local_experts")),
            "num_experts_per_tok": ("num_experts_per_tok", a.num_experts_per_tok, None),
            "moe_intermediate_size": ("moe_intermediate_size", a.moe_intermediate_size, None),
            "norm_topk_prob": ("norm_topk_prob", a.norm_topk_prob, False),
        })
        return keys

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        sparse_step, dense_layers = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
        if sparse_step != 1 or dense_layers:
            raise ConfigError(f"[checkpoint.initial_load_path] {source}: decoder_sparse_step = {sparse_step}, "
                              f"mlp_only_layers = {dense_layers}: torchtrain's Qwen3-MoE has an MoE feed-forward "
                              f"in every block")
        return super().check_hf_config(config, source)
