"""Qwen3.5 (text decoder): the decoder skeleton (`models/common/transformer.py`) with hybrid blocks.

* layer i is **full attention** when (i + 1) % full_attention_interval == 0: grouped-query attention whose
  query projection also gives each head an output gate (out_h <- out_h sigmoid(g_h) before W_o), with
  per-head query/key norms and "rotate half" RoPE on the first `rope_dim` dimensions of each head;
* every other layer is **Gated DeltaNet** linear attention (`models/common/linear_attention.py`);
* every norm (the blocks', the query/key norms, the final one) scales by 1 + weight, the weight starting
  at zero -- but the linear layers' gated output norm, a plain RMSNorm;
* the feed-forward is a SwiGLU (`Qwen3_5Transformer`) or the shared MoE layer with one sigmoid-gated
  shared expert (`Qwen3_5MoeTransformer`);
* with `vision_depth` > 0 the model sees images: the vision encoder (`models/common/vision.py`) turns the
  batch's images into tokens that replace the placeholders of the embedded text (`image_scatter`), and the
  full-attention layers take three positions per token (multimodal RoPE, `models/common/multimodal.py`).
  `batch_inputs` derives those positions and each placeholder's feature index from the whole batch, before
  any split of the sequence.

No parallel code: TP, EP, CP and PP are applied from outside (`parallelize.py`, `distributed/`).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.models.base import InitSpec
from torchtrain.models.common.attention import attention_inputs
from torchtrain.models.common.decoder import LAYER_ID, output_std
from torchtrain.models.common.kv_cache import KVCache
from torchtrain.models.common.layers import FeedForward
from torchtrain.models.common.linear_attention import GatedDeltaNet
from torchtrain.models.common.moe import MoE, MoEDecoder
from torchtrain.models.common.multimodal import ImageScatter, feature_index, multimodal_positions, packed_images
from torchtrain.models.common.rope import frequencies, mrope_axes, mrope_rows, rope_table, rotations
from torchtrain.models.common.transformer import Decoder, DecoderBlock, GQAttention
from torchtrain.models.common.vision import VisionEncoder, vision_init_spec
from torchtrain.models.qwen3_5.args import Qwen3_5Args, Qwen3_5MoeArgs
from torchtrain.utils.batch_keys import DOCUMENT_INPUTS, IMAGE_INPUTS


def mixer(args: Qwen3_5Args, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s token mixer: gated full attention or Gated DeltaNet (module doc)."""
    a = args
    if a.is_full(layer_id):
        return GQAttention(a.dim, a.n_heads, a.kv_heads, a.head_dim, a.attention_mask, "half", qk_norm_eps=a.norm_eps,
                           output_gate=True, rope_dim=a.rope_dim, zero_centered_norms=True)
    return GatedDeltaNet(a.dim, a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                         a.linear_value_head_dim, a.linear_conv_kernel_dim, a.norm_eps, a.linear_attn_kernel,
                         a.linear_attn_chunk_size)


