"""A transformers MoE block as torchtrain's MoE layer (`models/common/moe.py`), for expert parallelism.

Without expert parallelism a transformers MoE block trains as it is (FSDP shards it like any module).
With `expert_parallel_degree` > 1 (or tensor parallelism, which runs the experts with expert parallelism over
the TP ranks) each block -- a router (`gate` or `router`: weight (E, D), optionally a bias) and `experts`
holding `gate_up_proj` and `down_proj` (optionally with per-expert biases) -- is replaced by `TransformersMoE`,
the engine's MoE layer (routing, every token dispatcher, grouped GEMM, expert parallelism and its TP
styles) over the same parameters under the same names, initialised by transformers' code for the modules
it replaced: checkpoints, the Hugging Face export and the initial weights are the same with and without
the swap. Two expert layouts are known:

* "halves" (Mixtral, Qwen3-MoE, ...): `gate_up_proj` (E, 2H, D): the gate rows, then the up rows;
  `down_proj` (E, D, H);
* "interleaved" (gpt-oss): `gate_up_proj` (E, D, 2H): gate and up columns alternating; `down_proj`
  (E, H, D); biases `gate_up_proj_bias` (E, 2H) and `down_proj_bias` (E, D); the activation clamped by
  the experts' `limit` and `alpha` (`models/common/experts.py::clamped_swiglu`).

The layer routes as `models/common/moe.py` says (softmax or sigmoid scores, top-k, optionally
renormalised); which of those, and which expert layout, reproduces the model's own block is found by
running both on a small copy of the block (`check_swappable`). A block that none reproduces -- other
router semantics (jitter noise, a score bias, group-limited routing, shared experts, ...), other expert
layouts -- is a ConfigError naming the model type: it cannot be trained with expert parallelism. The
swapped layer adds no auxiliary loss (transformers' routers add none to the training loss unless asked
for), and returns what the block returned (a tuple whose first element is the hidden states, for
blocks that also return their router's scores: the scores are not used by the layers).
"""

from __future__ import annotations

import functools
import itertools
import json
from typing import Callable, NamedTuple

import torch
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.dispatch import LocalDispatcher
from torchtrain.models.common.experts import ExpertBiases, GroupedExperts, clamped_swiglu, expert_swiglu, swiglu
from torchtrain.models.common.layers import local_tensor
from torchtrain.models.common.moe import MoE, MoEModelArgs
from torchtrain.models.common.tp import moe_tp_plan
from torchtrain.models.transformers.args import TransformersArgs, small_config
from torchtrain.models.transformers.swapped import Swapped

TOLERANCE = 1e-5


ROUTERS = ("gate", "router")
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def layout_of(experts: nn.Module) -> tuple[str, int]:
    """(layout, hidden size H) of stacked transformers experts, told apart by their shapes (module doc):
    "halves" when gate_up_proj's dimension 1 is twice down_proj's last, else "interleaved"."""
    gate_up, down = experts.gate_up_proj.shape, experts.down_proj.shape
    return ("halves", down[2]) if gate_up[1] == 2 * down[2] else ("interleaved", down[1])


def router_name(block: nn.Module) -> str | None:
    """The name of a block's router module (`ROUTERS`), or None."""
    if isinstance(block, TransformersMoE):
        return block.router_name
    return next((n for n in ROUTERS if isinstance(getattr(block, n, None), nn.Module)), None)


