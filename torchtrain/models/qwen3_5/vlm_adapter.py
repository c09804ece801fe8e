"""Qwen3.5 with its vision encoder <-> Hugging Face `Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration` weights and config.json.

The text decoder's tensors are the text model's names (`state_dict_adapter.py`) under `model.language_model.`
(the output head stays `lm_head`); the encoder's live under `model.visual.`:

    vision_encoder.patch_embed.{weight,bias}      -> patch_embed.proj.{weight,bias}  (HF: a Conv3d kernel
                                                     (D, C, T, p, p), here its rows flattened (D, C T p p))
    vision_encoder.pos_embed.weight               -> pos_embed.weight
    vision_encoder.layers.i.attention.w{q,k,v}.*  -> blocks.i.attn.qkv.*   rows [q | k | v] (three parts)
    vision_encoder.layers.i.attention.wo.*        -> blocks.i.attn.proj.*
    vision_encoder.layers.i.attention_norm / ffn_norm    -> blocks.i.norm1 / norm2
    vision_encoder.layers.i.feed_forward.w1 / w2         -> blocks.i.mlp.linear_fc1 / linear_fc2
    vision_encoder.merger.norm / w1 / w2          -> merger.norm / linear_fc1 / linear_fc2

config.json holds the decoder as `text_config` (with its multimodal RoPE sections) and the encoder as
`vision_config`; the multi-token-prediction layers (`mtp.*`) are not loaded.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtrain.config.fields import ConfigError
from torchtrain.models.qwen3_5.args import Qwen3_5MoeArgs
from torchtrain.models.qwen3_5.state_dict_adapter import (
    VLM_PREFIX,
    Qwen3_5MoeStateDictAdapter,
    Qwen3_5StateDictAdapter,
)

VISUAL = "model.visual."
_TOP = {"patch_embed.weight": "patch_embed.proj.weight", "patch_embed.bias": "patch_embed.proj.bias",
        "pos_embed.weight": "pos_embed.weight",
        **{f"merger.{ours}.{p}": f"merger.{theirs}.{p}" for ours, theirs in
           (("norm", "norm"), ("w1", "linear_fc1"), ("w2", "linear_fc2")) for p in ("weight", "bias")}}
_BLOCK = {f"{ours}.{p}": f"{theirs}.{p}" for ours, theirs in
          (("attention_norm", "norm1"), ("ffn_norm", "norm2"), ("attention.wo", "attn.proj"),
           ("feed_forward.w1", "mlp.linear_fc1"), ("feed_forward.w2", "mlp.linear_fc2"),
           *((f"attention.w{x}", "attn.qkv") for x in "qkv")) for p in ("weight", "bias")}
_VISION_LAYER = re.compile(r"^vision_encoder\.layers\.(\d+)\.(.+)$")
_QKV_PART = re.compile(r"\.attention\.w([qkv])\.")


class _VisionLanguage:
    """Mixin over the text adapter: the names and config.json of the vision-language checkpoint (module doc)."""

    architecture_vl: str
    model_type_vl: str

    def hf_keys(self, key: str) -> list[str]:
        if key.startswith("vision_encoder."):
            return [self._vision_key(key)]
        return [VLM_PREFIX + k.removeprefix("model.") if k.startswith("model.") else k for k in super().hf_keys(key)]

    def hf_key(self, key: str) -> str:
        return self._vision_key(key) if key.startswith("vision_encoder.") else super().hf_key(key)

    @staticmethod
    def _vision_key(key: str) -> str:
        match = _VISION_LAYER.match(key)
        if match:
            return f"{VISUAL}blocks.{match.group(1)}.{_BLOCK[match.group(2)]}"
        return VISUAL + _TOP[key.removeprefix("vision_encoder.")]

    def hf_part(self, key: str) -> int | None:
        if key.startswith("vision_encoder."):
            part = _QKV_PART.search(key)
            return "qkv".index(part.group(1)) if part else None
        return super().hf_part(key)

    def to_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if key == "vision_encoder.patch_embed.weight":
            a = self.model_args
            p = a.vision_patch_size
            return tensor.reshape(tensor.shape[0], a.vision_in_channels, a.vision_temporal_patch_size, p, p)
        return tensor if key.startswith("vision_encoder.") else super().to_hf(key, tensor)

    def from_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if key == "vision_encoder.patch_embed.weight":
            return tensor.reshape(tensor.shape[0], -1)
        if key.startswith("vision_encoder."):
            part = self.hf_part(key)
            if part is None:
                return tensor
            width = self.model_args.vision_dim
            return tensor[part * width:(part + 1) * width]
        return super().from_hf(key, tensor)

    def reading(self, available: set[str]):
        return self

    def ignored_hf_prefixes(self) -> tuple[str, ...]:
        return ("mtp.",)

    # ------------------------------------------------------------------ config.json
    def vision_config(self) -> dict[str, Any]:
        a = self.model_args
        return {"model_type": f"{self.model_type_vl}_vision", "depth": a.vision_depth, "hidden_size": a.vision_dim,
                "num_heads": a.vision_heads, "intermediate_size": a.vision_hidden_dim,
                "hidden_act": "gelu_pytorch_tanh", "in_channels": a.vision_in_channels,
                "patch_size": a.vision_patch_size, "temporal_patch_size": a.vision_temporal_patch_size,
                "spatial_merge_size": a.vision_merge_size, "out_hidden_size": a.dim,
                "num_position_embeddings": a.vision_num_position_embeddings,
                "rope_parameters": {"rope_type": "axial", "rope_theta": a.vision_rope_theta},
                "initializer_range": 0.02}

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        a = self.model_args
        text = super().hf_config(dtype)
        text.pop("architectures")
        return {"architectures": [self.architecture_vl], "model_type": self.model_type_vl, "text_config": text,
                "vision_config": self.vision_config(), "image_token_id": a.image_token_id,
                "vision_start_token_id": a.vision_start_token_id, "vision_end_token_id": a.vision_end_token_id,
                "tie_word_embeddings": a.tie_word_embeddings, "torch_dtype": text["torch_dtype"]}

    def rope_config(self) -> dict[str, Any]:
        config = super().rope_config()
        config["rope_parameters"].update(mrope_section=list(self.model_args.mrope_section), mrope_interleaved=True)
        return config

    def context_length(self, config: dict[str, Any]) -> int:
        text = config.get("text_config")
        return super().context_length(text if isinstance(text, dict) else config)

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError(f"[checkpoint.initial_load_path] {source}: config.json has no vision_config, but "
                              f"model.vision_depth is {self.model_args.vision_depth}: load a vision-language "
                              f"checkpoint, or set --model.vision_depth 0 to train the text decoder alone")
        a = self.model_args
        ours = {"depth": ("vision_depth", a.vision_depth), "hidden_size": ("vision_dim", a.vision_dim),
                "num_heads": ("vision_heads", a.vision_heads),
                "intermediate_size": ("vision_hidden_dim", a.vision_hidden_dim),
                "patch_size": ("vision_patch_size", a.vision_patch_size),
                "temporal_patch_size": ("vision_temporal_patch_size", a.vision_temporal_patch_size),
                "spatial_merge_size": ("vision_merge_size", a.vision_merge_size),
                "in_channels": ("vision_in_channels", a.vision_in_channels),
                "num_position_embeddings": ("vision_num_position_embeddings", a.vision_num_position_embeddings),
                "out_hidden_size": ("dim", a.dim)}
        for name, (key, value) in ours.items():
            if name in vision and vision[name] != value:
                raise ConfigError(f"[checkpoint.initial_load_path] {source}: vision_config.{name} = {vision[name]} "
                                  f"but this model has {value} (model.{key}); set the [model] arguments to match")
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ConfigError(f"[checkpoint.initial_load_path] {source}: vision_config.hidden_act "
                              f"{vision['hidden_act']!r} is not the encoder's tanh-approximated GELU")
        warnings = super().check_hf_config(config, source)
        for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if name in config and config[name] != getattr(a, name):
                warnings.append(f"{name} {config[name]} in {source} differs from model.{name} {getattr(a, name)} "
                                f"(the tokenizer's id is used)")
        return warnings


class Qwen3_5VLStateDictAdapter(_VisionLanguage, Qwen3_5StateDictAdapter):
    architecture_vl, model_type_vl = "Qwen3_5ForConditionalGeneration", "qwen3_5"


class Qwen3_5MoeVLStateDictAdapter(_VisionLanguage, Qwen3_5MoeStateDictAdapter):
    architecture_vl, model_type_vl = "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"


def state_dict_adapter(args) -> Qwen3_5StateDictAdapter:
    """The adapter of the dense or the MoE model, with or without its vision encoder, as `args` say (the
    family's `ModelSpec.state_dict_adapter`)."""
    moe = isinstance(args, Qwen3_5MoeArgs)
    if args.vision:
        return (Qwen3_5MoeVLStateDictAdapter if moe else Qwen3_5VLStateDictAdapter)(args)
    return (Qwen3_5MoeStateDictAdapter if moe else Qwen3_5StateDictAdapter)(args)
