"""Llama 3: RMSNorm, RoPE with Llama 3 frequency scaling, grouped-query attention (SDPA), SwiGLU.

Plain PyTorch, no parallel code: tensor/pipeline/context/data parallelism are applied from outside
(`parallelize.py`, `distributed/`) and work because

* attention reshapes with ``-1`` heads, so a tensor-parallel shard holding n_heads / tp heads runs
  the same code;
* the blocks live in an ``nn.ModuleDict`` keyed by their global index, so a pipeline stage that keeps
  blocks 8..15 still names them ``layers.8`` ... (checkpoints and init stay layout-independent);
* ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` on a pipeline stage that does not own
  them; forward then takes/returns hidden states instead of tokens/logits;
* the attention itself is `models/common/attention.py::AttentionCore` (causal or block-causal masks),
  which context parallelism replaces by its sequence-sharded version, and RoPE reads explicit token
  positions (document positions, or the tokens' indices in the full sequence) when they are given.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.models.base import InitSpec
from torchtrain.models.common.attention import AttentionContext, AttentionCore, attention_inputs
from torchtrain.models.common.decoder import decoder_init_spec
from torchtrain.models.common.layers import FeedForward, RMSNorm
from torchtrain.models.llama3.args import Llama3Args


def rope_frequencies(args: Llama3Args) -> torch.Tensor:
    """Per-pair inverse frequencies theta^(-2i/d), with Llama 3's long-context scaling.

    Llama 3 scaling divides the frequency of long wavelengths (> original_max / low_freq_factor) by
    `factor`, keeps short ones (< original_max / high_freq_factor), and interpolates smoothly between.
    """
    d = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if args.rope_scaling_factor is None:
        return freqs
    factor, lo, hi = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_len = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - lo) / (hi - lo)
    interpolated = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > old_len / lo, freqs / factor, interpolated)
    return torch.where(wavelen < old_len / hi, freqs, out)


def rope_table(args: Llama3Args, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim) float32 table: cos of each pair's angle, then sin."""
    freqs = rope_frequencies(args).to(device)
    pos = torch.arange(args.max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(pos, freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x (batch, seq, heads, head_dim) by their angles;
    `rope` holds (cos, sin) rows: the table (rows 0..seq-1 are used) or per-token rows
    (`common/attention.py::attention_inputs`)."""
    half = x.shape[-1] // 2
    if rope.dim() == 2:
        rope = rope[: x.shape[1]].unsqueeze(0)
    cos = rope[..., :half].unsqueeze(2)
    sin = rope[..., half:].unsqueeze(2)
    pairs = x.float().unflatten(-1, (half, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = AttentionCore(args.attention_mask)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bsz, heads, seq, head_dim)
        out = self.core(q, k, v, ctx)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, ctx)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size).

    `positions` (batch, seq): each token's position in its document (the data's, 0 at document
    starts); used by `block_causal` attention (mask and RoPE), ignored by `causal`. `seq_index`
    (batch, seq): each token's index in its full sequence (default 0..seq-1; under context
    parallelism the indices of the chunks this rank holds). Both are per-token, batch-first tensors,
    so a pipeline schedule cuts them into micro-batches like the tokens."""

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = (
            None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        )
        self.register_buffer("rope_cache", rope_table(args), persistent=False)

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
    def init_spec(self, fqn: str) -> InitSpec:
        """Initialisation of the parameter named `fqn` (canonical name, no wrapper prefixes)."""
        return decoder_init_spec(fqn, self.args)

    def init_buffers(self) -> None:
        """Recompute the RoPE table on the buffer's current device (after materialisation)."""
        self.rope_cache = rope_table(self.args, device=self.rope_cache.device)
