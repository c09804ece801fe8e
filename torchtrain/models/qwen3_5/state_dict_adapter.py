"""Qwen3.5 <-> Hugging Face `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` weights and config.json.

Names: the decoder family's (`models/common/hf.py`) for embeddings, norms, the full-attention layers
(`self_attn.*`: the query projection holds each head's query rows then its gate rows, as here) and the
dense SwiGLU; a linear-attention layer is `linear_attn.*`:

    attention.in_proj_q / _k / _v   -> in_proj_qkv.weight   rows [q | k | v] (one HF tensor, three parts)
    attention.conv_q / _k / _v      -> conv1d.weight        (C, 1, K), channels [q | k | v]
    attention.in_proj_z / _b / _a, attention.out_proj, attention.norm  -> the same names
    attention.decay.A_log / .dt_bias                         -> A_log, dt_bias

torchtrain keeps the fused projection and convolution as three parameters each, so that tensor
parallelism splits each by heads (`StateDictAdapter.hf_part`). The MoE layer is HF's per-expert layout
(`mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/down_proj`), its shared expert `mlp.shared_expert.*`
and gate `mlp.shared_expert_gate`.

Published Qwen3.5 checkpoints are vision-language models: their text decoder's tensors live under
`model.language_model.` and config.json holds it as `text_config`. Such a folder is read as its text
decoder (`Qwen3_5VLMReading`): the vision tower (`model.visual.*`) and multi-token-prediction layers (`mtp.*`)
are not loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtrain.models.common.hf import ATTENTION_NAMES, DENSE_FFN_NAMES, GQAStateDictAdapter, expert_hf_keys
from torchtrain.models.common.linear_attention import from_fused, fused_part, to_fused
from torchtrain.models.qwen3_5.args import Qwen3_5Args, Qwen3_5MoeArgs
from torchtrain.models.state_dict_adapter import moe_torchtitan_key

_LINEAR_NAMES = {
    **{f"attention.in_proj_{p}.weight": "linear_attn.in_proj_qkv.weight" for p in "qkv"},
    **{f"attention.conv_{p}.weight": "linear_attn.conv1d.weight" for p in "qkv"},
    **{f"attention.in_proj_{p}.weight": f"linear_attn.in_proj_{p}.weight" for p in "zba"},
    "attention.out_proj.weight": "linear_attn.out_proj.weight",
    "attention.norm.weight": "linear_attn.norm.weight",
    "attention.decay.A_log": "linear_attn.A_log",
    "attention.decay.dt_bias": "linear_attn.dt_bias",
}
_MOE_NAMES = {
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
VLM_PREFIX = "model.language_model."


class Qwen3_5StateDictAdapter(GQAStateDictAdapter):
    model_args: Qwen3_5Args
    architecture, model_type = "Qwen3_5ForCausalLM", "qwen3_5_text"
    layer_names = {**ATTENTION_NAMES, **DENSE_FFN_NAMES, **_LINEAR_NAMES, **_MOE_NAMES}

    def hf_part(self, key: str) -> int | None:
        part = fused_part(key)
        return part[2] if part is not None else None

    def hf_keys(self, key: str) -> list[str]:
        experts = expert_hf_keys(key, self.model_args.num_experts)
        return [self.hf_key(key)] if experts is None else experts

    def to_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        return to_fused(key, tensor) if fused_part(key) else tensor

    def from_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if fused_part(key) is None:
            return tensor
        a = self.model_args
        return from_fused(key, tensor, a.linear_num_key_heads * a.linear_key_head_dim,
                          a.linear_num_value_heads * a.linear_value_head_dim)

    def reading(self, available: set[str]) -> GQAStateDictAdapter:
        if any(k.startswith(VLM_PREFIX) for k in available):
            moe = isinstance(self.model_args, Qwen3_5MoeArgs)
            return (Qwen3_5MoeVLMReading if moe else Qwen3_5VLMReading)(self.model_args)
        return self

    def ignored_hf_prefixes(self) -> tuple[str, ...]:
        return ("mtp.",)

    # ------------------------------------------------------------------ config.json
    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        a = self.model_args
        config = super().hf_config(dtype)
        config.update({
            "layer_types": self.layer_types(),
            "linear_conv_kernel_dim": a.linear_conv_kernel_dim,
            "linear_key_head_dim": a.linear_key_head_dim,
            "linear_value_head_dim": a.linear_value_head_dim,
            "linear_num_key_heads": a.linear_num_key_heads,
            "linear_num_value_heads": a.linear_num_value_heads,
        })
        return config

    def rope_config(self) -> dict[str, Any]:
        a = self.model_args
        return {"rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta,
                                    "partial_rotary_factor": a.partial_rotary_factor}}

    def extra_config(self) -> dict[str, Any]:
        return {"attention_dropout": 0.0}

    def layer_types(self) -> list[str]:
        a = self.model_args
        return ["full_attention" if a.is_full(i) else "linear_attention" for i in range(a.n_layers)]

    def structural_keys(self, config: dict[str, Any]) -> dict[str, tuple[str, Any, Any]]:
        a = self.model_args
        keys = super().structural_keys(config)
        keys.update({
            "layer_types": ("full_attention_interval", self.layer_types(), None),
            "linear_conv_kernel_dim": ("linear_conv_kernel_dim", a.linear_conv_kernel_dim, None),
            "linear_key_head_dim": ("linear_key_head_dim", a.linear_key_head_dim, None),
            "linear_value_head_dim": ("linear_value_head_dim", a.linear_value_head_dim, None),
            "linear_num_key_heads": ("linear_num_key_heads", a.linear_num_key_heads, None),
            "linear_num_value_heads": ("linear_num_value_heads", a.linear_num_value_heads, None),
        })
        return keys

    def rope_warnings(self, rope: dict[str, Any], source: str) -> list[str]:
        warnings = super().rope_warnings(rope, source)
        factor = rope.get("partial_rotary_factor")
        if factor is not None and float(factor) != self.model_args.partial_rotary_factor:
            warnings.append(f"partial_rotary_factor {factor} in {source} differs from model.partial_rotary_factor "
                            f"{self.model_args.partial_rotary_factor}")
        return warnings

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        return super().check_hf_config(config.get("text_config") or config, source)

    def torchtitan_key(self, key: str, version: str) -> str:
        return moe_torchtitan_key(key, version)


class Qwen3_5MoeStateDictAdapter(Qwen3_5StateDictAdapter):
    model_args: Qwen3_5MoeArgs
    architecture, model_type = "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"

    def intermediate_size(self) -> tuple[str, int]:
        return "moe_intermediate_size", self.model_args.moe_intermediate_size

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        a = self.model_args
        config = super().hf_config(dtype)
        config.pop("intermediate_size")
        config.update({"num_experts": a.num_experts, "num_experts_per_tok": a.num_experts_per_tok,
                       "moe_intermediate_size": a.moe_intermediate_size,
                       "shared_expert_intermediate_size": a.moe_intermediate_size * a.num_shared_experts,
                       "router_aux_loss_coef": a.moe_aux_loss_coeff, "output_router_logits": False})
        return config

    def structural_keys(self, config: dict[str, Any]) -> dict[str, tuple[str, Any, Any]]:
        a = self.model_args
        keys = super().structural_keys(config)
        keys.pop("intermediate_size")
        keys.update({
            "num_experts": ("num_experts", a.num_experts, None),
            "num_experts_per_tok": ("num_experts_per_tok", a.num_experts_per_tok, None),
            "moe_intermediate_size": ("moe_intermediate_size", a.moe_intermediate_size, None),
            "shared_expert_intermediate_size": ("moe_intermediate_size x num_shared_experts",
                                                a.moe_intermediate_size * a.num_shared_experts, None),
        })
        return keys


class _LanguageModelNames:
    """Mixin reading a Qwen3.5 vision-language folder's text decoder (module doc): its tensors under
    `model.language_model.`; the vision tower and the MTP layers left out."""

    def hf_keys(self, key: str) -> list[str]:
        return [VLM_PREFIX + k.removeprefix("model.") if k.startswith("model.") else k for k in super().hf_keys(key)]

    def ignored_hf_prefixes(self) -> tuple[str, ...]:
        return ("mtp.", "model.visual.")

    def reading(self, available: set[str]) -> GQAStateDictAdapter:
        return self


class Qwen3_5VLMReading(_LanguageModelNames, Qwen3_5StateDictAdapter):
    pass


class Qwen3_5MoeVLMReading(_LanguageModelNames, Qwen3_5MoeStateDictAdapter):
    pass
