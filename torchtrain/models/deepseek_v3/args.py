"""DeepSeek-V3 model arguments and their parameter / FLOP formulas.

A DeepSeek-V3 block is multi-head latent attention (MLA) followed by a feed-forward: a dense SwiGLU in
the first `first_k_dense_replace` blocks, a mixture of experts (`models/common/moe.py`: sigmoid scores,
the auxiliary-loss-free bias, group-limited routing, shared experts) in the others.

MLA, per token x (width h), with n heads:

    query:  c_q = RMSNorm(W_qa x)  (q_lora_rank)          q = W_qb c_q   (or q = W_q x when q_lora_rank = 0)
    latent: [c_kv, k_r] = W_kva x  (kv_lora_rank + qk_rope_head_dim)
    keys/values: [k_nope, v] = W_kvb RMSNorm(c_kv)          (n x (qk_nope_head_dim + v_head_dim))
    head i: q_i = [q_nope_i, RoPE(q_rope_i)], k_i = [k_nope_i, RoPE(k_r)]  (the RoPE key is shared by all heads)

so a head's query/key width is qk_nope_head_dim + qk_rope_head_dim and its value width v_head_dim.
RoPE rotates interleaved pairs (x[2i], x[2i+1]) as DeepSeek's checkpoints expect, with YaRN frequency
scaling when `rope_factor` > 1 (and the softmax-scale correction mscale(factor, rope_mscale_all_dim)^2).

FLOPs per token (the Llama 3 convention, `models/llama3/args.py`): 6 x the active matmul parameters
(attention projections, the dense or routed top-k + shared experts' SwiGLUs, router, output) plus the
attention scores and weighted sum, 6 x n_layers x n_heads x (qk_head_dim + v_head_dim) x seq_len.
Multi-token prediction (`mtp_depth` D, `models/common/mtp.py`) adds D blocks, their projections and D
more passes through the output head.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.config.fields import ConfigError
from torchtrain.models.base import BaseModelArgs
from torchtrain.models.common.decoder import DecoderArgs
from torchtrain.models.common.moe import MoEModelArgs
from torchtrain.models.common.rope import yarn_mscale


@dataclass
class DeepseekV3Args(DecoderArgs, MoEModelArgs, BaseModelArgs):
    dim: int = 7168
    """Hidden size (HF hidden_size)."""

    n_layers: int = 61
    """Number of transformer blocks."""

    n_heads: int = 128
    """Attention heads."""

    vocab_size: int = 129280
    """Embedding rows; must be at least the tokenizer's vocabulary."""

    hidden_dim: int = 18432
    """SwiGLU hidden size of the dense blocks' feed-forward (HF intermediate_size)."""

    first_k_dense_replace: int = 3
    """The first this many blocks have a dense feed-forward; the rest a mixture of experts."""

    q_lora_rank: int = 1536
    """Rank of the query's low-rank compression (W_qa, W_qb); 0: one full-rank query projection (16B)."""

    kv_lora_rank: int = 512
    """Width of the joint key/value latent c_kv (what inference caches)."""

    qk_nope_head_dim: int = 128
    """Per-head query/key width without position encoding."""

    qk_rope_head_dim: int = 64
    """Per-head query width with RoPE (and the width of the RoPE key shared by all heads)."""

    v_head_dim: int = 128
    """Per-head value width."""

    norm_eps: float = 1e-6
    """RMSNorm epsilon (blocks, final norm and the latent norms)."""

    rope_theta: float = 10000.0
    """RoPE base frequency."""

    rope_factor: float = 40.0
    """YaRN context-extension factor; 1: plain RoPE."""

    rope_original_max_seq_len: int = 4096
    """YaRN: the context length the base frequencies were trained at."""

    rope_beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept as is (extrapolated)."""

    rope_beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is divided by rope_factor (interpolated)."""

    rope_mscale: float = 1.0
    """YaRN mscale of the RoPE table: cos/sin are scaled by mscale(factor, rope_mscale) /
    mscale(factor, rope_mscale_all_dim) (1 for the published models)."""

    rope_mscale_all_dim: float = 1.0
    """YaRN mscale of the softmax: scores are scaled by mscale(factor, rope_mscale_all_dim)^2 / sqrt(qk_head_dim)
    (0: no correction)."""

    mtp_depth: int = 0
    """Multi-token-prediction modules (DeepSeek-V3: 1), each predicting one token further from the
    previous depth's hidden states and the next token's embedding; 0: off. Training only."""

    mtp_loss_weight: float = 0.3
    """Weight lambda of the MTP term: lambda / mtp_depth x the MTP cross-entropies, normalised like the
    main loss (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1)."""

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """A head's query/key width (what generic code, e.g. the planner's activation formulas, reads)."""
        return self.qk_head_dim

    @property
    def kv_heads(self) -> int:
        """MLA expands its latent to keys and values for every head."""
        return self.n_heads

    tie_word_embeddings = False  # DeepSeek-V3 has a separate output head

    def rope_attention_factor(self) -> float:
        """Scale of the RoPE table's cos/sin (HF's YaRN attention_factor)."""
        if self.rope_factor <= 1:
            return 1.0
        if self.rope_mscale and self.rope_mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.rope_mscale) / yarn_mscale(self.rope_factor,
                                                                                 self.rope_mscale_all_dim)
        return yarn_mscale(self.rope_factor, 1.0)

    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_factor > 1 and self.rope_mscale_all_dim:
            scale *= yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    def as_block_fqn(self, fqn: str) -> str:
        """An MTP depth's block parameter named as the block it continues (`mtp.depths.k.block.X` ->
        `layers.{n_layers + k}.X`: its init and its HF names); other names unchanged."""
        k, _, rest = fqn.removeprefix("mtp.depths.").partition(".")
        if fqn.startswith("mtp.depths.") and rest.startswith("block."):
            return f"layers.{self.n_layers + int(k)}.{rest.removeprefix('block.')}"
        return fqn

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        self.check_sizes(("dim", "n_layers", "n_heads", "vocab_size", "hidden_dim", "kv_lora_rank", "qk_nope_head_dim",
                          "qk_rope_head_dim", "v_head_dim"))
        if self.q_lora_rank < 0:
            raise ConfigError(f"[model.q_lora_rank] must be >= 0 (0: full-rank query), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"[model.qk_rope_head_dim] {self.qk_rope_head_dim} must be even for RoPE")
        if not 0 <= self.first_k_dense_replace <= self.n_layers:
            raise ConfigError(f"[model.first_k_dense_replace] {self.first_k_dense_replace} must be between 0 and "
                              f"model.n_layers ({self.n_layers})")
        if self.rope_factor <= 0 or self.rope_original_max_seq_len < 1:
            raise ConfigError("[model.rope_factor] must be > 0 (1: no YaRN) and model.rope_original_max_seq_len >= 1")
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            raise ConfigError(f"[model.mtp_depth] {self.mtp_depth} and model.mtp_loss_weight {self.mtp_loss_weight} "
                              f"must be >= 0 (mtp_depth 0: no multi-token prediction)")
        self.validate_moe()

    # ------------------------------------------------------------------ counts
    def attention_params(self) -> int:
        h, n = self.dim, self.n_heads
        if self.q_lora_rank:
            query = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim
        else:
            query = h * n * self.qk_head_dim
        latent = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        expand = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        return query + latent + expand + n * self.v_head_dim * h

    def ffn_params(self, layer_id: int, active: bool = False) -> int:
        if not self.is_moe_layer(layer_id):
            return 3 * self.dim * self.hidden_dim
        total, used = self.moe_params(self.dim)
        return used if active else total

    def _count(self, active: bool, exclude_embedding: bool) -> int:
        layers = range(self.n_layers + self.mtp_depth)  # an MTP depth: a block (as the last) + 2 h^2 + 3 norms
        blocks = sum(self.attention_params() + self.ffn_params(i, active) + 2 * self.dim for i in layers)
        blocks += self.mtp_depth * (2 * self.dim * self.dim + 3 * self.dim)
        table = self.vocab_size * self.dim
        total = blocks + self.dim + 2 * table
        return total - table if exclude_embedding else total

    def num_params(self, exclude_embedding: bool = False) -> int:
        return self._count(False, exclude_embedding)

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters one token's forward uses: its top-k routed experts, not all of them."""
        return self._count(True, exclude_embedding)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token; multi-token prediction adds its blocks and one output head per depth."""
        attention = 6 * (self.n_layers + self.mtp_depth) * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        heads = 6 * self.mtp_depth * self.vocab_size * self.dim
        return 6 * self.num_active_params(exclude_embedding=True) + attention + heads
