"""gpt-oss <-> Hugging Face `GptOssForCausalLM` weights and config.json.

Names: the decoder family's (`models/common/hf.py`) for embeddings, norms and the attention
projections (weights and biases), and

    attention.sinks.weight               (H,)         -> self_attn.sinks
    feed_forward.router.weight / .bias   (E, D), (E,) -> mlp.router.weight / .bias
    feed_forward.experts.w13  (E, 2F, D) gate rows, then up rows  <-> mlp.experts.gate_up_proj (E, D, 2F),
                              its columns interleaved: gate_0, up_0, gate_1, up_1, ...
    feed_forward.experts.b13  (E, 2F)                              <-> mlp.experts.gate_up_proj_bias (interleaved)
    feed_forward.experts.w2   (E, D, F)                            <-> mlp.experts.down_proj (E, F, D)
    feed_forward.experts.b2   (E, D)                               <-> mlp.experts.down_proj_bias

(the routing bias of auxiliary-loss-free balancing, `feed_forward.expert_bias`, is not stored by HF).

**MXFP4 checkpoints** (OpenAI's published files): each expert matrix is stored as `<name>_blocks`
(uint8, (E, rows, cols / 32, 16): two 4-bit e2m1 values a byte, the low nibble first) and
`<name>_scales` (uint8, (E, rows, cols / 32): one power-of-two exponent, biased by 127, per 32 values):

    value = E2M1[nibble] x 2^(scale - 127),   E2M1 = (0, .5, 1, 1.5, 2, 3, 4, 6) and their negatives

with rows x cols = (2F, D) for gate_up_proj (rows interleaved gate/up) and (D, F) for down_proj: the
(out, in) layout of torchtrain's stacked experts. A folder holding `_blocks` tensors is read through
`MXFP4Reading`, which dequantizes them in float32 on import (exports are written unquantized); a
blocks/scales pair that does not fit that layout is refused with an error naming the tensor, never
loaded wrong.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtrain.models.common.hf import ATTENTION_NAMES, LAYER, GQAStateDictAdapter
from torchtrain.models.gpt_oss.args import GptOssArgs
from torchtrain.models.state_dict_adapter import moe_torchtitan_key

_BIASED = {f"attention.w{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkvo"}
_GPT_OSS_NAMES = {
    **{k: v for k, v in ATTENTION_NAMES.items() if "_norm" not in k or "layernorm" in v},
    **_BIASED,
    "attention.sinks.weight": "self_attn.sinks",
    "feed_forward.router.weight": "mlp.router.weight",
    "feed_forward.router.bias": "mlp.router.bias",
    "feed_forward.experts.w13": "mlp.experts.gate_up_proj",
    "feed_forward.experts.b13": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[gate rows; up rows] along `dim` -> gate_0, up_0, gate_1, up_1, ..."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `interleave`."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """(..., rows, groups, 16) uint8 blocks and (..., rows, groups) uint8 exponents -> (..., rows, groups x 32)
    float32 (module doc). ValueError naming `name` when the pair does not have that layout."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8 (got {blocks.dtype}, {scales.dtype})")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks = scales' shape + (16,): 32 four-bit values per scale)")
    table = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


