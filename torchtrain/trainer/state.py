"""The progress of a run: the step counter, the tokens trained on and the global batch they came in
(checkpointed as `train_state`)."""

from __future__ import annotations

import torch

from torchtrain.components.checkpoint.safety import CheckpointError
from torchtrain.utils.logging import is_log_rank, logger


class TrainState:
    """`step`: optimizer steps done; `tokens_seen`: target tokens trained on, over all data-parallel
    ranks (kept as a device tensor so adding a step's count needs no host synchronisation);
    `global_batch_size`: sequences a step, as the layout resolved it (`set_by_job`: the job's own
    training.global_batch_size, not -1)."""

    def __init__(self, device: torch.device, global_batch_size: int = 0, set_by_job: bool = False):
        self.step = 0
        self._tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.global_batch_size, self._set_by_job = global_batch_size, set_by_job

    @property
    def tokens_seen(self) -> int:
        return int(self._tokens.item())

    @property
    def tokens_on_device(self) -> torch.Tensor:
        """`tokens_seen` as the device tensor (read without waiting for the device)."""
        return self._tokens

    def add_tokens(self, count: torch.Tensor) -> None:
        self._tokens += count

    def state_dict(self) -> dict[str, torch.Tensor]:
        """int64 tensors (stored by checkpoints as tensors, not pickled values)."""
        return {"step": torch.tensor(self.step, dtype=torch.int64),
                "tokens_seen": torch.tensor(self.tokens_seen, dtype=torch.int64),
                "global_batch_size": torch.tensor(self.global_batch_size, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, int | torch.Tensor]) -> None:
        self.step = int(state["step"])
        self._tokens.fill_(int(state["tokens_seen"]))
        saved = int(state.get("global_batch_size") or 0)  # 0: a checkpoint from before it was recorded
        if saved and self.global_batch_size and saved != self.global_batch_size:
            self._batch_changed(saved)

    def _batch_changed(self, saved: int) -> None:
        """A resume on another data-parallel degree keeps the global batch when the job states it (gradient
        accumulation adjusts); a global batch that follows the world size (-1) would change silently: refused."""
        if not self._set_by_job:
            raise CheckpointError(
                f"[training.global_batch_size] the checkpoint was trained with a global batch of {saved} sequences; "
                f"this job's would be {self.global_batch_size} (-1: local_batch_size x the data-parallel degree, "
                f"which changed). Set training.global_batch_size = {saved} to keep it (gradient accumulation "
                f"adjusts), or = {self.global_batch_size} to change it from step {self.step + 1}")
        if is_log_rank():
            logger.warning("the global batch changes from %d to %d sequences at step %d (training.global_batch_size): "
                           "the data continues at its saved position, the learning-rate schedule by step", saved,
                           self.global_batch_size, self.step + 1)
