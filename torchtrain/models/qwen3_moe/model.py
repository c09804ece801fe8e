"""Qwen3-MoE: the Qwen3 decoder (grouped-query attention with per-head query/key RMSNorm, "rotate half"
RoPE: `models/common/transformer.py`) with a mixture-of-experts feed-forward in every block
(`models/common/moe.py`: softmax router, top-k, SwiGLU experts, no shared experts in the published
models). No parallel code."""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.models.common.moe import MoE, MoEDecoder
from torchtrain.models.common.transformer import Decoder, qk_norm_block, qk_norm_rope
from torchtrain.models.qwen3_moe.args import Qwen3MoeArgs


class MoETransformer(MoEDecoder, Decoder):
    args: Qwen3MoeArgs

    def block(self, layer_id: int) -> nn.Module:
        return qk_norm_block(self.args, MoE(self.args.dim, self.args))

    def rope(self, device: torch.device | None = None) -> torch.Tensor:
        return qk_norm_rope(self.args, device)
