"""What the vision-language tests share: a tokenizer folder with Qwen's image tokens and a Qwen-style chat
template (list contents, an image rendered as <|vision_start|><|image_pad|><|vision_end|>), and the
model arguments of a tiny `qwen3_5` with its vision encoder."""

from __future__ import annotations

import json
import os

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(folder: str) -> dict[str, int]:
    """A byte-level tokenizer.json (256 byte ids, then SPECIAL) and a tokenizer_config.json with the chat
    template; returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({name: 256 + i for i, name in enumerate(SPECIAL)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}, f)
    return {name: 256 + i for i, name in enumerate(SPECIAL)}


# a tiny qwen3_5 with a vision encoder: 4 decoder blocks (linear, linear, full, linear), a 2-block ViT of
# 8-pixel patches (2 x 2 merged: a 32 x 32 picture is 16 patches, 4 decoder tokens)
MODEL = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_vl", "--model.dim", "64", "--model.n_layers", "4",
         "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.head_dim", "32", "--model.vocab_size", "264",
         "--model.hidden_dim", "128", "--model.full_attention_interval", "3", "--model.linear_num_key_heads", "2",
         "--model.linear_num_value_heads", "4", "--model.linear_key_head_dim", "16",
         "--model.linear_value_head_dim", "16", "--model.linear_attn_chunk_size", "16",
         "--model.partial_rotary_factor", "0.5", "--model.attention_mask", "block_causal",
         "--model.vision_depth", "2", "--model.vision_dim", "32", "--model.vision_heads", "2",
         "--model.vision_hidden_dim", "64", "--model.vision_patch_size", "8", "--model.vision_num_position_embeddings",
         "64"]
