"""A model's output head: the top-level module that turns hidden states into vocabulary logits.

The engine's decoders name it `output` (models/common/transformer.py), models of the transformers
backend `lm_head`. Stated once here and read where the head is treated apart from the other matrices:
the optimizer (Muon leaves the head to AdamW) and float8 training (the head stays in high precision
unless `quantize.linear.float8.convert_output_head` asks otherwise).
"""

from __future__ import annotations

from torch import nn

OUTPUT_HEAD_NAMES = ("output", "lm_head")


def output_heads(model: nn.Module) -> dict[str, nn.Module]:
    """The model's output head by its name (empty on a pipeline stage without it, or a model without one)."""
    children = dict(model.named_children())
    return {name: children[name] for name in OUTPUT_HEAD_NAMES if name in children}
