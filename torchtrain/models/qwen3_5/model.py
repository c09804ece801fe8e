"""Qwen3.5 (text decoder): the decoder skeleton (`models/common/transformer.py`) with hybrid blocks.

* layer i is **full attention** when (i + 1) % full_attention_interval == 0: grouped-query attention whose
  query projection also gives each head an output gate (out_h <- out_h sigmoid(g_h) before W_o), with
  per-head query/key norms and "rotate half" RoPE on the first `rope_dim` dimensions of each head;
* every other layer is **Gated DeltaNet** linear attention (`models/common/linear_attention.py`);
* every norm (the blocks', the query/key norms, the final one) scales by 1 + weight, the weight starting
  at zero -- but the linear layers' gated output norm, a plain RMSNorm;
* the feed-forward is a SwiGLU (`Qwen3_5Transformer`) or the shared MoE layer with one sigmoid-gated
  shared expert (`Qwen3_5MoeTransformer`).

No parallel code: TP, EP, CP and PP are applied from outside (`parallelize.py`, `distributed/`).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.models.base import InitSpec
from torchtrain.models.common.decoder import LAYER_ID, output_std
from torchtrain.models.common.layers import FeedForward
from torchtrain.models.common.linear_attention import GatedDeltaNet
from torchtrain.models.common.moe import MoE, MoEDecoder
from torchtrain.models.common.rope import frequencies, rope_table
from torchtrain.models.common.transformer import Decoder, DecoderBlock, GQAttention
from torchtrain.models.qwen3_5.args import Qwen3_5Args, Qwen3_5MoeArgs


def mixer(args: Qwen3_5Args, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s token mixer: gated full attention or Gated DeltaNet (module doc)."""
    a = args
    if a.is_full(layer_id):
        return GQAttention(a.dim, a.n_heads, a.kv_heads, a.head_dim, a.attention_mask, "half", qk_norm_eps=a.norm_eps,
                           output_gate=True, rope_dim=a.rope_dim, zero_centered_norms=True)
    return GatedDeltaNet(a.dim, a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                         a.linear_value_head_dim, a.linear_conv_kernel_dim, a.norm_eps, a.linear_attn_kernel,
                         a.linear_attn_chunk_size)


class Qwen3_5Transformer(Decoder):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size); see `Decoder` and the module doc."""

    args: Qwen3_5Args
    zero_centered_norms = True

    def block(self, layer_id: int) -> nn.Module:
        return DecoderBlock(self.args.dim, self.args.norm_eps, mixer(self.args, layer_id), self.feed_forward(),
                            zero_centered_norms=True)

    def feed_forward(self) -> nn.Module:
        return FeedForward(self.args.dim, self.args.hidden_dim)

    def rope(self, device: torch.device | None = None) -> torch.Tensor:
        return rope_table(frequencies(self.args.rope_dim, self.args.rope_theta, device), self.args.max_seq_len)

    def init_spec(self, fqn: str) -> InitSpec:
        a = self.args
        match = LAYER_ID.match(fqn)
        if match and not a.is_full(int(match.group(1))) and ".attention." in fqn:
            own = GatedDeltaNet.init_spec(fqn.split(".attention.", 1)[1], 0.02, output_std(fqn, a.n_layers, a.depth_init),
                                          a.linear_conv_kernel_dim)
            if own is not None:
                return own
        if fqn.endswith("norm.weight"):
            return InitSpec("zeros")  # scaled by 1 + weight
        return super().init_spec(fqn)


class Qwen3_5MoeTransformer(MoEDecoder, Qwen3_5Transformer):
    """Qwen3.5-MoE: a mixture of experts with a gated shared expert in every block."""

    args: Qwen3_5MoeArgs

    def feed_forward(self) -> nn.Module:
        return MoE(self.args.dim, self.args)
