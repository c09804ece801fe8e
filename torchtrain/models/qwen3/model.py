"""Qwen3: RMSNorm, grouped-query attention with per-head query/key RMSNorm, RoPE, SwiGLU.

The decoder skeleton, its attention and block are the family's (`models/common/transformer.py`). RoPE
uses Hugging Face's "rotate half" layout -- the pair of x[i] is x[i + head_dim/2] -- so the weights
load from and export to Hugging Face unchanged (no row permutation, unlike Llama 3).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.models.common.layers import FeedForward
from torchtrain.models.common.transformer import Decoder, qk_norm_block, qk_norm_rope
from torchtrain.models.qwen3.args import Qwen3Args


class Transformer(Decoder):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size); see `Decoder`."""

    args: Qwen3Args

    def block(self, layer_id: int) -> nn.Module:
        return qk_norm_block(self.args, FeedForward(self.args.dim, self.args.hidden_dim))

    def rope(self, device: torch.device | None = None) -> torch.Tensor:
        return qk_norm_rope(self.args, device)
