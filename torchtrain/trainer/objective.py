"""The seam between the trainer and what a run optimises beyond next-token cross-entropy.

The trainer builds one `Objective` for a job (`posttrain.build_objective`: plain training gets this base, whose
every part is "nothing") and reads only this surface, so its loop and its step name no objective:

    part                         when the trainer reads it                 plain training
    ---------------------------  ----------------------------------------  ----------------------------------
    loader                       building the data: the objective's own    None: the job's data
                                 (sampled rollouts, say) replaces it
    bind_data(loader)            once the run's data loader is built        -
    loss                         building the train step (`SequenceLoss`)   None: token-mean cross-entropy
    checkpoint_states()          collecting what checkpoints keep           {}
    start(step, ...)             after the checkpoint load, before step 1   -
    record()                     each logged step, after it                 {}

An objective is built from the job, its model and its layout once the process group is up; `posttrain/` holds the
ones the package ships (DPO, GRPO), each in one place with its loss, its data and its reference.
"""

from __future__ import annotations

from typing import Any, Callable

from torchtrain.trainer.sequence_loss import SequenceLoss


class Objective:
    """Plain training (next-token cross-entropy on the job's data); a post-training objective overrides what it
    adds."""

    loader: Any = None
    """A data loader that replaces the job's (None: the job's data)."""
    loss: SequenceLoss | None = None
    """The step's loss over whole sequences (None: token-mean cross-entropy)."""

    def bind_data(self, loader: Any) -> None:
        """The run's data loader, once built (an objective that precomputes something per sample of its dataset sizes
        it here)."""

    def checkpoint_states(self) -> dict[str, Any]:
        """What checkpoints keep of the objective, by top-level key, beside the training state."""
        return {}

    def start(self, step_number: int, step, rows_per_batch: int, heartbeat: Callable[[], None] | None = None) -> None:
        """After the checkpoint load (`step_number`: the step resumed from, 0 for a new run), before the first step;
        `step` is the train step, `heartbeat` tells the hang monitor that long work makes progress."""

    def record(self) -> dict[str, float]:
        """The objective's metrics for the step's log line (every rank calls it: it may reduce across ranks)."""
        return {}

    def close(self, finished: bool) -> None:
        """The run ends (`finished`: every rank completed normally): release what the objective holds apart from the
        trainer (ranks apart, say)."""
