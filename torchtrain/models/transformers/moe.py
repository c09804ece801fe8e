"""A transformers MoE block as torchtrain's MoE layer (`models/common/moe.py`), for expert parallelism.

Without expert parallelism a transformers MoE block trains as it is (FSDP shards it like any module).
With `expert_parallel_degree` > 1 each block -- a router `gate` (weight (E, D)) and `experts` holding
`gate_up_proj` (E, 2H, D: the gate rows, then the up rows) and `down_proj` (E, D, H) -- is replaced by
`TransformersMoE`, the engine's MoE layer (routing, every token dispatcher, grouped GEMM, expert
parallelism and its TP styles) over the same parameters under the same names (`gate.weight`,
`experts.gate_up_proj`, `experts.down_proj`), initialised by transformers' code for the modules it
replaced: checkpoints, the Hugging Face export and the initial weights are the same with and without
the swap.

The layer routes as `models/common/moe.py` says (softmax or sigmoid scores, top-k, optionally
renormalised); which of those reproduces the model's own router is found by running both on a small
copy of the block (`check_swappable`). A block that none reproduces -- other router semantics (jitter
noise, a score bias, group-limited routing, shared experts, ...), other expert layouts, biases -- is a
ConfigError naming the model type: it cannot be trained with expert parallelism. The swapped layer adds
no auxiliary loss (transformers' routers add none to the training loss unless asked for).
"""

from __future__ import annotations

import functools
import itertools
import json
from typing import Callable

import torch
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.dispatch import LocalDispatcher
from torchtrain.models.common.experts import GroupedExperts, expert_swiglu
from torchtrain.models.common.layers import local_tensor
from torchtrain.models.common.moe import MoE, MoEModelArgs
from torchtrain.models.common.tp import moe_tp_plan
from torchtrain.models.transformers.args import TransformersArgs, small_config

TOLERANCE = 1e-5


