"""The keys of a training batch (the one list of them), which are not per token, and how batches of them join.

    key group        keys                                                      made by
    ---------------  --------------------------------------------------------  ----------------------------------
    tokens           input_ids, labels                                         every dataset
    DOCUMENT_INPUTS  positions (each token's position in its document),        packed documents; the step
                     seq_index (its index in the full sequence, under CP)      (under context parallelism)
    IMAGE_INPUTS     pixel_values, image_grid; rope_positions, image_index     image data; the model's
                                                                               `batch_inputs`
    preference       pair_slot, pair_id, ref_logps (ref_tokens under PP)       `data/preference/pair_packing.py`
    ROLLOUT_KEYS     input_ids, labels, old_logps, advantages, ref_token_logps,  `posttrain/rollout.py`
                     sampler_logps

Every batch tensor is batch-first. Most are per token -- (rows, seq_len, ...): `input_ids`, `labels`,
`positions`, and what a model derives per token (`rope_positions`, `image_index`) -- so context parallelism
cuts them along the sequence and a pipeline schedule along the rows. The image inputs are per row, not per
token: `pixel_values` (rows, patches, C T p p) and `image_grid` (rows, images, 3), each row's zero-padded to
the batch's largest (`data/image/pixels.py`); a preference batch's `pair_id` (rows, pairs) and `ref_logps` (rows,
pairs, 2) likewise (an empty slot's id is -1). Context parallelism keeps them whole (every rank's placeholders may
need any of its rows' images), and batches holding them join by padding them to the largest again (zero
patches and zero grids are padding by definition).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DOCUMENT_INPUTS = ("positions", "seq_index")
"""Per-token inputs of a model that reads documents packed in a row (`models/base.py::BaseModel.forward_inputs`)."""
IMAGE_INPUTS = ("pixel_values", "image_grid", "rope_positions", "image_index")
"""The inputs of a model that sees images: the pictures' patches and grids, and what the model derives per token."""
ROLLOUT_KEYS = ("input_ids", "labels", "old_logps", "advantages", "ref_token_logps", "sampler_logps")
"""A GRPO rollout batch: the sampled rows, the old policy's log-probs (the sampler's, or the trainer's recomputed),
the group advantages, the reference's log-probs, the sampler's when the trainer's replace them (the last four per
token; `posttrain/policy_loss.py` packs all but input_ids as a pipeline target's columns)."""
ROW_KEYS = ("pixel_values", "image_grid", "pair_id", "ref_logps")
"""Per-row inputs that are not per token (module doc; a preference batch's per-pair ids and reference sums:
`data/preference/pair_packing.py`)."""
PADDING = {"pair_id": -1}
"""The padding value of a per-row key where it is not 0 (an empty pair slot)."""


def concat_batches(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The rows of `batches` as one batch; per-row keys padded with zeros to the largest along dim 1."""
    out = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if key in ROW_KEYS:
            most = max(p.shape[1] for p in parts)
            parts = [F.pad(p, (0, 0) * (p.ndim - 2) + (0, most - p.shape[1]), value=PADDING.get(key, 0))
                     for p in parts]
        out[key] = torch.cat(parts)
    return out