class GptOssStateDictAdapter(GQAStateDictAdapter):
    model_args: GptOssArgs
    architecture, model_type = "GptOssForCausalLM", "gpt_oss"
    layer_names = _GPT_OSS_NAMES

    def hf_keys(self, key: str) -> list[str]:
        match = LAYER.match(key)
        if match and match.group(2) == "feed_forward.expert_bias":
            return []
        return [self.hf_key(key)]

    def to_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if key.endswith("experts.w13"):
            return interleave(tensor, 1).transpose(1, 2)
        if key.endswith("experts.b13"):
            return interleave(tensor, 1)
        if key.endswith("experts.w2"):
            return tensor.transpose(1, 2)
        return tensor

    def from_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if key.endswith("experts.w13"):
            return deinterleave(tensor.transpose(1, 2), 1)
        if key.endswith("experts.b13"):
            return deinterleave(tensor, 1)
        if key.endswith("experts.w2"):
            return tensor.transpose(1, 2)
        return tensor

    def torchtitan_key(self, key: str, version: str) -> str:
        return moe_torchtitan_key(key, version)

    def intermediate_size(self) -> tuple[str, int]:
        return "moe_intermediate_size", self.model_args.moe_intermediate_size

    def reading(self, available: set[str]) -> "GptOssStateDictAdapter":
        if any(k.endswith("_blocks") for k in available):
            return MXFP4Reading(self.model_args)
        return self

    # ------------------------------------------------------------------ config.json
    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        a = self.model_args
        config = super().hf_config(dtype)
        config.update({
            "attention_bias": True,
            "num_local_experts": a.num_experts,
            "num_experts_per_tok": a.num_experts_per_tok,
            "sliding_window": a.sliding_window,
            "layer_types": ["sliding_attention" if a.is_sliding(i) else "full_attention" for i in range(a.n_layers)],
            "swiglu_limit": a.swiglu_limit,
            "swiglu_alpha": a.swiglu_alpha,
            "router_aux_loss_coef": a.moe_aux_loss_coeff,
            "output_router_logits": False,
        })
        return config

    def rope_config(self) -> dict[str, Any]:
        a = self.model_args
        return {"rope_parameters": {"rope_type": "yarn", "rope_theta": a.rope_theta, "factor": a.rope_factor,
                                    "original_max_position_embeddings": a.rope_original_max_seq_len,
                                    "beta_fast": a.rope_beta_fast, "beta_slow": a.rope_beta_slow, "truncate": False}}

    def extra_config(self) -> dict[str, Any]:
        return {"attention_dropout": 0.0}

    def structural_keys(self, config: dict[str, Any]) -> dict[str, tuple[str, Any, Any]]:
        a = self.model_args
        keys = super().structural_keys(config)
        keys.update({
            "num_local_experts": ("num_experts", a.num_experts, None),
            "num_experts_per_tok": ("num_experts_per_tok", a.num_experts_per_tok, None),
            "sliding_window": ("sliding_window", a.sliding_window, None),
            "layer_types": ("full_attention_interval",
                            ["sliding_attention" if a.is_sliding(i) else "full_attention" for i in range(a.n_layers)],
                            None),
        })
        return keys

    def rope_warnings(self, rope: dict[str, Any], source: str) -> list[str]:
        a = self.model_args
        if rope.get("rope_type", rope.get("type")) != "yarn":
            return [f"RoPE {rope.get('rope_type')!r} in {source}: torchtrain's gpt-oss applies YaRN"]
        warnings = []
        for hf_name, ours in (("factor", "rope_factor"), ("original_max_position_embeddings", "rope_original_max_seq_len"),
                              ("beta_fast", "rope_beta_fast"), ("beta_slow", "rope_beta_slow")):
            if hf_name in rope and float(rope[hf_name]) != float(getattr(a, ours)):
                warnings.append(f"rope_parameters.{hf_name} {rope[hf_name]} in {source} differs from model.{ours} "
                                f"{getattr(a, ours)}")
        return warnings

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        warnings = super().check_hf_config(config, source)
        for hf_name, ours in (("swiglu_limit", "swiglu_limit"), ("swiglu_alpha", "swiglu_alpha")):
            if hf_name in config and float(config[hf_name]) != float(getattr(self.model_args, ours)):
                warnings.append(f"{hf_name} {config[hf_name]} in {source} differs from model.{ours} "
                                f"{getattr(self.model_args, ours)}")
        return warnings


class MXFP4Reading(GptOssStateDictAdapter):
    """Reads a folder whose expert matrices are MXFP4 `_blocks` / `_scales` pairs (module doc)."""

    def hf_keys(self, key: str) -> list[str]:
        names = super().hf_keys(key)
        if key.endswith(("experts.w13", "experts.w2")):
            return [f"{names[0]}_blocks", f"{names[0]}_scales"]
        return names

    def from_hf_tensors(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not key.endswith(("experts.w13", "experts.w2")):
            return super().from_hf_tensors(key, tensors)
        weight = dequantize_mxfp4(tensors[0], tensors[1], self.hf_keys(key)[0])  # (E, rows, cols): (out, in)
        return deinterleave(weight, 1) if key.endswith("w13") else weight