def is_block(module: nn.Module) -> bool:
    """Whether `module` looks like a transformers MoE block: a router and `experts` with stacked weights."""
    experts = getattr(module, "experts", None)
    return (router_name(module) is not None and isinstance(experts, nn.Module)
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def blocks(layer: nn.Module) -> dict[str, nn.Module]:
    """The MoE blocks of a decoder layer by name relative to it (direct children only)."""
    return {name: child for name, child in layer.named_children() if is_block(child) or isinstance(child, TransformersMoE)}


class TransformersExperts(GroupedExperts, Swapped):
    """Grouped experts under transformers' names and in its `layout` (module doc), computed as the engine's
    SwiGLU experts (w1, w3, w2 views of `gate_up_proj` and `down_proj`; biases and the clamped activation
    where the replaced experts have them)."""

    def __init__(self, original: nn.Module, use_grouped_mm: bool = True):
        nn.Module.__init__(self)
        self.num_experts, self.use_grouped_mm, self.float8 = original.gate_up_proj.shape[0], use_grouped_mm, False
        self.layout = layout_of(original)[0]
        for name in EXPERT_PARAMS:
            tensor = getattr(original, name, None)
            self.register_parameter(name, nn.Parameter(torch.empty(tensor.shape)) if isinstance(tensor, torch.Tensor)
                                    else None)
        limit, alpha = getattr(original, "limit", None), getattr(original, "alpha", None)
        self.activation = (functools.partial(clamped_swiglu, alpha=alpha, limit=limit)
                           if limit is not None and alpha is not None else swiglu)
        self.dispatcher = LocalDispatcher(self.num_experts)
        self.__dict__["tt_original"] = original  # the module replaced (not a child): its init

    def _split(self, t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate part, up part) of a gate/up tensor along `dim`."""
        if self.layout == "interleaved":
            return t.unflatten(dim, (-1, 2)).unbind(dim + 1)
        return t.chunk(2, dim=dim)

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)
        if self.layout == "interleaved":  # (E, D, 2H) -> w1, w3 (E, H, D) contiguous (grouped GEMM's strides)
            w1, w3 = (w.transpose(1, 2).contiguous() for w in self._split(gate_up, 2))
            w2 = down.transpose(1, 2).contiguous()
        else:
            (w1, w3), w2 = self._split(gate_up, 1), down
        biases = None
        if self.gate_up_proj_bias is not None:
            b1, b3 = self._split(local_tensor(self.gate_up_proj_bias), 1)
            biases = ExpertBiases(b1, local_tensor(self.down_proj_bias), b3)
        return expert_swiglu(x, counts, w1, w2, w3, self.use_grouped_mm, biases, self.activation)

    def tt_init_as(self, model: nn.Module) -> None:
        _init_as(self, self.tt_original, model)


class _Gate(nn.Linear, Swapped):
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


class TransformersMoE(MoE, Swapped):
    """torchtrain's MoE layer in place of a transformers MoE block (module doc)."""

    def __init__(self, block: nn.Module, semantics: Semantics):
        gate_up = block.experts.gate_up_proj
        layout, hidden = layout_of(block.experts)
        experts, dim = gate_up.shape[0], gate_up.shape[2 if layout == "halves" else 1]
        name = router_name(block)
        original_router = getattr(block, name)
        top_k = getattr(block, "top_k", None) or getattr(original_router, "top_k")
        bias = isinstance(getattr(original_router, "bias", None), torch.Tensor)
        args = MoEModelArgs(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=hidden,
                            norm_topk_prob=semantics.norm_topk_prob, score_func=semantics.score_func,
                            moe_aux_loss_coeff=0.0)
        with torch.device(gate_up.device):  # the model's device (meta when swapped)
            super().__init__(dim, args)
            del self._modules["router"]
            self._modules[name] = _Gate(dim, experts, bias=bias)  # under its transformers name
            self.experts = TransformersExperts(block.experts)
        self.router_name, self.tuple_output = name, semantics.tuple_output
        self.router.__dict__["tt_original"] = original_router

    @property
    def router(self) -> nn.Module:  # the layer's routing reads `router`
        return self._modules[self.router_name]

    def forward(self, x: torch.Tensor):
        out = super().forward(x)
        return (out, None) if self.tuple_output else out

    def tt_init_as(self, model: nn.Module) -> None:
        self.init_buffers()


class Semantics(NamedTuple):
    """How `TransformersMoE` reproduces a block: its routing and its output's form."""

    score_func: str
    norm_topk_prob: bool
    tuple_output: bool


@functools.lru_cache(maxsize=8)
def _semantics(block_cls: type, config_cls: type, config_json: str, kind: str) -> Semantics:
    """How the MoE layer reproduces `block_cls` (ConfigError if it cannot)."""
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
    tuple_output = isinstance(expected, tuple) and len(expected) > 0 and isinstance(expected[0], torch.Tensor)
    expected = expected[0] if tuple_output else expected
    known = {f"{router_name(block)}.{p}" for p in ("weight", "bias")} | {f"experts.{p}" for p in EXPERT_PARAMS}
    extra = [n for n, _ in block.named_parameters() if n not in known]
    if not isinstance(expected, torch.Tensor) or extra:
        why = f"parameters {', '.join(extra)}" if extra else "an output besides the hidden states"
        raise ConfigError(f"[parallelism.expert_parallel_degree] model type {kind!r}: its MoE block "
                          f"{block_cls.__name__} has {why}, which torchtrain's MoE layer does not reproduce; "
                          f"set expert_parallel_degree = 1 (it trains as it is under FSDP)")
    for score_func, norm in itertools.product(("softmax", "sigmoid"), (True, False)):
        semantics = Semantics(score_func, norm, tuple_output)
        layer = TransformersMoE(block, semantics).eval()
        with torch.no_grad():
            for name, p in block.named_parameters():
                layer.get_parameter(name).copy_(p)
            layer.init_buffers()
            out = layer(x)
        out = out[0] if tuple_output else out
        if (out - expected).abs().max().item() <= TOLERANCE * max(1.0, expected.abs().max().item()):
            return semantics
    raise ConfigError(f"[parallelism.expert_parallel_degree] model type {kind!r}: its router's semantics differ "
                      f"from torchtrain's MoE layer (softmax or sigmoid scores, top-k, optionally renormalised; "
                      f"experts as gate/up halves or interleaved), so its MoE blocks cannot be swapped for expert "
                      f"parallelism; set expert_parallel_degree = 1")


def semantics_of(args: TransformersArgs) -> Callable[[nn.Module], Semantics]:
    """block -> how the MoE layer reproduces it, the small config built once for all blocks."""
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
                setattr(layer, name, TransformersMoE(block, semantics(block)))
                count += 1
    return count


def as_transformers_names(name: str, block: nn.Module, entries: dict[str, object]) -> dict[str, object]:
    """Entries keyed by the engine's MoE layer names under block `name`, keyed as the swapped layer has them:
    the router under its transformers name, no `sequence_sum` (the auxiliary loss's statistics: the layer
    has none)."""
    return {key.replace(f"{name}.router", f"{name}.{router_name(block)}"): value for key, value in entries.items()
            if key != f"{name}.sequence_sum"}


def own_styles(layer: nn.Module) -> dict[str, object]:
    """TP styles of the layer's MoE blocks run as the engine's layer (`models/common/tp.py::moe_tp_plan`,
    `as_transformers_names`), names relative to the layer."""
    styles: dict[str, object] = {}
    for name, block in blocks(layer).items():
        styles.update(as_transformers_names(name, block, moe_tp_plan(name, shared_experts=False)))
    return styles
