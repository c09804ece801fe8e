"""Tiny Hugging Face model folders for the transformers-model tests: random configs built from transformers'
config classes and written with `save_pretrained` (config.json, and the weights when asked), optionally
with a small tokenizer.json. Every model is 2 layers of width 64, 4 query heads over 2 key/value heads,
a vocabulary of 300 (the byte tokenizer's 258 ids fit), untied embeddings unless asked; each family
keeps what is its own (sliding windows shorter than the test sequences, soft-capping, per-head or
whole-width query/key norms, fused projections, biases, experts). Weights are drawn with std 0.2 (not
transformers' 0.02) so logits are O(1) and routing is far from uniform."""

from __future__ import annotations

import json
import os

import pytest

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=300, max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False,
              bos_token_id=256, eos_token_id=257, pad_token_id=None)
MOE = dict(intermediate_size=32, num_experts_per_tok=2)
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=16),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "phi3": lambda: transformers.Phi3Config(**COMMON),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=8),
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=8),
    "olmo2": lambda: transformers.Olmo2Config(**COMMON),
    # model types no torchtrain code names: the declared plan is all they bring
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "granite": lambda: transformers.GraniteConfig(**COMMON, embedding_multiplier=2.0, residual_multiplier=0.5,
                                                  logits_scaling=2.0),
    "cohere": lambda: transformers.CohereConfig(**COMMON),
    "mixtral": lambda: transformers.MixtralConfig(**{**COMMON, **MOE}, num_local_experts=4),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**{**COMMON, **MOE}, num_experts=4, moe_intermediate_size=32,
                                                     head_dim=16, norm_topk_prob=False),
    "gpt_oss": lambda: transformers.GptOssConfig(**{**COMMON, **MOE}, num_local_experts=4, head_dim=16,
                                                 sliding_window=8),
    # Gated DeltaNet layers: weights drawn with std 0.05 (the delta rule's float32 noise grows with the scale)
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**{**COMMON, "initializer_range": 0.05}, head_dim=16,
                                                    linear_num_key_heads=2, linear_num_value_heads=4,
                                                    linear_key_head_dim=16, linear_value_head_dim=16,
                                                    full_attention_interval=2),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**{**COMMON, **MOE}, head_dim=16, num_experts=4,
                                                       moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                       linear_num_key_heads=2, linear_num_value_heads=4,
                                                       linear_key_head_dim=16, linear_value_head_dim=16,
                                                       full_attention_interval=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**{**COMMON, **MOE}, num_experts=4, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=32),
}


def config(kind: str, **changes):
    cfg = CONFIGS[kind]()
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def write_tokenizer(folder: str) -> None:
    """A byte-level BPE tokenizer.json (258 ids: 256 bytes, <s>, </s>) and a tokenizer_config.json with a
    chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, f)


def hf_folder(folder, kind: str, weights: bool = True, tokenizer: bool = False, seed: int = 0, **changes) -> str:
    """Write model `kind` (config changes applied) to `folder`: its config, its random weights when
    `weights` (else the config alone: the model's own init), a tokenizer when asked. Returns the folder."""
    import torch

    folder = str(folder)
    cfg = config(kind, **changes)
    if weights:
        torch.manual_seed(seed)
        transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(folder)
    else:
        cfg.save_pretrained(folder)
    if tokenizer:
        write_tokenizer(folder)
    return folder
