"""Rollouts sampled one policy version ahead (`grpo.max_staleness = 1`): the next iteration's completions are
sampled in the background while the trainer trains on this iteration's.

    iteration i:  rows_i = the completions sampled in the background during iteration i - 1 (iteration 0: sampled
                  now, by the initial weights); the sampling copy takes the weights after i iterations (a collective:
                  on the main thread, nothing sampling); iteration i + 1's prompts start sampling in the background
                  with them; the trainer trains on rows_i.

So the rows of iteration i >= 1 come from the policy of one iteration earlier (their lag, `grpo/staleness`, is 1;
iteration 0's is 0), and sampling overlaps the optimizer steps. The lag is corrected by decoupled PPO (Hilton et al.,
2021, as AReaL does): the ratio is clipped against the proximal policy -- the trainer's own log-probs of the rows at
the start of the iteration (`grpo.old_logps = "trainer"`) -- and each token's term is weighted by the behaviour
correction min(exp(proximal - sampler), grpo.importance_sampling_cap) (`policy_loss.py`), which keeps the
update's trust region where the current policy is, whatever the sampler was.

Only the sampling copy (`grpo.generator = "copy"`) samples in the background: it holds its own weights and runs
no collective. The background thread runs the sampling and the reward functions of one round (no dynamic sampling,
no reward model, no environment: those run collectives); a failure there surfaces on the main thread when the
rows are taken. A checkpoint waits for the background rows and keeps them (with the version that sampled them), so
a resumed run trains on the very rows the uninterrupted one would.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class Job:
    """One background call of `fn(*args)` on a daemon thread (an unfinished one never holds the process at exit)."""

    def __init__(self, fn: Callable[..., Any], *args: Any):
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="grpo-sampler", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._result = fn(*args)
        except BaseException as e:  # noqa: BLE001 -- re-raised on the main thread by `result`
            self._error = e

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class Ahead:
    """The rows being sampled for the next iteration (`pending`: a `Job`, or the groups a checkpoint restored) and the
    policy version that samples them."""

    def __init__(self):
        self.pending: Job | tuple | None = None
        self.version = 0

    def take(self, loader) -> tuple[tuple, tuple[float, int], int]:
        """This iteration's (groups, sampling seconds, reward errors, fatal message), the sync's (seconds, bytes), and
        the rows' lag in policy versions; the next iteration's sampling started in the background."""
        now = loader.iterations
        if self.pending is None:  # nothing sampled ahead: the first iteration (or a checkpoint from before it)
            sync = loader.generator.sync_weights()
            result, version = loader.sample_prompts(loader.next_prompts()), now
        else:
            result = self.pending.result() if isinstance(self.pending, Job) else self.pending
            version = self.version
            sync = loader.generator.sync_weights()
        self.pending, self.version = Job(loader.sample_prompts, loader.next_prompts()), now
        return result, sync, now - version

    def state(self) -> dict[str, Any] | None:
        """The background rows, waited for (a checkpoint keeps them), and their version."""
        if self.pending is None:
            return None
        if isinstance(self.pending, Job):
            self.pending = self.pending.result()
        groups, seconds, errors, fatal = self.pending
        return {"groups": [list(group) for group in groups], "seconds": seconds, "errors": errors, "fatal": fatal,
                "version": self.version}

    def load(self, state: dict[str, Any] | None, group_cls) -> None:
        if state is None:
            self.pending = None
            return
        groups = [group_cls(*fields) for fields in state["groups"]]
        self.pending = (groups, state["seconds"], state["errors"], state["fatal"])
        self.version = int(state["version"])

