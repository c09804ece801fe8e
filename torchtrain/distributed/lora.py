"""LoRA: low-rank adapters beside chosen linear layers, every other weight frozen ([lora]).

A targeted `nn.Linear` becomes a `LoRALinear` (a subclass: its `weight` and `bias` keep their names,
so checkpoints, the Hugging Face names and the initial load of the base weights are unchanged) with
two more linear maps, `lora_a` (in -> r) and `lora_b` (r -> out):

    y = W x + b + (alpha / r) * B (A dropout(x))

A starts random (normal, std 1/sqrt(in), drawn like every other parameter: the same values under
every layout) and B at zero, so the first step starts from the base model. `apply_lora` runs on the
meta-device model before any parallelism; FSDP2 then shards frozen and trainable parameters of a
unit together (only the trainable ones get gradients, reduce-scatters and optimizer state:
`optimizer.py` builds its groups from parameters that require gradients). The layouts it takes are
decided in `check_lora_layout`: data parallelism only.

Export: `tools/lora_export.py` writes a merged Hugging Face checkpoint (W + (alpha/r) B A) or a PEFT
adapter folder.
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.config.lora import Lora
from torchtrain.models.base import InitSpec
from torchtrain.models.state_dict_adapter import StateDictAdapter

ADAPTER_PARAMS = (".lora_a.weight", ".lora_b.weight")


class LoRALinear(nn.Linear):
    """A linear layer with a rank-r adapter (module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, alpha: float, dropout: float,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.lora_a = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_b = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.scale = alpha / rank
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return base + self.lora_b(self.lora_a(h)) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_a.out_features}, scale={self.scale:g}"


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name if "." in pattern else name.rsplit(".", 1)[-1], pattern)


def is_target(name: str, cfg: Lora) -> bool:
    """Whether a linear layer of this full module name (`layers.3.attention.wq`) gets an adapter."""
    return any(_matches(name, pattern) for pattern in cfg.target_modules)


def lora_targets(model: nn.Module, cfg: Lora) -> list[str]:
    """Names of the linear layers the patterns select; ConfigError naming the key when a pattern
    selects none."""
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    chosen = []
    for i, pattern in enumerate(cfg.target_modules):
        hits = [n for n in linears if _matches(n, pattern)]
        if not hits:
            sample = ", ".join(linears[:6]) + (", ..." if len(linears) > 6 else "")
            raise ConfigError(f"[lora.target_modules] pattern {pattern!r} (entry {i}) matches no linear layer of the "
                              f"model; its linear layers are named like: {sample}")
        chosen += [n for n in hits if n not in chosen]
    return chosen


def apply_lora(model: nn.Module, cfg: Lora) -> list[str]:
    """Freeze every parameter and put adapters on the targeted linear layers (in place; on any device,
    meta included). Returns the adapted layers' names."""
    names = lora_targets(model, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old: nn.Linear = getattr(parent, child)
        new = LoRALinear(old.in_features, old.out_features, old.bias is not None, cfg.rank, cfg.alpha, cfg.dropout,
                         device=old.weight.device, dtype=old.weight.dtype)
        new.weight = old.weight
        if old.bias is not None:
            new.bias = old.bias
        setattr(parent, child, new)
    return names


def is_adapter_param(fqn: str) -> bool:
    return fqn.endswith(ADAPTER_PARAMS)


def adapter_init_spec(fqn: str, shape: tuple[int, ...]) -> InitSpec | None:
    """How an adapter parameter starts (A random, B zero); None for any other parameter."""
    if fqn.endswith(".lora_a.weight"):
        return InitSpec("normal", std=1.0 / math.sqrt(shape[1]))
    if fqn.endswith(".lora_b.weight"):
        return InitSpec("zeros")
    return None


def check_lora_layout(cfg: Lora, dims, float8: bool) -> None:
    """LoRA runs under data parallelism only: a one-line ConfigError for any other layout."""
    if not cfg.enable:
        return
    degrees = {"tensor_parallel_degree": dims.tp, "pipeline_parallel_degree": dims.pp,
               "context_parallel_degree": dims.cp, "expert_parallel_degree": dims.ep}
    for key, degree in degrees.items():
        if degree > 1:
            raise ConfigError(f"[lora.enable] LoRA runs under data parallelism only (FSDP/HSDP, DDP, ZeRO), but "
                              f"parallelism.{key} = {degree}: set it to 1 or train without LoRA")
    if float8:
        raise ConfigError("[lora.enable] LoRA does not combine with float8 training: drop \"float8\" from "
                          "model.converters or train without LoRA")


class LoRAStateDictAdapter(StateDictAdapter):
    """A model's Hugging Face adapter that leaves the adapter parameters out (they have no HF name):
    an initial load from an HF folder fills the base weights and keeps the adapters' initial values."""

    def __init__(self, base: StateDictAdapter):
        self.base = base
        self.model_args = base.model_args

    def hf_key(self, key: str) -> str:
        return self.base.hf_key(key)

    def hf_keys(self, key: str) -> list[str]:
        return [] if is_adapter_param(key) else self.base.hf_keys(key)

    def to_hf(self, key, tensor):
        return self.base.to_hf(key, tensor)

    def from_hf(self, key, tensor):
        return self.base.from_hf(key, tensor)

    def to_hf_tensors(self, key, tensor):
        return self.base.to_hf_tensors(key, tensor)

    def from_hf_tensors(self, key, tensors):
        return self.base.from_hf_tensors(key, tensors)

    def torchtitan_key(self, key, version):
        return self.base.torchtitan_key(key, version)

    def ignored_hf_keys(self):
        return self.base.ignored_hf_keys()

    def ignored_hf_prefixes(self):
        return self.base.ignored_hf_prefixes()

    def unused_hf_keys(self, available, used):
        return self.base.unused_hf_keys(available, used)

    def hf_config(self, dtype):
        return self.base.hf_config(dtype)

    def check_hf_config(self, config, source):
        return self.base.check_hf_config(config, source)


def lora_adapter_class(base_cls: type[StateDictAdapter]):
    """A factory with the model adapter class's signature (model_args -> adapter) for the LoRA model."""
    return lambda model_args: LoRAStateDictAdapter(base_cls(model_args))
