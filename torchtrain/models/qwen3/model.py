"""Qwen3: RMSNorm, grouped-query attention with per-head query/key RMSNorm, RoPE, SwiGLU.

Plain PyTorch, no parallel code (as `models/llama3/model.py`: heads reshaped with -1 so a
tensor-parallel shard runs the same code; blocks in an nn.ModuleDict keyed by global index; the
embedding, final norm and output may be None on a pipeline stage).

RoPE uses Hugging Face's "rotate half" layout -- the pair of x[i] is x[i + head_dim/2] -- so the
weights load from and export to Hugging Face unchanged (no row permutation, unlike Llama 3).

`Transformer.feed_forward(layer_id)` builds a block's feed-forward; the MoE variant
(`models/qwen3_moe`) overrides it and nothing else. Attention is the shared
`models/common/attention.py::AttentionCore` (causal or block-causal; context parallelism shards it),
and RoPE reads explicit token positions when they are given, as in Llama 3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.models.base import InitSpec
from torchtrain.models.common.attention import AttentionContext, AttentionCore, attention_inputs
from torchtrain.models.common.decoder import decoder_init_spec, output_std
from torchtrain.models.common.layers import FeedForward, RMSNorm
from torchtrain.models.qwen3.args import Qwen3Args


def rope_table(head_dim: int, theta: float, max_seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim) float32: cos of angle_i (i < head_dim/2), then sin."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=device), freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (x[i], x[i + d/2]) of x (batch, seq, heads, head_dim) by angle i (HF's rotate_half);
    `rope`: the table (rows 0..seq-1 are used) or per-token rows (batch or 1, seq, head_dim)."""
    half = x.shape[-1] // 2
    if rope.dim() == 2:
        rope = rope[: x.shape[1]].unsqueeze(0)
    cos = rope[..., :half].unsqueeze(2)
    sin = rope[..., half:].unsqueeze(2)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.core = AttentionCore(args.attention_mask)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bsz, heads, seq, head_dim)
        out = self.core(q, k, v, ctx)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: Qwen3Args, feed_forward: nn.Module):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, ctx)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size); `positions` and `seq_index` as in
    `models/llama3/model.py::Transformer`."""

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, self.feed_forward(i))
                                     for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = (
            None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        )
        self.register_buffer("rope_cache", self._rope(), persistent=False)

    def feed_forward(self, layer_id: int) -> nn.Module:
        """The feed-forward of block `layer_id` (dense SwiGLU)."""
        return FeedForward(self.args.dim, self.args.hidden_dim)

    def _rope(self, device: torch.device | None = None) -> torch.Tensor:
        return rope_table(self.args.head_dim, self.args.rope_theta, self.args.max_seq_len, device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                seq_index: torch.Tensor | None = None) -> torch.Tensor:
        rope, ctx = attention_inputs(self, self.args.attention_mask, self.rope_cache, tokens, positions, seq_index)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, rope, ctx)
        if self.norm is None:
            return h  # a pipeline stage that ends before the head passes hidden states on
        h = self.norm(h)
        if self.args.tie_word_embeddings:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    # ----------------------------------------------------------------------- init
    def output_std(self, fqn: str) -> float:
        """Init std of a block's projections back into the residual stream."""
        return output_std(fqn, self.args.n_layers, self.args.depth_init)

    def init_spec(self, fqn: str) -> InitSpec:
        """Initialisation of the parameter named `fqn` (canonical name, no wrapper prefixes)."""
        return decoder_init_spec(fqn, self.args)

    def init_buffers(self) -> None:
        """Recompute the RoPE table on the buffer's current device (after materialisation)."""
        self.rope_cache = self._rope(self.rope_cache.device)
