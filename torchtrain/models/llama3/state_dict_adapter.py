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
import re
from typing import Any

import torch

from torchtrain.config.fields import ConfigError
from torchtrain.models.llama3.args import Llama3Args
from torchtrain.models.state_dict_adapter import StateDictAdapter

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class Llama3StateDictAdapter(StateDictAdapter):
    model_args: Llama3Args

    def hf_key(self, key: str) -> str:
        if key in _TOP_NAMES:
            return _TOP_NAMES[key]
        match = _LAYER.match(key)
        if match and match.group(2) in _LAYER_NAMES:
            return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
        raise KeyError(f"no Hugging Face name for llama3 parameter {key!r}")

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

    def ignored_hf_keys(self) -> set[str]:
        # Tied checkpoints sometimes store lm_head.weight although it equals the embedding.
        return {"lm_head.weight"} if self.model_args.tie_word_embeddings else set()

    # ------------------------------------------------------------------ config.json
    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        a = self.model_args
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "torch_dtype": str(dtype).replace("torch.", ""),
        }
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
            config["max_position_embeddings"] = max(a.max_seq_len, extended)
        return config

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        a = self.model_args
        structural = {
            "hidden_size": ("dim", a.dim),
            "num_hidden_layers": ("n_layers", a.n_layers),
            "num_attention_heads": ("n_heads", a.n_heads),
            "num_key_value_heads": ("n_kv_heads", a.kv_heads),
            "vocab_size": ("vocab_size", a.vocab_size),
            "intermediate_size": ("ffn_dim_multiplier / multiple_of (the SwiGLU hidden size)", a.ffn_hidden_dim),
            "head_dim": ("dim / n_heads", a.head_dim),
            "tie_word_embeddings": ("tie_word_embeddings", a.tie_word_embeddings),
        }
        defaults = {"num_key_value_heads": config.get("num_attention_heads"), "tie_word_embeddings": False,
                    "head_dim": (config.get("hidden_size") or 0) // max(config.get("num_attention_heads") or 1, 1)}
        for hf_name, (ours, value) in structural.items():
            theirs = config.get(hf_name, defaults.get(hf_name))
            if theirs is not None and theirs != value:
                raise ConfigError(
                    f"[checkpoint.initial_load_path] {source}: config.json has {hf_name} = {theirs} but this "
                    f"model has {value} (model.{ours}); set the [model] arguments to match the HF model"
                )
        warnings = []
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = config.get("rope_theta", rope.get("rope_theta"))
        if theta is not None and not math.isclose(theta, a.rope_theta):
            warnings.append(f"rope_theta {theta} in {source} differs from model.rope_theta {a.rope_theta}")
        factor = rope.get("factor") if rope.get("rope_type", rope.get("type")) == "llama3" else None
        if (factor is None) != (a.rope_scaling_factor is None) or (
                factor is not None and not math.isclose(factor, a.rope_scaling_factor)):
            warnings.append(f"RoPE scaling factor {factor} in {source} differs from model.rope_scaling_factor "
                            f"{a.rope_scaling_factor}")
        eps = config.get("rms_norm_eps")
        if eps is not None and not math.isclose(eps, a.norm_eps):
            warnings.append(f"rms_norm_eps {eps} in {source} differs from model.norm_eps {a.norm_eps}")
        return warnings
