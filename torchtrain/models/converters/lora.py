"""LoRA: low-rank adapters beside chosen linear layers, every other weight frozen ([lora]).

A targeted `nn.Linear` becomes a `LoRALinear` (a subclass: its `weight` and `bias` keep their names,
so checkpoints, the Hugging Face names and the initial load of the base weights are unchanged) with
two more linear maps, `lora_a` (in -> r) and `lora_b` (r -> out):

    y = W x + b + (alpha / r) * B (A dropout(x))

A starts random (normal, std 1/sqrt(in), drawn like every other parameter: the same values under
every layout) and B at zero, so the first step starts from the base model. `apply_lora` runs on the
meta-device model before any parallelism; FSDP2 then shards frozen and trainable parameters of a
unit together (only the trainable ones get gradients, reduce-scatters and optimizer state:
`optimizer.py` builds its groups from parameters that require gradients).

Tensor parallelism: the model's TP plan sees each `LoRALinear` as the plain linear layer it wraps
(`tp_plan_with_adapters` takes the adapters off while the plan runs), then each adapter follows its
base weight's placement:

* column-parallel W (`Shard(0)`, output features split): A replicated, B `Shard(0)`: each rank
  computes the whole r-dim code `A x` from its replicated input and its own output features `B_i h`.
  The code's gradient is a partial sum over the ranks' output features: it is all-reduced in the
  backward (r values per token);
* row-parallel W (`Shard(1)`, input features split): A `Shard(1)`, B replicated: the code
  `sum_i A_i x_i` is all-reduced in the forward (r values per token), then B's output joins the
  base's partial sums (as a `Partial` share), reduced with them by the plan's output hook.

Pipeline, context and expert parallelism need nothing of their own: adapters live in the blocks a
stage holds, act per token, and target linear layers only (the grouped experts of an MoE layer are
not `nn.Linear`s: they stay frozen and unadapted; its router, shared experts and the attention can be
targeted). The layouts refused are in `check_lora_layout`.

Export: `tools/lora_export.py` writes a merged Hugging Face checkpoint (W + (alpha/r) B A) or a PEFT
adapter folder.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

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

    adapters_on = True
    """False while `adapters_off` holds: the layer is its base alone (a preference loss's reference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if not self.adapters_on:
            return base
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        code = self.lora_a(h)
        if isinstance(code, DTensor):  # tensor parallel (module docstring)
            code = _replicated_code(code)
        delta = self.lora_b(code) * self.scale
        if isinstance(base, DTensor) and base.placements != delta.placements:
            delta = _partial_share(delta)  # row-parallel: B's output joins the base's partial sums
        return base + delta

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_a.out_features}, scale={self.scale:g}"


