"""The progress of a run: the step counter and the tokens trained on (checkpointed as `train_state`)."""

from __future__ import annotations

import torch


class TrainState:
    """`step`: optimizer steps done; `tokens_seen`: target tokens trained on, over all data-parallel
    ranks (kept as a device tensor so adding a step's count needs no host synchronisation)."""

    def __init__(self, device: torch.device):
        self.step = 0
        self._tokens = torch.zeros((), dtype=torch.int64, device=device)

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
                "tokens_seen": torch.tensor(self.tokens_seen, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, int | torch.Tensor]) -> None:
        self.step = int(state["step"])
        self._tokens.fill_(int(state["tokens_seen"]))
