"""Hugging Face names and config.json pieces the decoder families share, and the adapter of the
grouped-query-attention decoders (Llama 3 and Qwen3 shapes).

Names: ``tok_embeddings`` -> ``model.embed_tokens``, ``layers.i.attention.w{q,k,v,o}`` ->
``model.layers.i.self_attn.{q,k,v,o}_proj``, ``attention.{q,k}_norm`` -> ``self_attn.{q,k}_norm``,
``feed_forward.w1/w3/w2`` -> ``mlp.gate/up/down_proj``, ``attention_norm`` / ``ffn_norm`` ->
``input_layernorm`` / ``post_attention_layernorm``, ``norm`` -> ``model.norm``, ``output`` ->
``lm_head`` (absent with tied embeddings). `GQAStateDictAdapter` copies every tensor as is (the "rotate
half" RoPE layout of HF and Qwen3); Llama 3 permutes the query/key rows on top of it.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import torch

from torchtrain.config.fields import ConfigError
from torchtrain.models.state_dict_adapter import StateDictAdapter

LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
NORM_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    **NORM_NAMES,
}
DENSE_FFN_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
EXPERT_NAMES = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
                "feed_forward.experts.w2": "down_proj"}
"""A routed-expert tensor (E, ...) and HF's per-expert name of its slices (`mlp.experts.{e}.<name>.weight`)."""


def expert_hf_keys(key: str, num_experts: int) -> list[str] | None:
    """HF's per-expert keys of a routed-expert tensor, [] for the routing bias (no HF counterpart: not
    exported, zero on import), None for any other key."""
    match = LAYER.match(key)
    if match is None:
        return None
    layer, name = match.groups()
    if name in EXPERT_NAMES:
        return [f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_NAMES[name]}.weight" for e in range(num_experts)]
    return [] if name == "feed_forward.expert_bias" else None


def torch_dtype_name(dtype: torch.dtype) -> str:
    """config.json's `torch_dtype` value."""
    return str(dtype).replace("torch.", "")


def float_warnings(config: dict[str, Any], source: str, pairs: dict[str, tuple[str, float]]) -> list[str]:
    """A warning for every HF float setting (`hf name -> (our key, our value)`) that differs from ours."""
    warnings = []
    for hf_name, (ours, value) in pairs.items():
        theirs = config.get(hf_name)
        if theirs is not None and not math.isclose(theirs, value):
            warnings.append(f"{hf_name} {theirs} in {source} differs from model.{ours} {value}")
    return warnings


class GQAStateDictAdapter(StateDictAdapter):
    """Adapter of a grouped-query-attention decoder whose arguments have `dim`, `n_layers`, `n_heads`,
    `kv_heads`, `head_dim`, `vocab_size`, `norm_eps`, `rope_theta`, `max_seq_len` and
    `tie_word_embeddings` (Qwen3's config.json; Llama 3 states its differences). A subclass names its HF
    architecture, its block names and its feed-forward's size (`intermediate_size`)."""

    architecture: ClassVar[str]
    model_type: ClassVar[str]
    layer_names: ClassVar[dict[str, str]] = {**ATTENTION_NAMES, **DENSE_FFN_NAMES}

    def hf_key(self, key: str) -> str:
        if key in TOP_NAMES:
            return TOP_NAMES[key]
        match = LAYER.match(key)
        if match and match.group(2) in self.layer_names:
            return f"model.layers.{match.group(1)}.{self.layer_names[match.group(2)]}"
        raise KeyError(f"no Hugging Face name for {self.model_type} parameter {key!r}")

    def ignored_hf_keys(self) -> set[str]:
        # Tied checkpoints sometimes store lm_head.weight although it equals the embedding.
        return {"lm_head.weight"} if self.model_args.tie_word_embeddings else set()

    def intermediate_size(self) -> tuple[str, int]:
        """(our key, value) of the dense feed-forward's hidden size (HF intermediate_size)."""
        return "hidden_dim", self.model_args.hidden_dim

    # ------------------------------------------------------------------ config.json
    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        a = self.model_args
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": a.dim,
            "intermediate_size": self.intermediate_size()[1],
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            **self.rope_config(),
            "max_position_embeddings": a.context_window(),
            "tie_word_embeddings": a.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            **self.extra_config(),
            "initializer_range": 0.02,
            "torch_dtype": torch_dtype_name(dtype),
        }

    def rope_config(self) -> dict[str, Any]:
        """config.json's RoPE settings (plain RoPE; a family with scaled or partial RoPE states its
        `rope_parameters`)."""
        return {"rope_theta": self.model_args.rope_theta, "rope_scaling": None}

    def extra_config(self) -> dict[str, Any]:
        """The architecture's own config.json switches (Qwen3's: no attention dropout or sliding window)."""
        return {"attention_dropout": 0.0, "use_sliding_window": False}

    def structural_keys(self, config: dict[str, Any]) -> dict[str, tuple[str, Any, Any]]:
        """HF key -> (our key, our value, HF's default) of every setting that changes the tensors."""
        a = self.model_args
        return {
            "hidden_size": ("dim", a.dim, None),
            "num_hidden_layers": ("n_layers", a.n_layers, None),
            "num_attention_heads": ("n_heads", a.n_heads, None),
            "num_key_value_heads": ("n_kv_heads", a.kv_heads, config.get("num_attention_heads")),
            "head_dim": ("head_dim", a.head_dim,
                         (config.get("hidden_size") or 0) // max(config.get("num_attention_heads") or 1, 1)),
            "vocab_size": ("vocab_size", a.vocab_size, None),
            "intermediate_size": (*self.intermediate_size(), None),
            "tie_word_embeddings": ("tie_word_embeddings", a.tie_word_embeddings, False),
        }

    def rope_warnings(self, rope: dict[str, Any], source: str) -> list[str]:
        """Warnings about the checkpoint's RoPE scaling (`rope_parameters` / `rope_scaling`) and other
        settings that load but behave differently: Qwen3's models apply plain RoPE, no sliding window."""
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None):
            return [f"RoPE scaling {kind!r} in {source} is not applied by torchtrain's {self.architecture} "
                    f"(plain RoPE)"]
        return []

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        for hf_name, (ours, value, default) in self.structural_keys(config).items():
            theirs = config.get(hf_name, default)
            if theirs is not None and theirs != value:
                raise ConfigError(
                    f"[checkpoint.initial_load_path] {source}: config.json has {hf_name} = {theirs} but this "
                    f"model has {value} (model.{ours}); set the [model] arguments to match the HF model"
                )
        a = self.model_args
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = config.get("rope_theta", rope.get("rope_theta"))
        warnings = float_warnings({"rope_theta": theta}, source, {"rope_theta": ("rope_theta", a.rope_theta)})
        warnings += self.rope_warnings(rope, source)
        warnings += float_warnings(config, source, {"rms_norm_eps": ("norm_eps", a.norm_eps)})
        if config.get("use_sliding_window"):
            warnings.append(f"{source} enables sliding-window attention, which torchtrain's {self.architecture} "
                            f"does not apply")
        return warnings
