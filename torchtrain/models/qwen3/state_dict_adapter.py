"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM` weights and config.json: the grouped-query-attention
decoder's names and config (`models/common/hf.py`). Both use the "rotate half" RoPE layout, so every
tensor is copied as is."""

from __future__ import annotations

from torchtrain.models.common.hf import GQAStateDictAdapter
from torchtrain.models.qwen3.args import Qwen3Args


class Qwen3StateDictAdapter(GQAStateDictAdapter):
    model_args: Qwen3Args
    architecture, model_type = "Qwen3ForCausalLM", "qwen3"
