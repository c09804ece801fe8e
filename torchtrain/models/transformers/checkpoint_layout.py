"""Reading a transformers checkpoint whose tensors are stored in another layout than the model's modules.

transformers keeps some models' files in their original layout and converts while loading (its
"conversion mapping": e.g. Mixtral's experts stored one tensor per expert under `block_sparse_moe`,
stacked into `mlp.experts.gate_up_proj` / `down_proj` when loaded; `save_pretrained` writes that
original layout back). torchtrain reads such a folder with transformers' own mapping for the model
(`get_model_conversion_mapping`, the list transformers itself applies): each stored key is renamed as
transformers renames it, the keys converted into one parameter are collected in transformers' order,
and transformers' own operations (stacking, concatenation, ...) build the parameter -- one parameter at a
time, so memory stays at one parameter's tensors. torchtrain writes its exports in the modules'
layout, which transformers loads as it is.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from torchtrain.config.fields import ConfigError


class ConversionPlan:
    """For each parameter of `model` (a transformers model on the meta device), the stored keys it is made
    of and the conversion that makes it (module doc), for a checkpoint holding `available` keys."""

    def __init__(self, model: nn.Module, available: set[str]):
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (
                WeightConverter,
                WeightRenaming,
                dot_natural_key,
                rename_source_key,
            )
        except ImportError as e:
            raise ConfigError(f"[checkpoint.initial_load_path] the installed transformers has no checkpoint conversion "
                              f"mapping ({e}); its stored layout cannot be read") from None
        self.model = model
        ours = type(model)  # transformers looks its mappings up by class name first: its own class's
        model.__class__ = ours.__bases__[-1] if ours.__name__.startswith("Torchtrain") else ours
        try:
            transforms = get_model_conversion_mapping(model)
        finally:
            model.__class__ = ours
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        params = dict(model.state_dict())
        self.sources: dict[str, list[tuple[str, str]]] = {}
        self.converters: dict[str, Any] = {}
        for key in sorted(available, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, params)
            if renamed not in params and key in params:
                renamed, pattern = key, None
            if renamed not in params:
                continue
            self.sources.setdefault(renamed, []).append((pattern or key, key))
            if pattern is not None:
                self.converters[renamed] = by_pattern[pattern]

    def keys(self, name: str) -> list[str]:
        """The stored keys parameter `name` is made of (none: the checkpoint lacks it)."""
        return [key for _, key in self.sources.get(name, [])]

    def build(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Parameter `name` from its stored tensors (in `keys` order)."""
        converter = self.converters.get(name)
        if converter is None:
            return tensors[0]
        mapping = copy.deepcopy(converter)
        for (pattern, key), tensor in zip(self.sources[name], tensors, strict=True):
            mapping.add_tensor(name, key, pattern, tensor)
        built = mapping.convert(name, model=self.model, config=self.model.config)
        value = built.get(name)
        if value is None:
            raise ConfigError(f"[checkpoint.initial_load_path] transformers' conversion of the stored tensors of "
                              f"{name} made {', '.join(built)} instead")
        return value[0] if isinstance(value, list) else value
