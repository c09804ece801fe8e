"""Qwen3-MoE: the Qwen3 model (`models/qwen3/model.py`) with a mixture-of-experts feed-forward in
every block (`models/common/moe.py`: softmax router, top-k, SwiGLU experts, no shared experts in
the published models). No parallel code."""

from __future__ import annotations

from torch import nn

from torchtrain.models.base import InitSpec
from torchtrain.models.common.moe import MoE, moe_layers
from torchtrain.models.qwen3.model import Transformer
from torchtrain.models.qwen3_moe.args import Qwen3MoeArgs


class MoETransformer(Transformer):
    args: Qwen3MoeArgs

    def feed_forward(self, layer_id: int) -> nn.Module:
        return MoE(self.args.dim, self.args)

    def init_spec(self, fqn: str) -> InitSpec:
        head, sep, rest = fqn.partition(".feed_forward.")
        if sep:  # router, experts, shared experts
            return MoE.init_spec(rest, std=0.02, out_std=self.output_std(fqn))
        return super().init_spec(fqn)

    def init_buffers(self) -> None:
        super().init_buffers()
        for _, layer in moe_layers(self):
            layer.init_buffers()
