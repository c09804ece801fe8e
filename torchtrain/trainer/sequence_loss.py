"""What the train step asks of a loss that reads the whole batch rather than its labels alone -- the loss a
post-training objective hands the trainer (`trainer/objective.py`; e.g. `posttrain/preference_loss.py` over chosen /
rejected pairs, `posttrain/policy_loss.py` over sampled completions).

The step sets `scale` = R / U before the micro-batches run -- R the ranks holding different samples, U the global
number of `units` the loss is a mean over: the step's target tokens ("tokens", the count the step takes anyway)
or what `count` counts in each micro-batch, all-reduced -- so that data-parallel gradient averaging gives the
gradient of the global mean under any layout (trainer/step.py). The loss keeps its per-step statistics until
`pop_stats`; `record` names them for the log. Under pipeline parallelism the schedule hands the loss one target
tensor per micro-batch: `pipeline_target` packs what it reads, `from_target` unpacks it.

Two hooks let a loss bring what it reads beside the model's logits: `before_shard` sees each whole batch before
context parallelism cuts its sequences, `prepare` each (sharded, on-device) micro-batch right before its forward (a
loss that scores it with another model first: DPO's live reference). `SequenceLossBase` leaves both unchanged.
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

    def pipeline_target(self, step, batch: dict[str, torch.Tensor], rows: int) -> torch.Tensor: ...

    def before_shard(self, batch: dict[str, torch.Tensor], pipelined: bool) -> dict[str, torch.Tensor]: ...

    def prepare(self, step, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


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


class SequenceLossBase(KeptStats):
    """A sequence loss's hooks left alone (module doc): the batch reaches the loss as the data made it."""

    def before_shard(self, batch: dict[str, torch.Tensor], pipelined: bool) -> dict[str, torch.Tensor]:
        return batch

    def prepare(self, step, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return batch
