"""Training guard: catch bad steps before they reach the weights ([guard], docs/guard.md).

A step is *bad* when, after backward and gradient clipping but before the optimizer step,

* its global loss or global gradient norm is not finite (NaN/inf), or
* its loss is a spike: with mean m and standard deviation s (population) of the losses of the last
  W good steps (W = spike_window, tested once W losses are known),  (loss - m) / max(s, 1e-6 |m|) > z
  (z = spike_zscore; upward spikes only: a sudden drop is not a failure).

Both inputs are global values that every rank already holds identically (the loss is all-reduced,
the norm is the clipping norm over the whole mesh); still, each rank classifies the step itself and
the ranks agree with one all-reduce (MAX) of the verdict code, so they always take the same
branch. With float16 loss scaling, non-finite gradients are the scaler's business (it skips the
step and lowers the scale); the guard then watches the loss only, and a step it skips still updates
the scaler's bookkeeping.

The policy decides what a bad step does (`skip`, `rollback`, `abort`: see the [guard] keys); this
module decides and counts, the trainer acts. Cost when enabled: one device-to-host copy of two
scalars and one all-reduce of one integer per step; nothing when `policy = "off"`.

The rolling window lives in memory only: after a restart (resume) spike detection resumes once W
new losses are known. A rollback keeps the window.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist

from torchtrain.config.operations import Guard
from torchtrain.utils.logging import is_log_rank, logger

OK, SPIKE, NONFINITE = 0, 1, 2


class GuardAbort(RuntimeError):
    """Raised on every rank when the guard gives up (policy "abort"); the trainer exits with code 3."""


class TrainingGuard:
    def __init__(self, cfg: Guard, inject_nan_steps: list[int], check_grad_norm: bool, device: torch.device):
        self.cfg, self.device = cfg, device
        self.enabled = cfg.policy != "off"
        self.check_grad_norm = check_grad_norm
        self.window: deque[float] = deque(maxlen=cfg.spike_window)
        self.consecutive: list[tuple[int, str]] = []  # the current run of bad steps: (step, reason)
        self.bad_steps = 0
        self.last: tuple[str, str] | None = None  # (action, reason) of the latest step, None if good
        self._inject = set(inject_nan_steps)
        self._replayed: set[int] = set()  # steps rolled back with their data replayed (rollback_replay)

    # ------------------------------------------------------------------ fault injection (tests)
    def inject_nan(self, step: int) -> bool:
        """debug.inject_nonfinite_loss_steps: True the first time a listed step runs."""
        if step not in self._inject:
            return False
        self._inject.discard(step)
        if is_log_rank():  # every rank does the same: say it once
            logger.warning("step %d: the loss is multiplied by NaN on every rank (debug.inject_nonfinite_loss_steps)", step)
        return True

    # ------------------------------------------------------------------ the decision
    def classify(self, loss: float, grad_norm: float) -> tuple[int, str]:
        """This rank's verdict on a step: (code, reason)."""
        if not math.isfinite(loss):
            return NONFINITE, f"non-finite loss ({loss})"
        if self.check_grad_norm and not math.isfinite(grad_norm):
            return NONFINITE, f"non-finite gradient norm ({grad_norm})"
        if self.cfg.spike_zscore is not None and len(self.window) == self.window.maxlen:
            n = len(self.window)
            mean = sum(self.window) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in self.window) / n)
            z = (loss - mean) / max(std, 1e-6 * abs(mean), 1e-12)
            if z > self.cfg.spike_zscore:
                return SPIKE, (f"loss spike ({loss:.4f} is {z:.1f} standard deviations above the mean {mean:.4f} of "
                               f"the last {n} steps; guard.spike_zscore = {self.cfg.spike_zscore:g})")
        return OK, ""

    def _agree(self, code: int) -> int:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return code
        flag = torch.tensor([code], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> str | None:
        """Before the optimizer step, on every rank: None (a good step) or the action to take:
        "skip", "rollback" or "abort" (identical on all ranks)."""
        self.last = None
        if not self.enabled:
            return None
        loss_v, norm_v = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(())]
                                     ).tolist()
        code, reason = self.classify(loss_v, norm_v)
        agreed = self._agree(code)
        if agreed == OK:
            self.window.append(loss_v)
            self.consecutive.clear()
            return None
        if agreed != code:  # another rank saw something this one did not (never expected: the inputs are global)
            reason = f"flagged by another rank ({'non-finite value' if agreed == NONFINITE else 'loss spike'})"
        self.bad_steps += 1
        self.consecutive.append((step, reason))
        action = self.cfg.policy
        if action == "abort" and len(self.consecutive) < self.cfg.max_consecutive_bad_steps:
            action = "skip"
        self.last = (action, reason)
        verb = {"skip": "the optimizer step is skipped", "rollback": "rolling back to the newest checkpoint",
                "abort": "aborting"}[action]
        if is_log_rank():
            logger.warning("guard: step %d is bad: %s; %s (%d bad steps so far, %d in a row)", step, reason, verb,
                           self.bad_steps, len(self.consecutive))
        return action

    def replay(self, step: int) -> bool:
        """For a rollback from bad step `step`: whether to train the same data again (rollback_replay, the
        first time this step is bad) rather than skip it."""
        if not self.cfg.rollback_replay or step in self._replayed:
            return False
        self._replayed.add(step)
        return True

    def abort_message(self) -> str:
        steps = "; ".join(f"step {s}: {r}" for s, r in self.consecutive)
        return (f"training stopped after {len(self.consecutive)} consecutive bad step(s) "
                f"(guard.max_consecutive_bad_steps = {self.cfg.max_consecutive_bad_steps}): {steps}. No checkpoint was "
                f"written for them; resume from the newest checkpoint, e.g. with a lower optimizer.lr")

    def record(self) -> dict[str, object]:
        """Metrics fields for the latest step (empty when the guard is off)."""
        if not self.enabled:
            return {}
        out: dict[str, object] = {"guard_bad_steps": self.bad_steps}
        if self.last is not None:
            out.update(guard_action=self.last[0], guard_reason=self.last[1], step_skipped=True)
        return out
