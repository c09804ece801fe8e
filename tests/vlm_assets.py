"""What the vision-language tests share: a tokenizer folder with Qwen's image tokens and a Qwen-style chat
template (`tools/shapes.py::write_tokenizer`), and the model arguments of a tiny `qwen3_5` with its vision
encoder."""

from __future__ import annotations

from torchtrain.tools.shapes import write_tokenizer  # noqa: F401 (re-exported for the tests)

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
