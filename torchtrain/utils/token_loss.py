"""The token-level loss primitives every consumer shares -- the train step (`trainer/loss.py`), held-out
validation and downstream evaluation, the datasets' label masks: which label is ignored, the summed
float32 cross-entropy, the count of valid targets, a (replicated) DTensor loss as a plain tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy in float32 (positions labelled IGNORE_INDEX excluded)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A (replicated) DTensor loss as a plain tensor; plain tensors unchanged."""
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log pi(label) per position in float32, (rows, seq); 0 where the label is ignored. Vocabulary-sharded
    DTensor logits (loss parallel) are reduced across the shards and returned as a plain tensor."""
    flat = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none",
                           ignore_index=IGNORE_INDEX)
    return -local_value(flat).view(labels.shape)
