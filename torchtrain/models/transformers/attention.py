"""The attention of a transformers model, run by torchtrain through transformers' attention-function
registry.

transformers models call `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`
with the queries, keys and values of one layer (batch, heads, seq, head_dim) and the options the layer
asks for (score `scaling`, `sliding_window`, soft-capping `softcap`, `dropout`). torchtrain registers
`torchtrain_attention` under the name "torchtrain" and builds the model with it: each attention module
gets an `AttentionCore` (`models/common/attention.py`) as its child `tt_attention`, and the function
runs that core with the forward's `AttentionContext` (passed down as a keyword argument the model
hands on to its attention). So causal and block-causal masks, sliding windows, soft-capping, attention
sinks (`s_aux`: gpt-oss) and context parallelism (which replaces every `AttentionCore` by its sequence-sharded version) are the
engine's own, for any model whose attention goes through the registry
(`PreTrainedModel._supports_attention_backend`).

transformers builds no mask for a registered function it does not know (its mask interface has no
entry for "torchtrain"); the function refuses what it does not implement -- an explicit attention
mask, non-causal attention, position biases, or any other option with a value -- with
a ConfigError naming the model type, rather than computing something else.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.attention import AttentionContext, AttentionCore, MaskType
from torchtrain.models.common.layers import local_tensor

IMPLEMENTATION = "torchtrain"
CONTEXT_KEY = "torchtrain_attention_context"
CORE = "tt_attention"
# Keyword arguments transformers hands to every attention function that do not change its result here
# (no cache, no padding: torchtrain trains full windows).
_IGNORED = {"position_ids", "use_cache", "cache", "past_key_values", "output_attentions", "layer_idx",
            "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cache_position", "return_dict"}


def torchtrain_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, sliding_window: int | None = None,
                         softcap: float | None = None, s_aux: torch.Tensor | None = None,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (output (batch, seq, heads, head_dim), no weights)."""
    ctx = kwargs.pop(CONTEXT_KEY, None)
    kind = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    unsupported = sorted(k for k, v in kwargs.items() if k not in _IGNORED and v is not None and v is not False)
    if attention_mask is not None:
        unsupported.insert(0, "attention_mask")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        unsupported.insert(0, "non-causal attention")
    if unsupported:
        raise ConfigError(f"[model.hf_path] model type {kind!r}: its attention asks for {', '.join(unsupported)}, "
                          f"which torchtrain's attention does not implement")
    core = getattr(module, CORE, None)
    if core is None:
        if ctx is not None and ctx.extra.get("cp"):
            raise ConfigError(f"[parallelism.context_parallel_degree] model type {kind!r}: attention module "
                              f"{type(module).__name__} was not recognised as one, so context parallelism cannot "
                              f"shard it; set context_parallel_degree = 1")
        core = AttentionCore("causal")
    windows = (sliding_window,) if sliding_window is not None else ()
    if ctx is None:  # called outside torchtrain's forward (e.g. by transformers' generate): this call's masks
        ctx = AttentionContext()
        core.prepare(ctx, query.shape[0], query.shape[2], query.device, windows)
    elif sliding_window is not None and sliding_window not in ctx.windowed:
        raise ConfigError(f"[model.hf_path] model type {kind!r}: a layer asks for a sliding window of {sliding_window} "
                          f"tokens that its config does not declare (sliding_window, use_sliding_window, layer_types)")
    sinks = local_tensor(s_aux) if s_aux is not None else None  # attention sinks (gpt-oss): this rank's heads'
    out = core(query, key, value, ctx, scale=scaling, window=sliding_window, softcap=softcap, dropout=dropout,
               sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register `torchtrain_attention` with transformers (once; idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, torchtrain_attention)


@functools.cache
def uses_registry(model_cls: type) -> bool:
    """Whether the model class's attention goes through the attention-function registry: it says so
    (`_supports_attention_backend`), or every attention module class of its modeling file looks its function
    up there (Qwen3.5 does, without the flag: read off the code, `ALL_ATTENTION_FUNCTIONS.get_interface`)."""
    if getattr(model_cls, "_supports_attention_backend", False):
        return True
    module = sys.modules.get(model_cls.__module__)
    kinds = [obj for name, obj in vars(module or {}).items()
             if name.endswith("Attention") and isinstance(obj, type) and issubclass(obj, nn.Module)]
    try:
        return bool(kinds) and all("ALL_ATTENTION_FUNCTIONS.get_interface" in inspect.getsource(k.forward)
                                   for k in kinds)
    except (OSError, TypeError):  # no source to read: trust the flag
        return False


def attention_modules(layer: nn.Module) -> list[nn.Module]:
    """The attention modules of a decoder layer: the modules whose class name ends in "Attention" (the
    transformers naming: MistralAttention, Gemma3Attention, ...), outermost only."""
    found: list[nn.Module] = []
    for module in layer.modules():
        if type(module).__name__.endswith("Attention") and not any(module in f.modules() for f in found):
            found.append(module)
    return found


def attach_cores(layers: nn.Module, mask: MaskType) -> int:
    """Give every attention module of every layer its `AttentionCore` (child `tt_attention`); returns
    how many."""
    count = 0
    for layer in layers.children():
        for module in attention_modules(layer):
            setattr(module, CORE, AttentionCore(mask, sinks=isinstance(getattr(module, "sinks", None), torch.Tensor)))
            count += 1
    return count


def sliding_windows(config) -> tuple[int, ...]:
    """The sliding window the model's layers ask for, if any (its mask is prepared once per forward): the
    config's `sliding_window`, unless `use_sliding_window` is off or no layer is a sliding one (`layer_types`)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return ()
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and not any("sliding" in str(kind) for kind in kinds):
        return ()
    return (window,)