@contextlib.contextmanager
def adapters_off(model_parts: list[nn.Module]):
    """Inside, every `LoRALinear` of the parts computes its base alone: the frozen base model, with no copy of
    it (the reference of a preference loss). A compiled block compiles this variant once more."""
    layers = [m for part in model_parts for m in part.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.adapters_on = False
    try:
        yield
    finally:
        for m in layers:
            m.adapters_on = True


def _replicated_code(code: DTensor) -> DTensor:
    """The r-dim code A x, whole on every TP rank with a whole gradient: a partial code (row-parallel A)
    all-reduced in the forward; a replicated one (column-parallel W) passed through `from_local`,
    whose backward all-reduces the partial gradient that the output-sharded B gives it."""
    if any(p.is_partial() for p in code.placements):
        return code.redistribute(placements=[Replicate()] * len(code.placements))
    return DTensor.from_local(code.to_local(), code.device_mesh, code.placements, run_check=False)


class _Share(torch.autograd.Function):
    """x / n forward, the gradient unchanged backward: each of n ranks' share of a replicated value
    summed as a partial sum, whose gradient is the whole gradient on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int) -> torch.Tensor:
        return x / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _partial_share(delta: DTensor) -> DTensor:
    """A replicated (TP-mesh) DTensor as a `Partial` one of the same value."""
    mesh = delta.device_mesh
    return DTensor.from_local(_Share.apply(delta.to_local(), mesh.size()), mesh, [Partial()], run_check=False)


def tp_plan_with_adapters(model: nn.Module, tp_mesh, plan) -> None:
    """Run the model's TP plan `plan(model)` over a model with adapters: the plan sees plain linear
    layers, then A and B are distributed after their base weight (module docstring). A targeted layer
    the plan leaves alone keeps plain adapters. Frozen parameters stay frozen (a style may build new
    parameters without carrying `requires_grad` over, e.g. `SequenceParallel`'s replicated norms)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    adapters = {name: (m._modules.pop("lora_a"), m._modules.pop("lora_b")) for name, m in layers.items()}
    try:
        plan(model)
    finally:
        for name, m in layers.items():
            m.lora_a, m.lora_b = adapters[name]
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    for m in layers.values():
        if not isinstance(m.weight, DTensor):
            continue
        (placement,) = m.weight.placements
        if placement == Shard(0):
            a, b = Replicate(), Shard(0)
        elif placement == Shard(1):
            a, b = Shard(1), Replicate()
        else:
            a = b = Replicate()
        for sub, where in ((m.lora_a, a), (m.lora_b, b)):
            sub.weight = nn.Parameter(distribute_tensor(sub.weight, m.weight.device_mesh, [where]),
                                      requires_grad=sub.weight.requires_grad)


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


def check_stages_have_adapters(targets: list[str], modules_per_stage: list[list[str]]) -> None:
    """Under pipeline parallelism every stage must hold an adapted layer (a stage without trainable
    parameters has nothing to optimise); ConfigError naming the key otherwise."""
    for s, modules in enumerate(modules_per_stage):
        if not any(t == m or t.startswith(m + ".") for t in targets for m in modules):
            raise ConfigError(f"[lora.target_modules] pipeline stage {s} ({', '.join(modules[:3])}"
                              f"{', ...' if len(modules) > 3 else ''}) holds no adapted layer, so it would train "
                              f"nothing: target layers of every stage (e.g. \"*.attention.wq\") or use fewer stages")


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


def lora_load_keys(model_state: dict, stored: set[str]) -> dict:
    """The entries of a LoRA model's state dict that a DCP load asks for, given the model keys the
    checkpoint holds: its adapters only when it holds adapters (a checkpoint without them, e.g. of a
    full fine-tuning or pre-training run loaded as the initial load, leaves them fresh), its base
    weights only when it holds base weights (an adapter-only save, `lora.save_adapter_only`). A model
    without adapters: everything."""
    if not any(is_adapter_param(k) for k in model_state):
        return model_state
    has_adapters = any(is_adapter_param(k) for k in stored)
    has_base = any(not is_adapter_param(k) for k in stored)
    return {k: v for k, v in model_state.items() if (has_adapters if is_adapter_param(k) else has_base)}


def adapter_init_spec(fqn: str, shape: tuple[int, ...]) -> InitSpec | None:
    """How an adapter parameter starts (A random, B zero); None for any other parameter."""
    if fqn.endswith(".lora_a.weight"):
        return InitSpec("normal", std=1.0 / math.sqrt(shape[1]))
    if fqn.endswith(".lora_b.weight"):
        return InitSpec("zeros")
    return None


def check_lora_layout(cfg: Lora, float8: bool) -> None:
    """Every parallelism takes LoRA (module docstring); float8 training does not: a one-line ConfigError."""
    if not cfg.enable:
        return
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

    def hf_part(self, key):
        return self.base.hf_part(key)

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

    def extra_files(self):
        return self.base.extra_files()

    def reading(self, available):
        base = self.base.reading(available)
        return self if base is self.base else LoRAStateDictAdapter(base)

    def check_hf_config(self, config, source):
        return self.base.check_hf_config(config, source)


def lora_adapter_class(base_cls: type[StateDictAdapter]):
    """A factory with the model adapter class's signature (model_args -> adapter) for the LoRA model."""
    return lambda model_args: LoRAStateDictAdapter(base_cls(model_args))
