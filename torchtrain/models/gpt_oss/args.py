"""gpt-oss model arguments: a grouped-query-attention decoder (`models/common/gqa_args.py`) without
query/key norms, whose layers alternate sliding-window and full attention, with biased projections,
attention sinks, YaRN RoPE, and a mixture-of-experts feed-forward in every block (biased router and
experts, clamped SwiGLU).

Parameters per block: attention 2 D (H + Hkv) hd + biases (H + 2 Hkv) hd + D + H sinks; MoE router
E (D + 1) and E experts of 3 D F weights + 2 F + D biases; two norms. `num_active_params` counts a
token's top-k experts. FLOPs per token follow the Llama 3 convention with each layer's attended span:

    flops/token = 6 x active matmul parameters + 12 x H x hd x sum over layers of min(span, seq_len)

(span: the sliding window for sliding layers, the sequence for full ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.gqa_args import GQADecoderArgs
from torchtrain.models.common.moe import MoEModelArgs


@dataclass
class GptOssArgs(MoEModelArgs, GQADecoderArgs):
    qk_norm: ClassVar[bool] = False

    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    rope_theta: float = 150000.0
    """RoPE base frequency (before YaRN's scaling)."""

    sliding_window: int = 128
    """Keys a sliding-window layer's query sees: itself and the window - 1 tokens before it."""

    full_attention_interval: int = 2
    """Every this-many-th layer attends to the whole sequence, the others within `sliding_window`
    (layer i is full when (i + 1) % interval == 0: gpt-oss alternates sliding, full)."""

    rope_factor: float = 32.0
    """YaRN scaling factor of the RoPE frequencies (1: plain RoPE)."""

    rope_original_max_seq_len: int = 4096
    """YaRN: the context length the model was trained with before the extension."""

    rope_beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept (extrapolated)."""

    rope_beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is divided by rope_factor (interpolated)."""

    swiglu_limit: float = 7.0
    """The experts' clamp: gate pre-activations at most this, up pre-activations within +-this."""

    swiglu_alpha: float = 1.702
    """The experts' sigmoid gain: hidden = gate sigmoid(alpha gate) (up + 1)."""

    def is_sliding(self, layer_id: int) -> bool:
        """Whether layer `layer_id` attends within the sliding window."""
        return bool((layer_id + 1) % self.full_attention_interval)

    def validate(self) -> None:
        super().validate()  # the dense checks, then the experts' (MoEModelArgs.validate)
        for key in ("sliding_window", "full_attention_interval", "rope_original_max_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"[model.{key}] must be >= 1, got {getattr(self, key)}")
        if self.swiglu_limit <= 0:
            raise ConfigError(f"[model.swiglu_limit] must be > 0, got {self.swiglu_limit}")

    # ------------------------------------------------------------------ counts
    def attention_params(self) -> int:
        d, hd, h, kv = self.dim, self.head_dim, self.n_heads, self.kv_heads
        return 2 * d * (h + kv) * hd + (h + 2 * kv) * hd + d + h

    def ffn_params(self, active: bool = False) -> int:
        e, f, d = self.num_experts, self.moe_intermediate_size, self.dim
        expert = 3 * d * f + 2 * f + d
        return e * (d + 1) + (self.num_experts_per_tok if active else e) * expert

    def mixer_flops(self, seq_len: int) -> int:
        spans = sum(min(self.sliding_window, seq_len) if self.is_sliding(i) else seq_len for i in range(self.n_layers))
        return 12 * self.n_heads * self.head_dim * spans
