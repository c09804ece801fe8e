"""Llama 3 <-> Hugging Face `LlamaForCausalLM` weights and config.json.

Names: ``tok_embeddings`` -> ``model.embed_tokens``, ``layers.i.attention.w{q,k,v,o}`` ->
``model.layers.i.self_attn.{q,k,v,o}_proj``, ``feed_forward.w1/w3/w2`` -> ``mlp.gate/up/down_proj``,
``attention_norm`` / ``ffn_norm`` -> ``input_layernorm`` / ``post_attention_layernorm``, ``norm`` ->
``model.norm``, ``output`` -> ``lm_head`` (absent with tied embeddings).

RoPE layout: torchtrain rotates consecutive pairs (x[2i], x[2i+1]) of each head by angle_i
(`model.apply_rope`, Meta's layout); HF's ``rotate_half`` pairs x[i] with x[i + head_dim/2]. The
two compute the same attention when the rows of wq and wk are reordered within every head:

    HF row  p * head_dim/2 + j   =   torchtrain row  2j + p      (p in {0, 1}, j < head_dim/2)

i.e. ``w.view(heads, head_dim/2, 2, dim).transpose(1, 2)`` (to HF) and its inverse. q uses n_heads,
k uses n_kv_heads (grouped-query attention); v and o are not rotated, so they keep their layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchtrain.models.common.hf import DENSE_FFN_NAMES, NORM_NAMES, GQAStateDictAdapter
from torchtrain.models.llama3.args import Llama3Args

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    **DENSE_FFN_NAMES,
    **NORM_NAMES,
}


class Llama3StateDictAdapter(GQAStateDictAdapter):
    """The grouped-query-attention decoder's names and config (`models/common/hf.py`), with the RoPE row
    permutation and Llama 3's RoPE scaling."""

    model_args: Llama3Args
    architecture, model_type = "LlamaForCausalLM", "llama"
    layer_names = _LAYER_NAMES

    def _heads(self, key: str) -> int | None:
        if key.endswith("attention.wq.weight"):
            return self.model_args.n_heads
        if key.endswith("attention.wk.weight"):
            return self.model_args.kv_heads
        return None

    def to_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = self._heads(key)
        if heads is None:
            return tensor
        rows, dim = tensor.shape
        return tensor.reshape(heads, rows // heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)

    def from_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = self._heads(key)
        if heads is None:
            return tensor
        rows, dim = tensor.shape
        return tensor.reshape(heads, 2, rows // heads // 2, dim).transpose(1, 2).reshape(rows, dim)

    def intermediate_size(self) -> tuple[str, int]:
        return "ffn_dim_multiplier / multiple_of (the SwiGLU hidden size)", self.model_args.ffn_hidden_dim

    # ------------------------------------------------------------------ config.json
    def extra_config(self) -> dict[str, Any]:
        return {"mlp_bias": False}

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        a = self.model_args
        config = super().hf_config(dtype)
        if a.rope_scaling_factor is not None:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": a.rope_scaling_factor,
                "low_freq_factor": a.rope_low_freq_factor,
                "high_freq_factor": a.rope_high_freq_factor,
                "original_max_position_embeddings": a.rope_original_max_seq_len,
            }
            # HF expects the extended context to exceed the original one.
            extended = int(a.rope_original_max_seq_len * max(a.rope_scaling_factor, 1.0))
            config["max_position_embeddings"] = max(a.context_window(), extended)
        return config

    def structural_keys(self, config: dict[str, Any]) -> dict[str, tuple[str, Any, Any]]:
        keys = super().structural_keys(config)
        keys["head_dim"] = ("dim / n_heads", *keys["head_dim"][1:])
        return keys

    def rope_warnings(self, rope: dict[str, Any], source: str) -> list[str]:
        a = self.model_args
        factor = rope.get("factor") if rope.get("rope_type", rope.get("type")) == "llama3" else None
        if (factor is None) != (a.rope_scaling_factor is None) or (
                factor is not None and not math.isclose(factor, a.rope_scaling_factor)):
            return [f"RoPE scaling factor {factor} in {source} differs from model.rope_scaling_factor "
                    f"{a.rope_scaling_factor}"]
        return []
