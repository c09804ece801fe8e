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
from typing import ClassVar, Literal

from torchtrain.config.fields import ConfigError
from torchtrain.models.base import BaseModelArgs
from torchtrain.models.common.decoder import DecoderArgsMixin


@dataclass
class GQADecoderArgs(DecoderArgsMixin, BaseModelArgs):
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

    max_seq_len: int = 0
    """Rows of the RoPE table. 0: training.seq_len (set automatically)."""

    context_length: int = 0
    """The context window the model is declared for, exported as config.json's max_position_embeddings. 0: set
    from the imported Hugging Face config.json (checkpoint.initial_load_path) when there is one, else max_seq_len."""

    tie_word_embeddings: bool = False
    """Use the input embedding table as the output projection (the 0.6B, 1.7B and 4B models)."""

    depth_init: bool = True
    """Scale the init std of each block's output projections by 1/sqrt(2 * (layer_id + 1))."""

    attention_mask: Literal["causal", "block_causal"] = "causal"
    """`causal`: every token attends to all earlier tokens of its window. `block_causal`: only to
    earlier tokens of its own document (from the data's per-token positions), with RoPE positions
    restarting at each document (docs/long_context.md)."""

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
