"""A composite vision-language config of transformers (`args.py::IMAGE_TEXT`: Qwen3.5, Qwen3.5-MoE, Qwen2.5-VL,
Qwen2-VL) as a torchtrain model: transformers' image-text-to-text class (e.g. `Qwen3_5ForConditionalGeneration`,
its vision tower `model.visual`, its text model `model.language_model`, its head `lm_head`) with
`TorchtrainImageTextLM` mixed in first.

The trainer's batch (batch-first, `models/common/multimodal.py`): `input_ids` with, per image, a run of
t h w / merge^2 placeholders (`config.image_token_id`) between vision start and end tokens; `positions`
restarting at 0 per packed sample; `pixel_values` (rows, P, C T p p), each row's images' patches in placeholder
order, zero-padded; `image_grid` (rows, I, 3), each image's (t, h, w), zero rows padding. The forward turns it
into what transformers' own forward computes:

* `batch_inputs` (on the whole batch, before context parallelism cuts it): each token's three multimodal RoPE
  positions, restarting per packed sample (`multimodal_positions`: the rule of transformers' `get_rope_index`,
  per document), and each placeholder's index among its row's image tokens;
* the vision tower runs over the batch's real patches packed with their grids (`packed_images`), through the
  model's own `get_image_features`; its merged features replace the placeholders' embeddings (`ImageScatter`).
  It runs at every forward -- on a batch without images (or without image keys: text data), over one blank
  image whose features are dropped -- so every rank runs the same collectives of a sharded tower and gets its
  (zero) gradients;
* transformers' forward then runs from those embeddings with the (3, rows, L) position ids, attention going
  through torchtrain's registry function as for a text model (`attention.py`).

Layouts (`parallelize.py`): FSDP shards the vision tower's blocks, then the rest of the tower, then the text
model as for a text model. Under tensor parallelism the text model follows its declared plan; the vision tower
declares none and is replicated on every TP rank (each computes it whole; its gradients are whole, since the
embeddings it joins are gathered before sequence parallelism cuts them after the scatter). Context parallelism
runs the tower on every rank and scatters each rank's own placeholders. Pipeline and expert parallelism are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.models.common.attention import AttentionContext, prepare_attention
from torchtrain.models.common.multimodal import ImageScatter, feature_index, multimodal_positions, packed_images
from torchtrain.models.transformers import attention
from torchtrain.models.transformers.model import TorchtrainCausalLM
from torchtrain.utils.batch_keys import DOCUMENT_INPUTS, IMAGE_INPUTS


class TorchtrainImageTextLM(TorchtrainCausalLM):
    """Mixed in before transformers' image-text-to-text class (module doc)."""

    forward_inputs = (*DOCUMENT_INPUTS, *IMAGE_INPUTS)

    @property
    def text_model(self) -> nn.Module:
        return self.base_model.language_model

    @property
    def vision_tower(self) -> nn.Module:
        return self.base_model.visual

    @property
    def merge_size(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    def encoder_units(self) -> list[nn.Module]:
        """FSDP units: the vision tower's blocks, then the tower (its patch embedding, positions and merger)."""
        tower = self.vision_tower
        return [*tower.blocks, tower]

    def scatter_module(self) -> nn.Module:
        return self.image_scatter  # (`attach_scatter`)

    def batch_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` with each token's three RoPE positions (`rope_positions`, rows x L x 3) and each placeholder's
        index among its row's image tokens (`image_index`), from whole sequences; unchanged without images."""
        if "image_grid" not in batch:
            return batch
        rope_positions, image_index = multimodal_positions(batch["input_ids"], batch.get("positions"),
                                                           batch["image_grid"], self.config.image_token_id,
                                                           self.merge_size)
        return {**batch, "rope_positions": rope_positions, "image_index": image_index}

    def image_features(self, pixel_values: torch.Tensor | None, image_grid: torch.Tensor | None,
                       device: torch.device) -> torch.Tensor:
        """The vision tower's merged features of the batch's images, packed (rows of the placeholders in order);
        zero rows, still computed by the tower, for a batch without images (module doc)."""
        if pixel_values is not None and image_grid is not None:
            pixels, grids = packed_images(pixel_values, image_grid)
        else:
            pixels, grids = None, torch.zeros(0, 3, dtype=torch.long)
        blank = grids.shape[0] == 0
        if blank:  # one merge block of zero patches
            v, m = self.config.vision_config, self.merge_size
            width = getattr(v, "in_channels", 3) * v.temporal_patch_size * v.patch_size ** 2
            pixels = torch.zeros(m * m, width, device=device)
            grids = torch.tensor([[1, m, m]])
        out = self.base_model.get_image_features(pixels, grids.to(pixels.device), return_dict=True)
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(features, (list, tuple)):
            features = torch.cat(list(features), dim=0)
        return features[:0] if blank else features

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                seq_index: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid: torch.Tensor | None = None, rope_positions: torch.Tensor | None = None,
                image_index: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (and the batch's images, module doc) -> logits."""
        if image_grid is not None and (rope_positions is None or image_index is None):  # whole sequences
            derived = self.batch_inputs({"input_ids": tokens, "image_grid": image_grid,
                                         **({"positions": positions} if positions is not None else {})})
            rope_positions, image_index = derived["rope_positions"], derived["image_index"]
        batch, length = tokens.shape[:2]
        documents = self.tt_mask == "block_causal" and positions is not None
        position_ids = positions if documents else seq_index
        if position_ids is None:
            position_ids = torch.arange(length, device=tokens.device).unsqueeze(0).expand(batch, -1)
        if rope_positions is not None:
            position_ids = rope_positions.permute(2, 0, 1)  # (3, rows, L): time, height, width
        features = self.image_features(pixel_values, image_grid, tokens.device)
        index = (feature_index(image_index, image_grid, self.merge_size) if image_grid is not None
                 else torch.full_like(tokens, -1))
        h = self.image_scatter(self.get_input_embeddings()(tokens), features, index)
        kwargs = {}
        if self.tt_registry:
            ctx = AttentionContext(positions=positions if documents else None)
            kwargs[attention.CONTEXT_KEY] = prepare_attention(self, ctx, batch, length, tokens.device, self.tt_windows)
        out = super(TorchtrainCausalLM, self).forward(inputs_embeds=h, position_ids=position_ids.to(tokens.device),
                                                      use_cache=False, **kwargs)
        return out.logits


def attach_scatter(model: nn.Module) -> None:
    """Give a vision-language model its `image_scatter` (no parameters: the state dict is transformers'), which the
    embeddings always pass, so that tensor parallelism cuts them into sequence shards at its output (`tp_plan.py`)."""
    model.image_scatter = ImageScatter()
