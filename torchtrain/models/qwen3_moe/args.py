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
    """Qwen3's arguments and the experts' (their checks and parameter counts: `MoEModelArgs`)."""
