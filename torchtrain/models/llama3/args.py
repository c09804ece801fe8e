"""Llama 3 model arguments, their published presets, and the parameter / FLOP formulas.

FLOPs per token (forward + backward, no recomputation counted) follow the usual convention:

    flops/token = 6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len

where N_matmul is every parameter that takes part in a matmul (all but the input embedding table,
which is a lookup; with tied embeddings the shared table is counted once, as the output matmul), the
factor 6 is 2 (multiply-add) x 3 (forward, input grad, weight grad), and the second term is the
attention scores and weighted sum (2 matmuls of seq_len x head_dim per head and token, x 2 x 3 again).
The causal mask is not discounted: the convention of the PaLM paper and torchtitan, so MFU figures are
comparable with theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.config.fields import ConfigError
from torchtrain.models.base import BaseModelArgs
from torchtrain.models.common.decoder import DecoderArgs


@dataclass
class Llama3Args(DecoderArgs, BaseModelArgs):
    dim: int = 4096
    """Hidden size."""

    n_layers: int = 32
    """Number of transformer blocks."""

    n_heads: int = 32
    """Attention (query) heads; head_dim = dim / n_heads."""

    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (unset: n_heads, i.e. multi-head attention)."""

    vocab_size: int = 128256
    """Embedding rows; must be at least the tokenizer's vocabulary."""

    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this."""

    ffn_dim_multiplier: float | None = None
    """Scales the SwiGLU hidden size (2/3 x 4 x dim) before rounding."""

    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    rope_theta: float = 500000.0
    """RoPE base frequency."""

    rope_scaling_factor: float | None = 8.0
    """Llama 3 RoPE frequency scaling factor (unset: no scaling)."""

    rope_low_freq_factor: float = 1.0
    """Llama 3 RoPE scaling: wavelengths above original_max / low_freq_factor are divided by the factor."""

    rope_high_freq_factor: float = 4.0
    """Llama 3 RoPE scaling: wavelengths below original_max / high_freq_factor are kept."""

    rope_original_max_seq_len: int = 8192
    """Llama 3 RoPE scaling: the context length the base model was trained with."""

    tie_word_embeddings: bool = False
    """Use the input embedding table as the output projection (Llama 3.2 1B/3B)."""

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        self.check_sizes(("dim", "n_layers", "n_heads", "vocab_size", "multiple_of"))
        if self.dim % self.n_heads:
            raise ConfigError(
                f"[model.dim] {self.dim} is not divisible by model.n_heads {self.n_heads}; "
                f"head_dim must be an integer"
            )
        if self.head_dim % 2:
            raise ConfigError(f"[model.n_heads] head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")
        self.check_kv_heads()
        if self.rope_scaling_factor is not None and self.rope_scaling_factor <= 0:
            raise ConfigError(f"[model.rope_scaling_factor] must be > 0 or unset, got {self.rope_scaling_factor}")

    # ------------------------------------------------------------------ counts
    def num_params(self, exclude_embedding: bool = False) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.kv_heads * hd * 2
        ffn = 3 * d * self.ffn_hidden_dim
        per_layer = attn + ffn + 2 * d
        table = self.vocab_size * d
        total = self.n_layers * per_layer + d + table
        if not self.tie_word_embeddings:
            total += table  # separate output projection
        if exclude_embedding:
            total -= table
        return total
