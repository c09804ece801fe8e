"""Scoring rollout rows with a model (`rollout.py`): per-token log-probs of every row's labels, by the reference
(GRPO's KL term) or by the model being trained (grpo.old_logps = "trainer"), as the train step cuts the rows."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from torchtrain.distributed.utils import all_reduce
from torchtrain.models.base import forward_counting
from torchtrain.utils.token_loss import token_logps


def score_rows(step, rows: dict[str, torch.Tensor], per_forward: int, temperature: float, scoring,
               logits: Callable) -> torch.Tensor:
    """Per-token log-probs of every row's labels at the sampling `temperature`, (rows, seq_len) float32 on the CPU:
    `logits(step, micro_batch)` inside the `scoring` context over the rows, `per_forward` rows at a time as the train
    step cuts them (context-parallel chunks put back in place and summed over the CP ranks; zeros on a pipeline rank
    before the last stage, whose loss never reads them)."""
    out = torch.zeros(rows["labels"].shape)
    dims = step.layout.dims
    with scoring:
        for start in range(0, out.shape[0], per_forward):
            batch = {k: v.to(step.device) for k, v in step.shard({k: v[start:start + per_forward]
                                                                   for k, v in rows.items()
                                                                   if k in ("input_ids", "labels")}).items()}
            result = logits(step, batch)
            if result is None:
                continue
            logps = token_logps(result if temperature == 1 else result.float() / temperature, batch["labels"]).float()
            if dims.cp_enabled:
                logps = torch.zeros(out[start:start + per_forward].shape, device=logps.device).scatter_(
                    1, batch["seq_index"], logps)
            out[start:start + per_forward] = logps.cpu()
    if dims.cp_enabled:
        out = all_reduce(out.to(step.device), dims.cp_mesh).cpu()
    return out


@contextlib.contextmanager
def trainer_scoring(step):
    """The model being trained scoring: no gradients, no MoE / extra-loss statistics, the step's context."""
    with torch.no_grad(), forward_counting(False), step.context():
        yield
