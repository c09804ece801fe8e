"""What the train step asks of a loss that reads the whole batch rather than its labels alone: DPO's preference
loss over chosen / rejected pairs (`preference_loss.py`) and GRPO's clipped policy objective over sampled
completions (`policy_loss.py`).

The step sets `scale` = R / U before the micro-batches run -- R the ranks holding different samples, U the global
number of `units` the loss is a mean over: the step's target tokens ("tokens", the count the step takes anyway)
or what `count` counts in each micro-batch, all-reduced -- so that data-parallel gradient averaging gives the
gradient of the global mean under any layout (trainer/step.py). The loss keeps its per-step statistics until
`pop_stats`; `record` names them for the log. Under pipeline parallelism the schedule hands the loss one target
tensor per micro-batch: `pipeline_target` packs what it reads, `from_target` unpacks it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SequenceLoss(Protocol):
    units: str
    scale: torch.Tensor | float

    def __call__(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def pop_stats(self, device: torch.device, last: int | None = None) -> torch.Tensor: ...

    def record(self, stats: torch.Tensor) -> dict[str, float]: ...

    def from_target(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def pipeline_target(self, batch: dict[str, torch.Tensor], live: torch.Tensor | None) -> torch.Tensor: ...


class KeptStats:
    """A loss's per-call statistics, summed on `pop_stats` (length `len(STATS)` of the subclass)."""

    STATS: tuple[str, ...] = ()

    def __init__(self):
        self._stats: list[torch.Tensor] = []

    def pop_stats(self, device: torch.device, last: int | None = None) -> torch.Tensor:
        """The summed statistics since the last call: of the `last` calls only when given (a pipeline schedule's
        micro-batches of the step)."""
        stats, self._stats = self._stats, []
        if last is not None:
            stats = stats[len(stats) - last:] if last else []
        return torch.stack(stats).sum(0) if stats else torch.zeros(len(self.STATS), device=device)
