"""A transformers model's Gated DeltaNet layers as the engine's (`models/common/linear_attention.py`), so that
tensor and context parallelism and packed documents reach them.

transformers' Qwen3.5 linear-attention layer (`linear_attn`) holds its q/k/v projections as one weight
`in_proj_qkv` and their convolutions as one `conv1d` (channels [q | k | v]), computes the delta rule itself
and carries its state where neither a context-parallel shard nor a document start reaches. When the model is
built (`swap_layers`), every such layer becomes a `TransformersGatedDeltaNet`: the engine's layer, its q/k/v
projections and convolutions as three parameters each -- so that tensor parallelism splits each by heads
(`own_styles`) --, the rest under transformers' names, initialised by transformers' own code for the module
it replaced, and reading this forward's `AttentionContext` (documents; context parallelism replaces its
core). Always, whatever the layout: parameter names do not depend on it. The Hugging Face files keep
transformers' fused tensors (`state_dict_adapter.py` writes and reads the parts, `StateDictAdapter.hf_part`).

A layer with another layout (Qwen3-Next's interleaved `in_proj_qkvz`) is not swapped; the model's checks
then refuse the layouts its own code cannot take (`parallelize.py::recurrent_mixers`).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.attention import AttentionContext
from torchtrain.models.common.layers import RMSNorm
from torchtrain.models.common.linear_attention import DecayGate, GatedDeltaNet, ShortConv
from torchtrain.models.common.tp import LocalShards
from torchtrain.models.transformers.attention import CONTEXT_KEY
from torchtrain.models.transformers.swapped import Swapped
from torchtrain.models.transformers.tp_plan import GatherSequence

_NEEDS = ("in_proj_qkv", "conv1d", "in_proj_z", "in_proj_b", "in_proj_a", "A_log", "dt_bias", "norm", "out_proj")
DECAY_NAME = re.compile(r"^(.*\.)decay\.(A_log|dt_bias)$")


def is_swappable(module: nn.Module) -> bool:
    """Whether `module` is a Gated DeltaNet in transformers' Qwen3.5 layout (module doc)."""
    return type(module).__name__.endswith("GatedDeltaNet") and all(hasattr(module, n) for n in _NEEDS)


def _init_as(original: nn.Module, params: dict[str, torch.Tensor | None], model: nn.Module
             ) -> dict[str, torch.Tensor]:
    """Run the model's own initialisation of `original`'s kind on fresh tensors of `params`' names and shapes
    (a shadow object: no constructor runs); returns them."""
    shadow = object.__new__(type(original))
    shadow.__dict__.update(original.__dict__)
    shadow._parameters = {k: None if v is None else nn.Parameter(torch.empty_like(v, device="cpu"))
                          for k, v in params.items()}
    shadow._buffers, shadow._modules = {}, {}
    model._init_weights(shadow)
    return {k: p.data for k, p in shadow._parameters.items() if p is not None}


class _SwappedConv(ShortConv, Swapped):
    """The q, k or v part of transformers' `conv1d`, initialised as a whole `conv1d` would be (its rows)."""

    def tt_init_as(self, model: nn.Module) -> None:
        conv = self.__dict__["tt_original"].conv1d
        whole = _init_as(conv, {"weight": torch.empty(conv.weight.shape), "bias": None}, model)["weight"]
        start, end = self.__dict__["tt_rows"]
        self.weight.copy_(whole[start:end, 0])


class _SwappedDecay(DecayGate, Swapped):
    """`A_log` and `dt_bias`, initialised by the model's code for the layer they came from."""

    def tt_init_as(self, model: nn.Module) -> None:
        made = _init_as(self.__dict__["tt_original"], {"A_log": self.A_log, "dt_bias": self.dt_bias}, model)
        self.A_log.copy_(made["A_log"])
        self.dt_bias.copy_(made["dt_bias"])


class _SwappedNorm(RMSNorm, Swapped):
    """The gated output norm, initialised as transformers initialises its own."""

    def tt_init_as(self, model: nn.Module) -> None:
        self.weight.copy_(_init_as(self.__dict__["tt_original"].norm, {"weight": self.weight}, model)["weight"])


class TransformersGatedDeltaNet(GatedDeltaNet):
    """The engine's Gated DeltaNet in place of transformers' (module doc), called as transformers calls it."""

    def __init__(self, original: nn.Module, kernel: str = "chunked", chunk_size: int = 64):
        dim = original.in_proj_z.in_features
        heads_k, heads_v = original.num_k_heads, original.num_v_heads
        with torch.device(original.in_proj_z.weight.device):
            super().__init__(dim, heads_k, heads_v, original.head_k_dim, original.head_v_dim,
                             original.conv_kernel_size, original.layer_norm_epsilon, kernel, chunk_size)
            key, value = heads_k * original.head_k_dim, heads_v * original.head_v_dim
            rows = {"q": (0, key), "k": (key, 2 * key), "v": (2 * key, 2 * key + value)}
            for part, (start, end) in rows.items():
                conv = _SwappedConv(end - start, original.conv_kernel_size)
                conv.__dict__.update(tt_original=original, tt_rows=(start, end))
                setattr(self, f"conv_{part}", conv)
            self.decay = _SwappedDecay(heads_v)
            self.norm = _SwappedNorm(original.head_v_dim, original.layer_norm_epsilon)
        for module in (self.decay, self.norm):
            module.__dict__["tt_original"] = original

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        if cache is not None:
            raise ConfigError("[model.name] torchtrain's linear-attention layer of this transformers model computes "
                              "whole sequences: generation with transformers' cache is not supported")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ConfigError("[model.name] torchtrain's linear-attention layer takes no padding mask (packed "
                              "documents go through model.attention_mask = \"block_causal\")")
        ctx = kwargs.get(CONTEXT_KEY) or AttentionContext()
        return super().forward(hidden_states, None, ctx)


def swap_layers(model: nn.Module, kernel: str = "chunked") -> int:
    """Replace every swappable Gated DeltaNet of the decoder layers (module doc); returns how many."""
    count = 0
    for layer in model.decoder_layers:
        for name, child in list(layer.named_children()):
            if is_swappable(child):
                setattr(layer, name, TransformersGatedDeltaNet(child, kernel))
                count += 1
    return count


def own_styles(layer: nn.Module) -> dict[str, object]:
    """TP styles of the layer's swapped linear attention (names relative to the layer; with sequence
    parallelism): heads split with their convolution channels and decay parameters, the output projection
    row-parallel into sequence shards (`models/common/tp.py::gated_deltanet_plan`, under transformers' names;
    the input gathered over the sequence, `tp_plan.py::GatherSequence`)."""
    styles: dict[str, object] = {}
    for name, child in layer.named_children():
        if isinstance(child, TransformersGatedDeltaNet):
            styles[name] = GatherSequence()
            styles.update({f"{name}.in_proj_{p}": ColwiseParallel() for p in "qkvzba"})
            styles.update({f"{name}.conv_{p}": LocalShards(0) for p in "qkv"})
            styles[f"{name}.decay"] = LocalShards(0)
            styles[f"{name}.norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            styles[f"{name}.out_proj"] = RowwiseParallel(output_layouts=Shard(1))
    return styles
