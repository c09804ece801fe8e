"""The contract between a model and the Hugging Face checkpoint format (used by
`components/checkpoint/hf.py` and the conversion scripts).

An adapter maps one torchtrain parameter to its HF tensors, key by key, so conversions stream: a
tensor is read, converted and written without the rest of the model in memory, and a sharded
parameter on a rank converts to the same HF tensors whatever the layout. Usually one parameter is one
HF tensor (`hf_key`, `to_hf`, `from_hf`); a parameter HF stores in pieces -- stacked MoE experts,
one HF tensor per expert -- lists several names (`hf_keys`) and is cut along dim 0 on export and
stacked on import; a buffer HF has no counterpart for lists none (it keeps its initial value on
import). It also writes and checks HF's config.json. A model registers its adapter as
`ModelSpec.state_dict_adapter`.
"""

from __future__ import annotations

import abc
import re
from typing import Any, Iterable

import torch

from torchtrain.models.base import BaseModelArgs

# torchtitan 0.3 moved the attention's q/k/v projections under `qkv_linear` and renamed the output head.
_TT03_QKV = re.compile(r"^(layers\.\d+\.attention\.)(w[qkv]\.weight)$")


def torchtitan_key(key: str, version: str) -> str:
    """torchtitan's name of the dense-transformer parameter `key` in its DCP checkpoints. Version "0.2":
    torchtrain's names (its module paths mirror torchtitan v0.2); "0.3": `attention.qkv_linear.wq`,
    `lm_head.weight`. Tensor layouts are the same (both keep Meta's interleaved RoPE rows)."""
    if version == "0.2":
        return key
    if key == "output.weight":
        return "lm_head.weight"
    return _TT03_QKV.sub(r"\1qkv_linear.\2", key)


# torchtrain's MoE layer (models/common/moe.py) sits at `feed_forward`; torchtitan's at `moe`.
_MOE = re.compile(r"^(layers\.\d+\.)feed_forward\.(router\.weight|experts\.w[123]|expert_bias|shared_experts\..+)$")
_TT_MOE = {"0.2": {"router.weight": "router.gate.weight"},
           "0.3": {"router.weight": "router.gate.weight", "experts.w1": "routed_experts.inner_experts.w1_EFD",
                   "experts.w3": "routed_experts.inner_experts.w3_EFD",
                   "experts.w2": "routed_experts.inner_experts.w2_EDF", "expert_bias": "expert_bias_E"}}


def moe_torchtitan_key(key: str, version: str) -> str:
    """`torchtitan_key` for models built on torchtrain's MoE layer: the layer's parameters under
    torchtitan's `moe` module (0.2: `moe.router.gate`, `moe.experts.w1`, `moe.expert_bias`,
    `moe.shared_experts.w1.weight`; 0.3: `moe.routed_experts.inner_experts.w1_EFD`, `moe.expert_bias_E`).
    Stacked expert weights have the same (E, hidden, dim) / (E, dim, hidden) shapes in both."""
    match = _MOE.match(key)
    if match is None:
        return torchtitan_key(key, version)
    layer, name = match.groups()
    return f"{layer}moe.{_TT_MOE[version].get(name, name)}"


class StateDictAdapter(abc.ABC):
    def __init__(self, model_args: BaseModelArgs):
        self.model_args = model_args

    @abc.abstractmethod
    def hf_key(self, key: str) -> str:
        """HF name of the torchtrain parameter `key` (a canonical name, e.g. `layers.0.attention.wq.weight`)."""

    def hf_keys(self, key: str) -> list[str]:
        """HF names of `key`: one; several when HF stores dim 0 of the tensor as separate tensors (in
        order); none when HF has no counterpart."""
        return [self.hf_key(key)]

    def to_hf_tensors(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF tensors of `key` by HF name (`hf_keys`; pieces are dim-0 slices)."""
        names = self.hf_keys(key)
        tensor = self.to_hf(key, tensor)
        if len(names) == 1:
            return {names[0]: tensor}
        return dict(zip(names, tensor.unbind(0)))

    def from_hf_tensors(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """`key`'s tensor from its HF tensors (in `hf_keys` order)."""
        return self.from_hf(key, tensors[0] if len(tensors) == 1 else torch.stack(tensors))

    def hf_part(self, key: str) -> int | None:
        """When HF stores several parameters as one tensor -- their HF-layout tensors concatenated on dim 0,
        in part order: a fused projection torchtrain keeps as separate parameters so that tensor parallelism
        can split each by heads -- this parameter's index among them; None otherwise. Its `from_hf` then
        receives the whole HF tensor and takes its own rows."""
        return None

    def to_hf_state(self, items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """HF tensors of the parameters `items` ((key, tensor) pairs; those HF does not store are left out) by
        HF name, the parts of one HF tensor (`hf_part`) concatenated in part order."""
        out: dict[str, torch.Tensor] = {}
        parts: dict[str, dict[int, torch.Tensor]] = {}
        for key, tensor in items:
            if not self.hf_keys(key):
                continue
            part = self.hf_part(key)
            for name, t in self.to_hf_tensors(key, tensor).items():
                if part is None:
                    out[name] = t
                else:
                    parts.setdefault(name, {})[part] = t
        for name, pieces in parts.items():
            if sorted(pieces) != list(range(len(pieces))):
                raise ValueError(f"{name}: parts {sorted(pieces)} of a fused tensor are missing some")
            out[name] = torch.cat([pieces[i] for i in range(len(pieces))])
        return out

    def to_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The torchtrain tensor of `key` in HF's layout (e.g. a row permutation)."""
        return tensor

    def from_hf(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_hf`: HF's tensor for `key` in torchtrain's layout."""
        return tensor

    def torchtitan_key(self, key: str, version: str) -> str:
        """torchtitan's DCP name of parameter `key` (`version` "0.2" or "0.3"; used to load and write
        torchtitan checkpoints, `components/checkpoint/torchtitan.py`). MoE models add their layers'."""
        return torchtitan_key(key, version)

    def ignored_hf_keys(self) -> set[str]:
        """HF keys that may be present in a checkpoint but have no torchtrain parameter."""
        return set()

    def ignored_hf_prefixes(self) -> tuple[str, ...]:
        """Prefixes of HF keys that may be present but are not loaded (a module torchtrain does not
        build, e.g. DeepSeek-V3's multi-token-prediction block)."""
        return ()

    def unused_hf_keys(self, available: set[str], used: set[str]) -> set[str]:
        """The checkpoint's keys that nothing loaded and that are not expected to be left over."""
        prefixes = self.ignored_hf_prefixes()
        return {k for k in available - used - self.ignored_hf_keys() if not (prefixes and k.startswith(prefixes))}

    @abc.abstractmethod
    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json for this model, with weights stored in `dtype`."""

    def reading(self, available: set[str]) -> "StateDictAdapter":
        """The adapter that reads an HF checkpoint holding the keys `available`: this one, unless the model's
        HF files come in more than one layout and these are in another."""
        return self

    def extra_files(self) -> list[str]:
        """Files an export copies beside the weights and config.json (e.g. the model's tokenizer)."""
        return []

    def context_length(self, config: dict[str, Any]) -> int:
        """The context window an HF config.json declares (its max_position_embeddings; 0: none)."""
        value = config.get("max_position_embeddings")
        return value if isinstance(value, int) and value > 0 else 0

    def check_hf_config(self, config: dict[str, Any], source: str) -> list[str]:
        """Raise ConfigError when `config` (an HF config.json) describes an incompatible model; return
        warnings about settings that load but behave differently."""
        return []
