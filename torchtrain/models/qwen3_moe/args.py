"""Qwen3-MoE model arguments: Qwen3's (`models/common/gqa_args.py`), with every feed-forward a mixture
of experts.

Parameters: `num_params` counts every expert; `num_active_params` what one token uses (its top-k
experts, the shared ones and the router). FLOPs per token -- and so MFU -- use the active ones:

    flops/token = 6 x active matmul parameters + 12 x n_layers x n_heads x head_dim x seq_len
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.models.common.gqa_args import GQADecoderArgs
from torchtrain.models.common.moe import MoEModelArgs


@dataclass
class Qwen3MoeArgs(MoEModelArgs, GQADecoderArgs):
    def validate(self) -> None:
        GQADecoderArgs.validate(self)
        self.validate_moe()

    def ffn_params(self, active: bool = False) -> int:
        total, active_params = self.moe_params(self.dim)
        return active_params if active else total
