"""What the decoder-only families (Llama 3, Qwen3, DeepSeek-V3) share outside their layers: adapting
the arguments to the job, and the initialisation scheme. Each family states only what differs.

Initialisation (by canonical parameter name, so identical under any layout): norms 1; the token
embedding N(0, 1) (N(0, 1/dim) when tied to the output); the output head truncated N(0, 1/dim); the
projections back into the residual stream (`attention.wo`, `feed_forward.w2`) truncated N(0, std_out)
with std_out = 0.02 / sqrt(2 (layer_id + 1)) (`depth_init`; otherwise the last block's value); every
other matrix truncated N(0, 0.02^2).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

from torchtrain.config.fields import ConfigError
from torchtrain.models.base import InitSpec

if TYPE_CHECKING:
    from torchtrain.data.tokenizer import Tokenizer

LAYER_ID = re.compile(r"^layers\.(\d+)\.")
OUTPUT_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight")


class DecoderFlops:
    """FLOPs per token of a decoder, the convention of Llama 3 (and torchtitan) for every family that does not
    state its own:

        flops/token = 6 x active matmul parameters + `mixer_flops(seq_len)`

    the matmul parameters being what one token's forward uses (`num_active_params`), the embedding table left
    out unless it is tied (then it is the output projection's matmul), and the token mixer's own work
    (attention: 12 x n_layers x n_heads x head_dim x seq_len, its scores and weighted sum forward and
    backward; a family with other mixers -- sliding windows, linear attention -- overrides it)."""

    def flops_per_token(self, seq_len: int) -> int:
        n_matmul = self.num_active_params(exclude_embedding=not self.tie_word_embeddings)
        return 6 * n_matmul + self.mixer_flops(seq_len)

    def mixer_flops(self, seq_len: int) -> int:
        return 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


class DecoderArgsMixin(DecoderFlops):
    """`update_from_job` for arguments with `max_seq_len` (0: the job's seq_len) and `vocab_size`, the checks
    the families' `validate` share, and the decoder FLOPs convention (`DecoderFlops`)."""

    max_seq_len: int
    vocab_size: int
    context_length: int

    def context_window(self) -> int:
        """The context the model is declared for (`context_length`, else the RoPE table's `max_seq_len`)."""
        return self.context_length or self.max_seq_len

    def adopt_context_length(self, length: int) -> None:
        if self.context_length == 0 and length > 0:
            self.context_length = length

    def check_sizes(self, positive: tuple[str, ...]) -> None:
        """ConfigError unless every key of `positive` is >= 1 and `max_seq_len` >= 0."""
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"[model.{key}] must be >= 1, got {getattr(self, key)}")
        if self.max_seq_len < 0 or self.context_length < 0:
            raise ConfigError(f"[model.max_seq_len] and model.context_length must be >= 0, got {self.max_seq_len} "
                              f"and {self.context_length}")

    def check_kv_heads(self) -> None:
        """ConfigError unless the key/value heads divide the query heads (grouped-query attention)."""
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ConfigError(
                f"[model.n_kv_heads] {self.kv_heads} must divide model.n_heads {self.n_heads} "
                f"(grouped-query attention shares each KV head among n_heads / n_kv_heads query heads)"
            )

    def update_from_job(self, seq_len: int, tokenizer: "Tokenizer") -> None:
        if self.max_seq_len == 0:
            self.max_seq_len = seq_len
        elif self.max_seq_len < seq_len:
            raise ConfigError(f"[model.max_seq_len] {self.max_seq_len} is shorter than training.seq_len {seq_len}; "
                              f"raise it or leave it 0 (= seq_len)")
        if tokenizer.vocab_size > self.vocab_size:
            raise ConfigError(f"[model.vocab_size] {self.vocab_size} is smaller than the tokenizer's vocabulary "
                              f"({tokenizer.vocab_size}); set --model.vocab_size {tokenizer.vocab_size} or larger")


@dataclass
class DecoderArgs(DecoderArgsMixin):
    """The `[model]` keys every decoder family (Llama 3, Qwen3, Qwen3.5, DeepSeek-V3) shares, declared once: its
    context window, the depth scaling of its initialisation and its attention mask. (`--help` lists them after a
    family's own keys: `SHARED_KEYS`.)"""

    max_seq_len: int = 0
    """Rows of the RoPE table. 0: training.seq_len (set automatically)."""

    context_length: int = 0
    """The context window the model is declared for, exported as config.json's max_position_embeddings. 0: set
    from the imported Hugging Face config.json (checkpoint.initial_load_path) when there is one, else max_seq_len."""

    depth_init: bool = True
    """Scale the init std of each block's output projections by 1/sqrt(2 * (layer_id + 1))."""

    attention_mask: Literal["causal", "block_causal"] = "causal"
    """`causal`: every token attends to all earlier tokens of its window. `block_causal`: only to
    earlier tokens of its own document (documents packed in a window are kept apart, from the data's
    per-token positions), and RoPE positions restart at each document (docs/long_context.md)."""


SHARED_KEYS = tuple(f.name for f in fields(DecoderArgs))
"""`DecoderArgs`' keys, listed after a family's own ones."""


def output_std(fqn: str, n_layers: int, depth_init: bool) -> float:
    """Init std of a block's projection back into the residual stream (see the module doc)."""
    match = LAYER_ID.match(fqn)
    layer_id = int(match.group(1)) if match and depth_init else n_layers - 1
    return 0.02 / math.sqrt(2 * (layer_id + 1))


def decoder_init_spec(fqn: str, args) -> InitSpec:
    """The family-wide initialisation of parameter `fqn` (see the module doc); `args` has `dim`,
    `n_layers`, `depth_init` and `tie_word_embeddings`."""
    tied = args.tie_word_embeddings
    if fqn.endswith("norm.weight"):
        return InitSpec("ones")
    if fqn == "tok_embeddings.weight":
        return InitSpec("normal", std=args.dim**-0.5 if tied else 1.0)
    if fqn == "output.weight":
        return InitSpec("trunc_normal", std=args.dim**-0.5)
    if fqn.endswith(OUTPUT_PROJECTIONS) and LAYER_ID.match(fqn):
        return InitSpec("trunc_normal", std=output_std(fqn, args.n_layers, args.depth_init))
    return InitSpec("trunc_normal", std=0.02)
