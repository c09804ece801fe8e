"""How image tokens join a decoder's sequence (the Qwen-VL scheme): placeholders, their features, and the
multimodal RoPE positions.

A batch row holds text tokens and, per image, a run of t h w / m^2 placeholder tokens (`image_token_id`,
one per merged block of patches); the row's images come as `pixel_values` (rows, P, C T p p: each row's
patches, zero-padded) and `image_grid` (rows, I, 3: each image's (t, h, w) in patches, zero rows padding),
in the order their runs appear (`data/image/pixels.py`).

* **Scatter.** The encoder runs once over all the batch's images packed (no padding); the k-th placeholder
  of row b takes feature row offset_b + k (`image_index`: k, or -1 for a text token). The index is computed
  on the whole sequence before any split, so a context-parallel rank holding some chunks scatters exactly
  the features of its own placeholders (the encoder then runs on every CP rank: its work is small beside
  the decoder's, and its gradient is summed over the ranks with the decoder's).
* **Positions** (three per token: time, height, width). Within a document (positions restart at 0 at every
  packed document), a text token's three positions equal c, the running position, which then grows by 1;
  an image starting at c gives its token (ti, hi, wi) of the t x h/m x w/m grid the positions
  (c + ti, c + hi, c + wi), and c then grows by max(h, w) / m. A text-only document therefore gets three
  equal positions = its token index: plain RoPE. The decoder's full-attention layers turn each RoPE pair by
  the position of the axis it belongs to (`rope.py::mrope_axes`).
"""

from __future__ import annotations

import torch
from torch import nn


def image_token_counts(image_grid: torch.Tensor, merge: int) -> torch.Tensor:
    """(rows, I) decoder tokens of each image (0 for padding)."""
    return image_grid.long().prod(-1) // (merge * merge)


def multimodal_positions(input_ids: torch.Tensor, positions: torch.Tensor | None, image_grid: torch.Tensor,
                         image_token_id: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope positions (rows, L, 3), image_index (rows, L)) of a batch (module doc); ValueError when a row's
    placeholders do not match its images' token counts."""
    ids = input_ids
    grid = image_grid.to(ids.device).long()
    is_image = ids == image_token_id
    counts = image_token_counts(grid, merge)  # (rows, I)
    have, want = is_image.sum(1), counts.sum(1)
    if not torch.equal(have, want):
        bad = int((have != want).nonzero()[0, 0])
        raise ValueError(f"row {bad} holds {int(have[bad])} image placeholder tokens but its images make "
                         f"{int(want[bad])} (image_grid {grid[bad].tolist()}, merge {merge})")
    image_index = torch.where(is_image, torch.cumsum(is_image.long(), 1) - 1, -1)
    ends = torch.cumsum(counts, 1)  # (rows, I)
    k = torch.searchsorted(ends, image_index.clamp(min=0), right=True).clamp(max=max(grid.shape[1] - 1, 0))
    pick = (lambda t: t.gather(1, k)) if grid.shape[1] else (lambda t: torch.zeros_like(ids))
    h_img, w_img = pick(grid[..., 1]), pick(grid[..., 2])
    h_l, w_l = h_img // merge, w_img // merge
    within = torch.where(is_image, image_index - (pick(ends) - pick(counts)), 0)
    n_img = pick(counts)
    last = is_image & (within == n_img - 1)
    # what each token adds to the running position after it: 1 (text), max(h, w) / m (an image's last token)
    step = torch.where(is_image, torch.where(last, torch.maximum(h_l, w_l), 0), 1)
    before = torch.cumsum(step, 1) - step  # exclusive running sum over the row
    starts = positions == 0 if positions is not None else torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    doc_base = torch.cummax(torch.where(starts, before, 0), dim=1).values  # `before` at the document's start
    base = before - doc_base
    hw = (h_l * w_l).clamp(min=1)
    offset = torch.stack([within // hw, (within // w_l.clamp(min=1)) % h_l.clamp(min=1),
                          within % w_l.clamp(min=1)], dim=-1)
    rope_positions = base.unsqueeze(-1) + torch.where(is_image.unsqueeze(-1), offset, 0)
    return rope_positions, image_index


def packed_images(pixel_values: torch.Tensor, image_grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's real patches packed (N, C T p p) and grids (images, 3), rows in order, padding dropped."""
    grid = image_grid.long()
    per_row = grid.prod(-1).sum(-1)  # (rows,)
    keep = torch.arange(pixel_values.shape[1], device=pixel_values.device) < per_row.to(pixel_values.device)[:, None]
    return pixel_values[keep], grid[grid.prod(-1) > 0]


def feature_index(image_index: torch.Tensor, image_grid: torch.Tensor, merge: int) -> torch.Tensor:
    """(rows, L) row of the packed encoder output each placeholder takes (-1 for text): its row's offset
    plus its index in the row."""
    per_row = image_token_counts(image_grid, merge).sum(-1).to(image_index.device)
    offset = torch.cumsum(per_row, 0) - per_row
    return torch.where(image_index >= 0, image_index + offset[:, None], -1)


class ImageScatter(nn.Module):
    """h (rows, L, D) with each placeholder's hidden state replaced by its image feature. A module of its own
    so that tensor parallelism can place its input and output (`models/qwen3_5/parallelize.py`)."""

    def forward(self, h: torch.Tensor, features: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor:
        if features is None or index is None:  # a text batch: h as it is (placed by tensor parallelism)
            return h
        if features.shape[0] == 0:  # no image this time: still part of the graph, so the encoder gets its
            return h + features.sum().to(h.dtype) * 0  # (zero) gradients like on the ranks that had images
        picked = features[index.clamp(min=0)].to(h.dtype)
        return torch.where((index >= 0).unsqueeze(-1), picked, h)
