"""Llama 3: RMSNorm, RoPE with Llama 3 frequency scaling, grouped-query attention (SDPA), SwiGLU.

The decoder skeleton, its attention and block are the family's (`models/common/transformer.py`);
Llama 3 states its RoPE -- Meta's layout, consecutive pairs (x[2i], x[2i+1]) rotated, with the
Llama 3 long-context scaling (`models/common/rope.py`) -- and its feed-forward size.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.models.common import rope
from torchtrain.models.common.layers import FeedForward
from torchtrain.models.common.transformer import Decoder, DecoderBlock, GQAttention
from torchtrain.models.llama3.args import Llama3Args


def rope_frequencies(args: Llama3Args, device: torch.device | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies theta^(-2i/d), with Llama 3's long-context scaling when set."""
    freqs = rope.frequencies(args.head_dim, args.rope_theta, device)
    if args.rope_scaling_factor is None:
        return freqs
    return rope.llama3_scaled(freqs, args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor,
                              args.rope_original_max_seq_len)


def rope_table(args: Llama3Args, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim) float32 table: cos of each pair's angle, then sin."""
    return rope.rope_table(rope_frequencies(args, device), args.max_seq_len)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x (batch, seq, heads, head_dim) by their angles."""
    return rope.apply_rope(x, table, "pairs")


class Transformer(Decoder):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size); see `Decoder`."""

    args: Llama3Args

    def block(self, layer_id: int) -> nn.Module:
        a = self.args
        return DecoderBlock(a.dim, a.norm_eps,
                            GQAttention(a.dim, a.n_heads, a.kv_heads, a.head_dim, a.attention_mask, "pairs"),
                            FeedForward(a.dim, a.ffn_hidden_dim))

    def rope(self, device: torch.device | None = None) -> torch.Tensor:
        return rope_table(self.args, device)