class Qwen3_5Transformer(Decoder):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size); see `Decoder` and the module doc."""

    args: Qwen3_5Args
    zero_centered_norms = True
    forward_inputs = (*DOCUMENT_INPUTS, *IMAGE_INPUTS)

    def __init__(self, args: Qwen3_5Args):
        super().__init__(args)
        if args.vision:
            self.vision_encoder: VisionEncoder | None = VisionEncoder(args, args.dim)
            self.image_scatter = ImageScatter()
            self.register_buffer("mrope_axes", mrope_axes(args.rope_dim // 2, tuple(args.mrope_section)),
                                 persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                seq_index: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid: torch.Tensor | None = None, rope_positions: torch.Tensor | None = None,
                image_index: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """`Decoder.forward`, with a batch's images (module doc): `pixel_values` (rows, P, C T p p) and
        `image_grid` (rows, I, 3) as the data gives them, `rope_positions` (rows, L, 3) and `image_index`
        (rows, L) from `batch_inputs`. With a key/value `cache` (incremental decoding) text only."""
        if cache is not None and pixel_values is not None:
            raise ValueError("incremental decoding with a key/value cache takes text prompts only")
        if not self.args.vision or cache is not None:
            return super().forward(tokens, positions, seq_index, cache)
        if image_grid is not None and (rope_positions is None or image_index is None):  # a whole sequence
            derived = self.batch_inputs({"input_ids": tokens, "image_grid": image_grid,
                                         **({"positions": positions} if positions is not None else {})})
            rope_positions, image_index = derived["rope_positions"], derived["image_index"]
        rope, ctx = attention_inputs(self, self.args.attention_mask, self.rope_cache, tokens, positions, seq_index,
                                     self.windows)
        if rope_positions is not None:
            rope = rotations(mrope_rows(self.rope_cache, rope_positions, self.mrope_axes), rope_positions.shape[1])
        h = self.embed(tokens)
        if self.tok_embeddings is not None:
            # The encoder runs whenever the batch carries images, even none this time, so that every rank runs
            # the same collectives of a sharded encoder. A text batch passes the scatter too: tensor parallelism
            # cuts the sequence into shards at its output.
            features = index = None
            if pixel_values is not None:
                features = self.vision_encoder(*packed_images(pixel_values, image_grid))
                index = feature_index(image_index, image_grid, self.args.vision_merge_size)
            h = self.image_scatter(h, features, index)
        h = self.run_blocks(h, rope, ctx)
        if self.norm is None:
            return h
        return self.head(self.norm(h))

    def batch_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` with the inputs the images imply, computed from whole sequences (before context parallelism
        cuts them): each token's three RoPE positions and each placeholder's index among its row's image
        tokens. Unchanged without images or without a vision encoder."""
        if not self.args.vision or "image_grid" not in batch:
            return batch
        rope_positions, image_index = multimodal_positions(batch["input_ids"], batch.get("positions"),
                                                           batch["image_grid"], self.args.image_token_id,
                                                           self.args.vision_merge_size)
        return {**batch, "rope_positions": rope_positions, "image_index": image_index}

    def block(self, layer_id: int) -> nn.Module:
        return DecoderBlock(self.args.dim, self.args.norm_eps, mixer(self.args, layer_id), self.feed_forward(),
                            zero_centered_norms=True)

    def feed_forward(self) -> nn.Module:
        return FeedForward(self.args.dim, self.args.hidden_dim)

    def rope(self, device: torch.device | None = None) -> torch.Tensor:
        return rope_table(frequencies(self.args.rope_dim, self.args.rope_theta, device), self.args.max_seq_len)

    def init_buffers(self) -> None:
        super().init_buffers()
        if self.args.vision:
            self.mrope_axes = mrope_axes(self.args.rope_dim // 2, tuple(self.args.mrope_section)).to(
                self.rope_cache.device)

    def init_spec(self, fqn: str) -> InitSpec:
        a = self.args
        match = LAYER_ID.match(fqn)
        if match and not a.is_full(int(match.group(1))) and ".attention." in fqn:
            own = GatedDeltaNet.init_spec(fqn.split(".attention.", 1)[1], 0.02, output_std(fqn, a.n_layers, a.depth_init),
                                          a.linear_conv_kernel_dim)
            if own is not None:
                return own
        if fqn.startswith("vision_encoder."):
            return vision_init_spec(fqn.removeprefix("vision_encoder."))
        if fqn.endswith("norm.weight"):
            return InitSpec("zeros")  # scaled by 1 + weight
        return super().init_spec(fqn)


class Qwen3_5MoeTransformer(MoEDecoder, Qwen3_5Transformer):
    """Qwen3.5-MoE: a mixture of experts with a gated shared expert in every block."""

    args: Qwen3_5MoeArgs

    def feed_forward(self) -> nn.Module:
        return MoE(self.args.dim, self.args)
