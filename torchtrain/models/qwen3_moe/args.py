"""Qwen3-MoE model arguments: Qwen3's, with every feed-forward a mixture of experts.

Parameters: `num_params` counts every expert; `num_active_params` what one token uses (its top-k
experts, the shared ones and the router). FLOPs per token -- and so MFU -- use the active ones:

    flops/token = 6 x active matmul parameters + 12 x n_layers x n_heads x head_dim x seq_len
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.models.common.moe import MoEModelArgs
from torchtrain.models.qwen3.args import Qwen3Args


@dataclass
class Qwen3MoeArgs(MoEModelArgs, Qwen3Args):
    def validate(self) -> None:
        Qwen3Args.validate(self)
        self.validate_moe()

    def ffn_params(self, active: bool = False) -> int:
        total, active_params = self.moe_params(self.dim)
        return active_params if active else total
