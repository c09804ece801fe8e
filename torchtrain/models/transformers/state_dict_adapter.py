"""A transformers model's Hugging Face names are its own: every parameter is stored under its name,
as is -- but the parts of a linear-attention layer the engine keeps apart (`linear_attention.py`: q/k/v
projections and convolutions, written back into transformers' fused `in_proj_qkv` and `conv1d`). The export writes the folder's config (with the layers built and the stored dtype) and copies
its tokenizer, generation and processor files, so `AutoModelForCausalLM.from_pretrained` loads the result (the
`save_pretrained` layout; a composite vision-language folder keeps its names -- `model.visual.*`,
`model.language_model.*`, `lm_head.weight` -- and its config, which `AutoModelForImageTextToText` loads). A folder stored in another layout (transformers' conversion mapping, e.g.
one tensor per expert) is read through transformers' own conversion (`checkpoint_layout.py`)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.linear_attention import from_fused, fused_part, to_fused
from torchtrain.models.state_dict_adapter import StateDictAdapter
from torchtrain.models.transformers.args import TransformersArgs, hf_class
from torchtrain.models.transformers.linear_attention import DECAY_NAME

# Files of a model folder that belong with its weights (tokenizer, chat template, generation defaults).
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")
# Settings of config.json that decide the tensors' names and shapes.
STRUCTURAL = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "tie_word_embeddings", "moe_intermediate_size", "num_local_experts",
              "num_experts")
VISION_STRUCTURAL = ("depth", "patch_size", "temporal_patch_size", "spatial_merge_size", "out_hidden_size",
                     "num_heads", "num_position_embeddings")


class TransformersStateDictAdapter(StateDictAdapter):
    model_args: TransformersArgs

    def hf_key(self, key: str) -> str:
        part = fused_part(key)
        if part:  # a swapped linear-attention layer's q/k/v part (`linear_attention.py`): transformers' fused tensor
            return f"{part[0]}{'in_proj_qkv' if part[1] == 'in_proj' else 'conv1d'}.weight"
        decay = DECAY_NAME.match(key)
        return f"{decay.group(1)}{decay.group(2)}" if decay else key

    def hf_keys(self, key: str) -> list[str]:
        if key == "lm_head.weight" and self.model_args.tie_word_embeddings:
            return []  # transformers stores the tied table once, as the embedding
        return [self.hf_key(key)]

    def hf_part(self, key: str) -> int | None:
        part = fused_part(key)
        return part[2] if part else None

    def to_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        return to_fused(key, tensor) if fused_part(key) else tensor

    def from_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if fused_part(key) is None:
            return tensor
        c = self.model_args.text_config()
        return from_fused(key, tensor, c.linear_num_key_heads * c.linear_key_head_dim,
                          c.linear_num_value_heads * c.linear_value_head_dim)

    def ignored_hf_keys(self) -> set[str]:
        return {"lm_head.weight"} if self.model_args.tie_word_embeddings else set()

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        config = self.model_args.config
        config.architectures = [hf_class(config).__name__]
        config.dtype = dtype
        return json.loads(config.to_json_string(use_diff=False))

    def reading(self, available: set[str]) -> StateDictAdapter:
        names = [name for name, _ in self.model_args.parameter_shapes()]
        if all(key in available for name in names for key in self.hf_keys(name)):
            return self
        from torchtrain.models.transformers.checkpoint_layout import ConversionPlan
        from torchtrain.models.transformers.parallelize import meta_model

        return ConvertedLayout(self.model_args, ConversionPlan(meta_model(self.model_args), available))

    def extra_files(self) -> list[str]:
        folder = self.model_args.hf_path
        return [os.path.join(folder, n) for n in COMPANION_FILES if os.path.isfile(os.path.join(folder, n))]

    def unused_hf_keys(self, available: set[str], used: set[str]) -> set[str]:
        # a model built with fewer layers than the folder's (model.n_layers) leaves the others' tensors, and
        # transformers itself ignores some (Qwen3.5's multi-token-prediction `mtp.*`)
        ignored = getattr(hf_class(self.model_args.config), "_keys_to_ignore_on_load_unexpected", None) or []
        extra = {k for k in available if k.startswith(self._layer_prefixes_beyond())
                 or any(re.search(pattern, k) for pattern in ignored)}
        return super().unused_hf_keys(available, used) - extra

    def _layer_prefixes_beyond(self) -> tuple[str, ...]:
        total = self.model_args.text_config().num_hidden_layers
        prefix = self.model_args.layers_prefix
        return tuple(f"{prefix}{i}." for i in range(self.model_args.n_layers, total))

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        ours = self.model_args.config.to_dict()
        pairs = [(config, ours)]
        if "text_config" in ours:  # a composite config: its text model's and its vision tower's settings too
            pairs += [(config.get(k) or {}, ours[k]) for k in ("text_config", "vision_config") if k in ours]
        for theirs, own in pairs:
            for key in STRUCTURAL + VISION_STRUCTURAL:
                if key in theirs and key in own and theirs[key] != own[key]:
                    raise ConfigError(f"[checkpoint.initial_load_path] {source}: config.json has {key} = "
                                      f"{theirs[key]!r} but the model (model.hf_path {self.model_args.hf_path}) has "
                                      f"{own[key]!r}")
        config = config.get("text_config") or config
        if config.get("num_hidden_layers", self.model_args.n_layers) < self.model_args.n_layers:
            raise ConfigError(f"[checkpoint.initial_load_path] {source}: config.json has "
                              f"{config['num_hidden_layers']} layers, fewer than the {self.model_args.n_layers} "
                              f"built (model.n_layers)")
        return []


class ConvertedLayout(TransformersStateDictAdapter):
    """Reads a checkpoint stored in transformers' conversion layout (`checkpoint_layout.ConversionPlan`)."""

    def __init__(self, model_args: TransformersArgs, plan):
        super().__init__(model_args)
        self.plan = plan

    def hf_keys(self, key: str) -> list[str]:
        own = super().hf_keys(key)
        if own != [key]:  # tied (none), or a part the engine keeps apart (stored under transformers' own name)
            return own
        return self.plan.keys(key) or [key]  # (a missing parameter is reported under its own name)

    def from_hf_tensors(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.hf_key(key) != key:
            return super().from_hf_tensors(key, tensors)
        return self.plan.build(key, tensors)