def is_block(module: nn.Module) -> bool:
    """Whether `module` looks like a transformers MoE block: a `gate` and `experts` with stacked weights."""
    experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
    return (isinstance(experts, nn.Module) and isinstance(gate, nn.Module)
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def blocks(layer: nn.Module) -> dict[str, nn.Module]:
    """The MoE blocks of a decoder layer by name relative to it (direct children only)."""
    return {name: child for name, child in layer.named_children() if is_block(child) or isinstance(child, TransformersMoE)}


class TransformersExperts(GroupedExperts):
    """Grouped experts under transformers' names: w1, w3 = the halves of `gate_up_proj`, w2 = `down_proj`."""

    def __init__(self, original: nn.Module, use_grouped_mm: bool = True):
        nn.Module.__init__(self)
        experts, two_hidden, dim = original.gate_up_proj.shape
        self.num_experts, self.use_grouped_mm, self.float8 = experts, use_grouped_mm, False
        self.gate_up_proj = nn.Parameter(torch.empty(experts, two_hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, two_hidden // 2))
        self.dispatcher = LocalDispatcher(experts)
        self.__dict__["tt_original"] = original  # the module replaced (not a child): its init

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3 = local_tensor(self.gate_up_proj).chunk(2, dim=1)
        return expert_swiglu(x, counts, w1, local_tensor(self.down_proj), w3, self.use_grouped_mm)

    def tt_init_as(self, model: nn.Module) -> None:
        _init_as(self, self.tt_original, model)


class _Gate(nn.Linear):
    """The router under transformers' name (`gate.weight`), initialised as the router it replaced."""

    def tt_init_as(self, model: nn.Module) -> None:
        _init_as(self, self.tt_original, model)


def _init_as(module: nn.Module, original: nn.Module, model: nn.Module) -> None:
    """Initialise `module`'s parameters (a whole-tensor copy, `distributed/param_init.py`) with the
    model's code for `original`, whose parameters have the same names and shapes."""
    shadow = object.__new__(type(original))
    shadow.__dict__.update(original.__dict__)
    shadow._parameters = module._parameters
    shadow._buffers = {}
    model._init_weights(shadow)


class TransformersMoE(MoE):
    """torchtrain's MoE layer in place of a transformers MoE block (module doc)."""

    def __init__(self, block: nn.Module, score_func: str, norm_topk_prob: bool):
        experts, _, dim = block.experts.gate_up_proj.shape
        top_k = getattr(block, "top_k", None) or getattr(block.gate, "top_k")
        args = MoEModelArgs(num_experts=experts, num_experts_per_tok=top_k,
                            moe_intermediate_size=block.experts.down_proj.shape[-1], norm_topk_prob=norm_topk_prob,
                            score_func=score_func, moe_aux_loss_coeff=0.0)
        with torch.device(block.experts.gate_up_proj.device):  # the model's device (meta when swapped)
            super().__init__(dim, args)
            del self._modules["router"]
            self.gate = _Gate(dim, experts, bias=False)
            self.experts = TransformersExperts(block.experts)
        self.gate.__dict__["tt_original"] = block.gate

    @property
    def router(self) -> nn.Module:  # the layer's routing reads `router`
        return self.gate

    def tt_init_as(self, model: nn.Module) -> None:
        self.init_buffers()


@functools.lru_cache(maxsize=8)
def _semantics(block_cls: type, config_cls: type, config_json: str, kind: str) -> tuple[str, bool]:
    """(score_func, norm_topk_prob) with which the MoE layer reproduces `block_cls` (ConfigError if none)."""
    config = config_cls.from_dict(json.loads(config_json))
    config._experts_implementation = "eager"  # the experts' own loop (a block built outside its model)
    if getattr(config, "router_jitter_noise", 0):
        raise ConfigError(f"[parallelism.expert_parallel_degree] model type {kind!r}: its router adds jitter noise "
                          f"in training (router_jitter_noise), which torchtrain's MoE layer does not")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            block = block_cls(config).float().eval()
        except Exception as e:  # noqa: BLE001 - any model code
            raise ConfigError(f"[parallelism.expert_parallel_degree] model type {kind!r}: its MoE block "
                              f"{block_cls.__name__} cannot be checked against torchtrain's MoE layer ({e})") from None
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 1.0)
        x = torch.randn(2, 8, config.hidden_size)
        with torch.no_grad():
            expected = block(x)
    extra = [n for n, _ in block.named_parameters() if n not in ("gate.weight", "experts.gate_up_proj",
                                                                  "experts.down_proj")]
    if not isinstance(expected, torch.Tensor) or extra:
        why = f"parameters {', '.join(extra)}" if extra else "an output besides the hidden states"
        raise ConfigError(f"[parallelism.expert_parallel_degree] model type {kind!r}: its MoE block "
                          f"{block_cls.__name__} has {why}, which torchtrain's MoE layer does not reproduce; "
                          f"set expert_parallel_degree = 1 (it trains as it is under FSDP)")
    for score_func, norm in itertools.product(("softmax", "sigmoid"), (True, False)):
        layer = TransformersMoE(block, score_func, norm).eval()
        with torch.no_grad():
            layer.gate.weight.copy_(block.gate.weight)
            layer.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
            layer.experts.down_proj.copy_(block.experts.down_proj)
            layer.init_buffers()
            if (layer(x) - expected).abs().max().item() <= TOLERANCE * max(1.0, expected.abs().max().item()):
                return score_func, norm
    raise ConfigError(f"[parallelism.expert_parallel_degree] model type {kind!r}: its router's semantics differ "
                      f"from torchtrain's MoE layer (softmax or sigmoid scores, top-k, optionally renormalised), so "
                      f"its MoE blocks cannot be swapped for expert parallelism; set expert_parallel_degree = 1")


def semantics_of(args: TransformersArgs) -> Callable[[nn.Module], tuple[str, bool]]:
    """block -> its router's (score function, renormalised), the small config built once for all blocks."""
    config = small_config(args)
    key = config.to_json_string(use_diff=False)
    return lambda block: _semantics(type(block), type(config), key, args.model_type)


def check_swappable(args: TransformersArgs, model: nn.Module) -> tuple[str, ...]:
    """Names (relative to a layer) of the MoE blocks expert parallelism swaps; ConfigError when a block
    cannot be swapped (module doc)."""
    names: set[str] = set()
    semantics = semantics_of(args)
    for layer in model.decoder_layers:
        for name, block in blocks(layer).items():
            semantics(block)
            names.add(name)
    if not names:
        raise ConfigError(f"[parallelism.expert_parallel_degree] model type {args.model_type!r}: no MoE block with "
                          f"stacked expert weights (gate_up_proj, down_proj) was found; set expert_parallel_degree = 1")
    return tuple(sorted(names))


def swap_blocks(model: nn.Module) -> int:
    """Replace every MoE block of the model by a `TransformersMoE` (on the model's device: meta); returns
    how many."""
    count = 0
    semantics = semantics_of(model.args)
    for layer in model.decoder_layers:
        for name, block in blocks(layer).items():
            if not isinstance(block, TransformersMoE):
                setattr(layer, name, TransformersMoE(block, *semantics(block)))
                count += 1
    return count


def as_transformers_names(name: str, entries: dict[str, object]) -> dict[str, object]:
    """Entries keyed by the engine's MoE layer names under block `name`, keyed as the swapped layer has them:
    the router under its transformers name `gate`, no `sequence_sum` (the auxiliary loss's statistics: the
    layer has none)."""
    return {key.replace(f"{name}.router", f"{name}.gate"): value for key, value in entries.items()
            if key != f"{name}.sequence_sum"}


def own_styles(layer: nn.Module) -> dict[str, object]:
    """TP styles of the layer's MoE blocks run as the engine's layer (`models/common/tp.py::moe_tp_plan`,
    `as_transformers_names`), names relative to the layer."""
    styles: dict[str, object] = {}
    for name in blocks(layer):
        styles.update(as_transformers_names(name, moe_tp_plan(name, shared_experts=False)))
    return styles
