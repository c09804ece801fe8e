"""Qwen3.5 model arguments: a hybrid decoder whose layers are Gated DeltaNet linear attention
(`models/common/linear_attention.py`) except every `full_attention_interval`-th, which is gated
grouped-query attention (an output gate per head, query/key norms, RoPE on the first quarter of each
head), all norms centred on zero; a dense SwiGLU (`Qwen3_5Args`) or a mixture of experts with a gated
shared expert (`Qwen3_5MoeArgs`) in every block.

Parameters per block: full attention D H hd x 2 (queries and gates) + 2 D Hkv hd + H hd D + 2 hd;
linear attention D (2 Hk dk + 2 Hv dv + 2 Hv) (q, k, v, z, beta, decay inputs) + (2 Hk dk + Hv dv) K
(convolutions) + 2 Hv + dv + Hv dv D; the feed-forward; two norms. FLOPs per token follow the Llama 3
convention, with each layer's token mixer:

    flops/token = 6 x active matmul parameters + 12 x H x hd x seq_len x full layers
                  + 18 x Hv x dk x dv x linear layers

(the delta rule counted as its recurrence: three (dk x dv) products per value head and token forward --
reading the state with the key and the query, writing it -- and twice that backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtrain.config.fields import ConfigError
from torchtrain.models.common import delta_rule
from torchtrain.models.common.gqa_args import GQADecoderArgs
from torchtrain.models.common.moe import MoEModelArgs
from torchtrain.models.common.vision import VisionArgs


@dataclass
class Qwen3_5Args(VisionArgs, GQADecoderArgs):
    dim: int = 4096
    """Hidden size (HF hidden_size)."""

    n_layers: int = 32
    """Number of blocks (linear and full attention together)."""

    n_heads: int = 16
    """Query heads of the full-attention layers."""

    n_kv_heads: int | None = 4
    """Key/value heads of the full-attention layers."""

    head_dim: int = 256
    """Width of a full-attention head."""

    vocab_size: int = 248320
    """Embedding rows; must be at least the tokenizer's vocabulary."""

    hidden_dim: int = 12288
    """SwiGLU hidden size of the dense feed-forward (HF intermediate_size)."""

    rope_theta: float = 10000000.0
    """RoPE base frequency."""

    partial_rotary_factor: float = 0.25
    """Fraction of each full-attention head's dimensions RoPE rotates (the first ones)."""

    full_attention_interval: int = 4
    """Every this-many-th layer is full attention, the others linear (layer i is full when
    (i + 1) % interval == 0)."""

    linear_num_key_heads: int = 16
    """Query/key heads of the linear-attention layers."""

    linear_num_value_heads: int = 32
    """Value heads of the linear-attention layers (a multiple of linear_num_key_heads)."""

    linear_key_head_dim: int = 128
    """Width of a linear-attention query/key head."""

    linear_value_head_dim: int = 128
    """Width of a linear-attention value head."""

    linear_conv_kernel_dim: int = 4
    """Taps of the linear layers' causal depthwise convolutions."""

    linear_attn_kernel: Literal["chunked", "recurrent", "fla"] = "chunked"
    """The gated delta rule's kernel: "chunked" (torchtrain's chunk-parallel algorithm, compiles),
    "recurrent" (the token-by-token reference), "fla" (flash-linear-attention's Triton kernel on CUDA:
    pip install 'torchtrain[fla]')."""

    linear_attn_chunk_size: int = 64
    """Tokens per chunk of the chunked delta rule."""

    mrope_section: tuple[int, int, int] = (11, 11, 10)
    """Multimodal RoPE: how many of the rotated pairs follow the height and width positions (entries 1 and 2,
    interleaved: `models/common/rope.py::mrope_axes`); the rest follow time. Only matters with images."""

    image_token_id: int = 248056
    """Id of the image placeholder token (`<|image_pad|>`; set from the tokenizer when the job has one)."""

    vision_start_token_id: int = 248053
    """Id of the token before an image's placeholders (`<|vision_start|>`)."""

    vision_end_token_id: int = 248054
    """Id of the token after an image's placeholders (`<|vision_end|>`)."""

    def bind_image_tokens(self, image_pad: int, vision_start: int, vision_end: int) -> None:
        self.image_token_id, self.vision_start_token_id, self.vision_end_token_id = image_pad, vision_start, vision_end

    def is_full(self, layer_id: int) -> bool:
        """Whether layer `layer_id` is a full-attention layer."""
        return (layer_id + 1) % self.full_attention_interval == 0

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def n_full(self) -> int:
        return sum(self.is_full(i) for i in range(self.n_layers))

    def validate(self) -> None:
        GQADecoderArgs.validate(self)
        self.check_sizes(("full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
                          "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                          "linear_attn_chunk_size"))
        if self.rope_dim < 2 or self.rope_dim % 2:
            raise ConfigError(f"[model.partial_rotary_factor] {self.partial_rotary_factor} x head_dim {self.head_dim} "
                              f"= {self.rope_dim} rotated dimensions: must be even and >= 2")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"[model.linear_num_value_heads] {self.linear_num_value_heads} must be a multiple of "
                              f"model.linear_num_key_heads {self.linear_num_key_heads} (each key head serves "
                              f"value heads in groups)")
        delta_rule.check_kernel(self.linear_attn_kernel)
        self.validate_vision()
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ConfigError(f"[model.mrope_section] must be three non-negative counts (time, height, width), got "
                              f"{list(self.mrope_section)}")

    # ------------------------------------------------------------------ counts
    def attention_params(self) -> int:
        d, hd, h, kv = self.dim, self.head_dim, self.n_heads, self.kv_heads
        return 2 * d * h * hd + 2 * d * kv * hd + h * hd * d + 2 * hd

    def linear_attention_params(self) -> int:
        d, hk, hv = self.dim, self.linear_num_key_heads, self.linear_num_value_heads
        dk, dv, taps = self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel_dim
        return d * (2 * hk * dk + 2 * hv * dv + 2 * hv) + (2 * hk * dk + hv * dv) * taps + 2 * hv + dv + hv * dv * d

    def _count(self, active: bool, exclude_embedding: bool) -> int:
        mixers = self.n_full * self.attention_params() + (self.n_layers - self.n_full) * self.linear_attention_params()
        table = self.vocab_size * self.dim
        total = mixers + self.n_layers * (self.ffn_params(active) + 2 * self.dim) + self.dim + table
        if not self.tie_word_embeddings:
            total += table
        total += self.vision_params()
        return total - table if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """The decoder's FLOPs per token (the vision encoder runs per image patch, not per token: the planner
        costs it per image, `planner`)."""
        return super().flops_per_token(seq_len) - 6 * self.vision_params()

    def linear_mixer_flops(self) -> int:
        """Training FLOPs per token of one linear layer's delta rule (module doc)."""
        return 18 * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim

    def mixer_flops(self, seq_len: int) -> int:
        linear = (self.n_layers - self.n_full) * self.linear_mixer_flops()
        return 12 * self.n_full * self.n_heads * self.head_dim * seq_len + linear


@dataclass
class Qwen3_5MoeArgs(MoEModelArgs, Qwen3_5Args):
    """Qwen3.5-MoE: every feed-forward a mixture of experts with one shared expert behind a sigmoid gate."""

    num_shared_experts: int = 1
    """Shared experts (Qwen3.5: one, of the routed experts' width)."""

    shared_expert_gate: bool = True
    """The shared expert's output is scaled by sigmoid(x w_g) (Qwen3.5)."""
