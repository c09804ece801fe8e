"""gpt-oss: the decoder skeleton (`models/common/transformer.py`) with OpenAI's block.

* attention: grouped-query attention with biased q/k/v/o projections, no query/key norms, "rotate half"
  RoPE with YaRN frequencies (the table scaled by YaRN's attention factor), one learned sink logit per
  head (`models/common/attention.py`), and a sliding window of `sliding_window` tokens on the layers
  `GptOssArgs.is_sliding` names (alternate layers, the first sliding);
* feed-forward: the shared MoE layer (`models/common/moe.py`) with a biased router (softmax over the
  experts, top-k, renormalised: the same weights as a softmax over the top-k logits) over `GptOssExperts`:

      gate = min(x w1^T + b1, limit)        up = clamp(x w3^T + b3, -limit, limit)
      expert(x) = (gate sigmoid(alpha gate) (up + 1)) w2^T + b2

  Its gate and up weights are one parameter `w13` (E, 2F, D: the gate rows, then the up rows; biases
  `b13` (E, 2F)), as Hugging Face stores them in one tensor, so checkpoints convert tensor by tensor.

No parallel code: TP, EP, CP and PP are applied from outside (`parallelize.py`, `distributed/`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from torchtrain.models.base import InitSpec
from torchtrain.models.common import rope
from torchtrain.models.common.dispatch import LocalDispatcher
from torchtrain.models.common.experts import ExpertBiases, GroupedExperts, clamped_swiglu, expert_swiglu, swiglu_grouped
from torchtrain.models.common.layers import local_tensor
from torchtrain.models.common.moe import MoE, MoEDecoder
from torchtrain.models.common.transformer import Decoder, DecoderBlock, GQAttention
from torchtrain.models.gpt_oss.args import GptOssArgs


class GptOssExperts(GroupedExperts):
    """E experts with biases and the clamped SwiGLU: w13 (E, 2F, D), b13 (E, 2F), w2 (E, D, F), b2 (E, D)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, alpha: float, limit: float,
                 use_grouped_mm: bool = True):
        nn.Module.__init__(self)
        self.num_experts, self.use_grouped_mm, self.float8 = num_experts, use_grouped_mm, False
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.b2 = nn.Parameter(torch.empty(num_experts, dim))
        self.activation = functools.partial(clamped_swiglu, alpha=alpha, limit=limit)
        self.dispatcher = LocalDispatcher(num_experts)

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3 = local_tensor(self.w13).chunk(2, dim=1)
        b1, b3 = local_tensor(self.b13).chunk(2, dim=1)
        w2, biases = local_tensor(self.w2), ExpertBiases(b1, local_tensor(self.b2), b3)
        if self.float8:
            return swiglu_grouped(x, counts, w1, w2, w3, biases, self.activation).to(x.dtype)
        return expert_swiglu(x, counts, w1, w2, w3, self.use_grouped_mm, biases, self.activation)


def gpt_oss_rope(args: GptOssArgs, device: torch.device | None = None) -> torch.Tensor:
    """The RoPE table: YaRN frequencies over head_dim (untruncated ramp), scaled by YaRN's attention factor."""
    freqs = rope.yarn_scaled(rope.frequencies(args.head_dim, args.rope_theta, device), args.rope_theta,
                             args.rope_factor, args.rope_original_max_seq_len, args.rope_beta_fast,
                             args.rope_beta_slow, truncate=False)
    return rope.rope_table(freqs, args.max_seq_len, rope.yarn_mscale(args.rope_factor, 1.0))


class GptOssTransformer(MoEDecoder, Decoder):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size); see `Decoder` and the module doc."""

    args: GptOssArgs

    def block(self, layer_id: int) -> nn.Module:
        a = self.args
        attention = GQAttention(a.dim, a.n_heads, a.kv_heads, a.head_dim, a.attention_mask, "half", bias=True,
                                window=a.sliding_window if a.is_sliding(layer_id) else None, sinks=True)
        experts = GptOssExperts(a.dim, a.moe_intermediate_size, a.num_experts, a.swiglu_alpha, a.swiglu_limit,
                                a.use_grouped_mm)
        return DecoderBlock(a.dim, a.norm_eps, attention, MoE(a.dim, a, experts=experts, router_bias=True))

    def rope(self, device: torch.device | None = None) -> torch.Tensor:
        return gpt_oss_rope(self.args, device)

    def init_spec(self, fqn: str) -> InitSpec:
        if fqn.endswith(("bias", ".b13", ".b2")):
            return InitSpec("zeros")
        return super().init_spec(fqn)
