"""CheckpointManager: when to save, what to load at start-up, and the safety rules around both.

Start-up (`load`): rank 0 decides with `startup.plan_start` (resume > initial load > nothing, each
logged), broadcasts the plan, and every rank loads accordingly (`loading.py`: every load first checks
the checkpoint against what it loads into, and all ranks agree on an error before raising it, so a
bad checkpoint stops every rank with one message instead of leaving some waiting). Before a checkpoint
is chosen its files are checked against the hashes written with it, by all ranks together while rank 0
decides (`_decide`, `integrity.py`): a corrupt one is named in one line and the next older one is taken.

Saving (`after_step`): every `interval` steps, at the last step, and when ranks agree on a preemption
signal; the save itself is `saver.py` (hashes, the completion marker, the purge). No signal interrupts
a save (`preemption.DeferredSignals`). With `async_mode`, the state is staged to CPU and written by a
background thread over a dedicated gloo group, at most one save in flight; it is completed (hashes,
marker) at the first step boundary at which every rank's write has finished.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchtrain.components.checkpoint import folder as fs
from torchtrain.components.checkpoint.loading import CheckpointLoader, ModelInfo
from torchtrain.components.checkpoint.preemption import DeferredSignals, PreemptionWatcher
from torchtrain.components.checkpoint.saver import CheckpointSaver
from torchtrain.components.checkpoint.startup import StartPlan, plan_start
from torchtrain.components.checkpoint.state import Stateful
from torchtrain.components.checkpoint.validate import CheckpointError
from torchtrain.config.checkpoint import CHECKPOINT_KEYS
from torchtrain.config.checkpoint import Checkpoint as CheckpointConfig
from torchtrain.config.fields import ConfigError
from torchtrain.distributed.layout import DTYPES
from torchtrain.utils import extensions
from torchtrain.utils.logging import logger

RETRY_PAUSE_S = 2.0  # between the attempts of a save that cannot wait for the next interval


class CheckpointManager:
    """`states` maps the checkpoint's top-level keys (config/checkpoint.py CHECKPOINT_KEYS) to the live
    Stateful objects (`state.training_states` builds them); `dims` is the layout's ParallelDims."""

    def __init__(self, cfg: CheckpointConfig, dump_folder: str, total_steps: int, timeout_seconds: int,
                 dims, states: dict[str, Stateful], model: ModelInfo):
        self.cfg = cfg
        self.enabled = cfg.enable
        self.preemption: PreemptionWatcher | None = None
        self.loader: CheckpointLoader | None = None
        if not self.enabled:
            if model.weights:  # no checkpoints, but the model's own weights to load at start-up
                self._pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
                self.loader = CheckpointLoader(dict(states), dims, model, self._pg)
            return
        self.parallel_dims, self.model, self.dump_folder = dims, model, dump_folder
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.folder = os.path.join(dump_folder, cfg.folder)
        self.total_steps = total_steps
        self.states: dict[str, Any] = dict(states)
        # Own gloo groups: checkpoint collectives never interleave with training collectives, use the
        # start-up timeout (saves can be slow), and the background writer has a group of its own.
        timeout = datetime.timedelta(seconds=timeout_seconds)
        self._pg = dist.new_group(backend="gloo", timeout=timeout)
        self._async_pg = dist.new_group(backend="gloo", timeout=timeout) if cfg.async_mode != "disabled" else None
        self._stager = None
        if cfg.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Reused pinned CPU buffers; staging is synchronous (training resumes once the copy is done).
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=True))
        if cfg.preemption_signals:
            self.preemption = PreemptionWatcher(cfg.preemption_signals)
        self.loader = CheckpointLoader(self.states, dims, model, self._pg)
        self.saver = CheckpointSaver(cfg, self.folder, self.states, dims, model, self._pg, self._async_pg,
                                     self._stager)

    # ------------------------------------------------------------------ start-up
    def _broadcast(self, message: Any) -> Any:
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]

    def _decide(self, decide: Callable[[Callable[[fs.CheckpointInfo], str | None]], Any]) -> Any:
        """Every rank: rank 0 runs `decide(verify)` and its result is returned everywhere (a ConfigError
        becomes its message). `verify(checkpoint)` checks the checkpoint's files against their hashes with
        every rank's help: the others serve those checks until rank 0's decision arrives."""
        if self.rank != 0:
            while True:
                kind, payload = self._broadcast(None)
                if kind == "decided":
                    return payload
                self.loader.verify_files(*payload)
        try:
            result = decide(self._verify)
        except ConfigError as e:
            result = str(e)
        return self._broadcast(("decided", result))[1]

    def _verify(self, c: fs.CheckpointInfo) -> str | None:
        """Rank 0 (inside `_decide`): whether checkpoint `c` still holds the files written with it; the
        problem in one line, or None. A checkpoint without hashes (an older torchtrain's) passes, logged."""
        files = c.meta.get("files")
        if not self.cfg.verify_on_load:
            return None
        if not files:
            logger.info("checkpoint %s has no file hashes (written before torchtrain hashed its files): loaded "
                        "without verifying them", c.path)
            return None
        t0 = time.perf_counter()
        self._broadcast(("verify", (c.path, files)))
        problem = self.loader.verify_files(c.path, files)
        if problem is None:
            logger.info("checkpoint %s: %d files (%.1f MB) match their %s hashes (verified in %.2fs)", c.path,
                        len(files), sum(f["bytes"] for f in files.values()) / 1e6, c.meta.get("hash", "?"),
                        time.perf_counter() - t0)
        elif os.path.dirname(c.path) == self.folder:
            self.saver.bad_paths.add(c.path)
        return problem

    def load(self) -> None:
        """Resume, or initial load, or nothing (see the module docstring); every rank calls it."""
        if not self.enabled:
            if self.loader is not None:  # the model's own weights (ModelInfo.weights), then no more loading
                self.loader.load_hf(self.loader.model.weights)
                dist.destroy_process_group(self._pg)
                self._pg = self.loader = None
            return
        plan: StartPlan | str = self._decide(lambda verify: plan_start(self.cfg, self.folder, self.total_steps,
                                                                        verify, self.model.weights))
        if isinstance(plan, str):
            raise CheckpointError(plan)
        t0 = time.perf_counter()
        if plan.kind == "finished":
            self.states["train_state"].load_state_dict(
                {"step": plan.step, "tokens_seen": plan.meta.get("tokens_seen", 0)})
        elif plan.kind == "initial_hf":
            self.loader.load_hf(plan.path)
        elif plan.kind in ("resume", "initial_dcp"):
            if plan.base is not None:  # an adapter-only checkpoint: its base weights first
                self._load_base(plan.base)
            label = f"step-{plan.step}" if plan.kind == "resume" else "checkpoint.initial_load_path"
            self.loader.load_dcp(plan.path, plan.keys, label, plan.meta,
                                 trusted=plan.kind == "initial_dcp" and self.cfg.trust_initial_load)
            if plan.kind == "initial_dcp":
                logger.info("initial load done in %.1fs: %s from %s", time.perf_counter() - t0,
                            ", ".join(plan.keys), plan.path)
            else:
                self.saver.newest_good = plan.step
                skipped = [k for k in CHECKPOINT_KEYS if k not in plan.keys and k in self.states]
                logger.info("resumed from %s in %.1fs: restored %s%s; training continues at step %d", plan.path,
                            time.perf_counter() - t0, ", ".join(plan.keys),
                            f"; start fresh: {', '.join(skipped)}" if skipped else "", plan.step + 1)

    def _load_base(self, base: StartPlan) -> None:
        if base.kind == "initial_hf":
            self.loader.load_hf(base.path)
        else:
            self.loader.load_dcp(base.path, ("model",), "checkpoint.initial_load_path", base.meta,
                                 trusted=self.cfg.trust_initial_load)
        logger.info("base weights of the adapter-only checkpoint loaded from %s", base.path)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, *, model_only: bool = False, dtype: torch.dtype | None = None, sync: bool = False,
             final: bool = False, hf: bool = False) -> bool:
        """Save step `step` (every rank); no signal interrupts it (one that arrives is honoured after it).
        False: it failed (saver.py); training may go on."""
        with DeferredSignals(f"the checkpoint save of step-{step}"):
            return self.saver.save(step, model_only=model_only, dtype=dtype, sync=sync, final=final, hf=hf)

    def _save_at_once(self, step: int, **kwargs: Any) -> None:
        """A save with no later interval to retry at (the last step's, a preemption's): retried after a
        pause until it succeeds or the failures reach checkpoint.max_consecutive_save_failures (SaveFailed)."""
        while not self.save(step, sync=True, **kwargs):
            time.sleep(RETRY_PAUSE_S)

    def record(self) -> dict[str, Any]:
        """Metrics fields of a logged step (failed saves, once there was one)."""
        return self.saver.record() if self.enabled else {}

    @property
    def unreported_failure(self) -> bool:
        """A failed save whose reason is not in the metrics yet (the trainer logs the next step for it)."""
        return self.enabled and self.saver.last_failure is not None

    def _agree(self, step: int) -> tuple[bool, bool]:
        """(preempt, background save written) -- the same on every rank: one all-reduce when a preemption
        signal can arrive or a save is written in the background, else none."""
        preempt = None
        if self.preemption is not None:
            extensions.call("preemption_check", step=step, rank=self.rank, dump_folder=self.dump_folder,
                            requested=lambda: self.preemption.requested)  # plugins (utils/extensions.py)
            if self.preemption.received:
                logger.warning("rank %d received %s: a checkpoint will be saved and training stopped", self.rank,
                               ", ".join(self.preemption.received))
                self.preemption.received.clear()
            preempt = self.preemption.requested
        pending = self.saver.pending is not None
        if preempt is None and not pending:
            return False, False
        flags = torch.tensor([int(bool(preempt)), int(pending and not self.saver.pending_done())], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._pg)
        return bool(flags[0]), pending and not flags[1]

    # ------------------------------------------------------------------ the training loop's hooks
    def saves_at(self, step: int) -> bool:
        """A save is due after `step` by the schedule (the interval or the last step; a preemption's is not known
        before `after_step`)."""
        return self.enabled and (step >= self.total_steps or step % self.cfg.interval == 0)

    def after_step(self, step: int, may_save: bool = True) -> bool:
        """Save if due (interval, last step, agreed preemption). True: stop training now (preempted).
        `may_save` False: this job does not write (a replica group other than the saving one under
        fault.replica_ft); preemption still stops it."""
        if not self.enabled:
            return False
        preempt, written = self._agree(step)
        if written:
            with DeferredSignals(f"the completion of the background save of step-{self.saver.pending.step}"):
                self.saver.finish_pending()
        cfg = self.cfg
        if not may_save:
            if preempt:
                logger.info("preemption: stopping after step %d (another replica group writes the checkpoints)", step)
            return preempt
        if step >= self.total_steps:
            model_only = cfg.last_save_model_only
            self._save_at_once(step, model_only=model_only, dtype=DTYPES[cfg.export_dtype] if model_only else None,
                               final=True, hf=cfg.last_save_in_hf)
        elif preempt:
            logger.info("preemption: all ranks stop after step %d; saving a checkpoint first", step)
            self._save_at_once(step)
        elif step % cfg.interval == 0:
            self.save(step)
        if preempt:
            logger.info("preemption: checkpoint step-%d saved, exiting (resume by relaunching the same job)", step)
        return preempt

    def restore_latest(self, exclude: tuple[str, ...] = ()) -> int | None:
        """Load the newest good full-state checkpoint of the folder into the live training state, leaving
        the `exclude`d parts as they are (the guard's rollback keeps the data position). Every rank calls
        it; returns the checkpoint's step, or None when the folder holds none yet."""
        if not self.enabled:
            return None
        self.saver.finish_pending()

        def newest_good(verify) -> tuple[str, int, dict] | None:
            for c in reversed([c for c in fs.scan(self.folder) if c.complete and c.full_state]):
                problem = verify(c)
                if problem is None:
                    return c.path, c.step, c.meta
                logger.warning("checkpoint %s is corrupt: %s; skipped", c.path, problem)
            return None

        found = self._decide(newest_good)
        if found is None:
            return None
        path, step, meta = found
        keys = tuple(k for k in CHECKPOINT_KEYS if k in meta.get("contents", ()) and k not in exclude)
        t0 = time.perf_counter()
        self.loader.load_dcp(path, keys, f"step-{step}", meta)
        logger.info("restored %s (%s) in %.1fs", path, ", ".join(keys), time.perf_counter() - t0)
        return step

    def maybe_create_seed(self) -> bool:
        """With create_seed_checkpoint: write the current weights as step-0 and return True (no training)."""
        if not (self.enabled and self.cfg.create_seed_checkpoint):
            return False
        self._save_at_once(0, model_only=True)
        logger.info("seed checkpoint written to %s; exiting without training", fs.step_dir(self.folder, 0))
        return True

    def close(self) -> None:
        if not self.enabled:
            return
        self.saver.drop_pending()  # only when training stopped early: a finished run has none in flight
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self.preemption is not None:
            self.preemption.restore()
        # Destroy our groups here, in the main thread and before the default group, rather than
        # leaving them to interpreter shutdown (a gloo group used by the background writer thread
        # could otherwise be torn down while its threads are still joinable).
        for group in (self._async_pg, self._pg):
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        self._pg = self._async_pg = None
        self.enabled = False
