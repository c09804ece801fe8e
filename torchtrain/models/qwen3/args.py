"""Qwen3 (dense) model arguments: the grouped-query-attention decoder's (`models/common/gqa_args.py`:
explicit `head_dim`, per-head query/key RMSNorm, RoPE base 1e6, a dense SwiGLU in every block)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.models.common.gqa_args import GQADecoderArgs


@dataclass
class Qwen3Args(GQADecoderArgs):
    """Qwen3 (dense): the published 0.6B-32B shapes are `QWEN3_FLAVORS`."""
