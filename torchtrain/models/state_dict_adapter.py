"""The contract between a model and the Hugging Face checkpoint format (used by
`components/checkpoint/hf.py` and the conversion scripts).

An adapter maps one torchtrain parameter to one HF tensor, key by key, so conversions stream: a
tensor is read, converted and written without the rest of the model in memory, and a sharded
parameter on a rank converts to the same HF tensor whatever the layout. It also writes and checks
HF's config.json. A model registers its adapter as `ModelSpec.state_dict_adapter`.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from torchtrain.models.base import BaseModelArgs


class StateDictAdapter(abc.ABC):
    def __init__(self, model_args: BaseModelArgs):
        self.model_args = model_args

    @abc.abstractmethod
    def hf_key(self, key: str) -> str:
        """HF name of the torchtrain parameter `key` (a canonical name, e.g. `layers.0.attention.wq.weight`)."""

    def to_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The torchtrain tensor of `key` in HF's layout (e.g. a row permutation)."""
        return tensor

    def from_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_hf`: HF's tensor for `key` in torchtrain's layout."""
        return tensor

    def ignored_hf_keys(self) -> set[str]:
        """HF keys that may be present in a checkpoint but have no torchtrain parameter."""
        return set()

    @abc.abstractmethod
    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json for this model, with weights stored in `dtype`."""

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        """Raise ConfigError when `config` (an HF config.json) describes an incompatible model; return
        warnings about settings that load but behave differently."""
        return []
