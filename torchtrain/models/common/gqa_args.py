"""Arguments of the grouped-query-attention decoder with an explicit head width (Qwen3's shape, shared
by the dense Qwen3 and Qwen3-MoE families), and their parameter / FLOP formulas.

A Llama-style decoder (RMSNorm, SwiGLU, grouped-query attention, RoPE) with an explicit `head_dim`
(n_heads x head_dim need not equal dim) and an RMSNorm over head_dim on every query and key head before
RoPE. Defaults are Qwen3-8B's (RoPE base 1e6). FLOPs per token follow the decoder convention
(`models/common/decoder.py::DecoderFlops`): 6 x matmul parameters + 12 x n_layers x n_heads x head_dim x seq_len.
`ffn_params` is the hook a mixture-of-experts variant overrides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torchtrain.config.fields import ConfigError
from torchtrain.models.base import BaseModelArgs
from torchtrain.models.common.decoder import DecoderArgs


@dataclass
class GQADecoderArgs(DecoderArgs, BaseModelArgs):
    qk_norm: ClassVar[bool] = True  # per-head query/key RMSNorm (for the planner's activation formula)

    dim: int = 4096
    """Hidden size (HF hidden_size)."""

    n_layers: int = 36
    """Number of transformer blocks."""

    n_heads: int = 32
    """Attention (query) heads."""

    n_kv_heads: int | None = 8
    """Key/value heads for grouped-query attention (unset: n_heads)."""

    head_dim: int = 128
    """Width of one attention head (independent of dim / n_heads in Qwen3)."""

    vocab_size: int = 151936
    """Embedding rows; must be at least the tokenizer's vocabulary."""

    hidden_dim: int = 12288
    """SwiGLU hidden size of the dense feed-forward (HF intermediate_size)."""

    norm_eps: float = 1e-6
    """RMSNorm epsilon (also of the per-head query/key norms)."""

    rope_theta: float = 1000000.0
    """RoPE base frequency."""

    tie_word_embeddings: bool = False
    """Use the input embedding table as the output projection (the 0.6B, 1.7B and 4B models)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def validate(self) -> None:
        self.check_sizes(("dim", "n_layers", "n_heads", "head_dim", "vocab_size", "hidden_dim"))
        if self.head_dim % 2:
            raise ConfigError(f"[model.head_dim] {self.head_dim} must be even for RoPE")
        self.check_kv_heads()

    # ------------------------------------------------------------------ counts
    def attention_params(self) -> int:
        d, hd = self.dim, self.head_dim
        return 2 * d * self.n_heads * hd + 2 * d * self.kv_heads * hd + 2 * hd

    def ffn_params(self, active: bool = False) -> int:
        """Parameters of one block's feed-forward (all of them, or those one token uses)."""
        return 3 * self.dim * self.hidden_dim

    def _count(self, active: bool, exclude_embedding: bool) -> int:
        per_layer = self.attention_params() + self.ffn_params(active) + 2 * self.dim
        table = self.vocab_size * self.dim
        total = self.n_layers * per_layer + self.dim + table
        if not self.tie_word_embeddings:
            total += table
        return total - table if exclude_embedding else total

    def num_params(self, exclude_embedding: bool = False) -> int:
        return self._count(False, exclude_embedding)

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters one token's forward uses (all of them for a dense model)."""
        return self._count(True, exclude_embedding)
