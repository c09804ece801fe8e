"""CheckpointManager: when to save, what to load at start-up, and the safety rules around both.

Start-up (`load`): rank 0 decides with `startup.plan_start` (resume > initial load > nothing, each
logged), broadcasts the plan, and every rank loads accordingly (`loading.py`: every load first checks
the checkpoint against what it loads into, and all ranks agree on an error before raising it, so a
bad checkpoint stops every rank with one message instead of leaving some waiting).

Saving (`after_step`): every `interval` steps, at the last step, and when ranks agree on a preemption
signal. Each save goes to `step-N` and is marked complete last (`folder.py`); older checkpoints are
purged only after that. With `async_mode`, the state is staged to CPU and written by a background
thread over a dedicated gloo group, at most one save in flight; the marker of an async save is
written at the first step boundary after it finished.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from torchtrain.components.checkpoint import folder as fs
from torchtrain.components.checkpoint.hf import export_dcp_to_hf
from torchtrain.components.checkpoint.loading import CheckpointLoader, ModelInfo
from torchtrain.components.checkpoint.preemption import DeferredSignals, PreemptionWatcher
from torchtrain.components.checkpoint.startup import StartPlan, plan_start
from torchtrain.components.checkpoint.state import Stateful
from torchtrain.components.checkpoint.validate import CheckpointError
from torchtrain.config.checkpoint import CHECKPOINT_KEYS
from torchtrain.config.checkpoint import Checkpoint as CheckpointConfig
from torchtrain.config.fields import ConfigError
from torchtrain.distributed.layout import DTYPES
from torchtrain.utils import extensions
from torchtrain.utils.logging import logger


@dataclass
class _Pending:
    step: int
    path: str
    future: Future
    meta: dict[str, Any]
    t0: float


class CheckpointManager:
    """`states` maps the checkpoint's top-level keys (config/checkpoint.py CHECKPOINT_KEYS) to the live
    Stateful objects (`state.training_states` builds them); `dims` is the layout's ParallelDims."""

    def __init__(self, cfg: CheckpointConfig, dump_folder: str, total_steps: int, timeout_seconds: int,
                 dims, states: dict[str, Stateful], model: ModelInfo):
        self.cfg = cfg
        self.enabled = cfg.enable
        self._pending: _Pending | None = None
        self.preemption: PreemptionWatcher | None = None
        if not self.enabled:
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

    # ------------------------------------------------------------------ start-up
    def load(self) -> None:
        """Resume, or initial load, or nothing (see the module docstring); every rank calls it."""
        if not self.enabled:
            return
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = plan_start(self.cfg, self.folder, self.total_steps)
            except ConfigError as e:
                box[0] = str(e)
        dist.broadcast_object_list(box, src=0, group=self._pg)
        plan: StartPlan | str = box[0]
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
                skipped = [k for k in CHECKPOINT_KEYS if k not in plan.keys]
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
    def _meta(self, step: int, contents: list[str], dtype: torch.dtype, **extra: Any) -> dict[str, Any]:
        train = self.states["train_state"].state_dict()
        return {
            "step": step, "contents": contents, "tokens_seen": int(train.get("tokens_seen", 0)),
            "world_size": self.world_size, "layout": self.parallel_dims.describe(), "dp_degree": self.parallel_dims.dp,
            "model": {"name": self.model.name, "flavor": self.model.flavor,
                      "args": dataclasses.asdict(self.model.args)},
            "dtype": str(dtype).replace("torch.", ""), "torch_version": torch.__version__,
            "saved_at": datetime.datetime.now().isoformat(timespec="seconds"), **extra,
        }

    def save(self, step: int, *, model_only: bool = False, dtype: torch.dtype | None = None, sync: bool = False,
             final: bool = False, hf: bool = False) -> None:
        """Save step `step`; no signal interrupts it (a signal that arrives meanwhile is honoured after it)."""
        with DeferredSignals(f"the checkpoint save of step-{step}"):
            self._save(step, model_only=model_only, dtype=dtype, sync=sync, final=final, hf=hf)

    def _save(self, step: int, *, model_only: bool, dtype: torch.dtype | None, sync: bool, final: bool,
              hf: bool) -> None:
        self._wait_pending()
        path = fs.step_dir(self.folder, step)
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            if os.path.exists(path):
                old, _ = fs.read_marker(path)
                logger.warning("replacing the %s checkpoint %s", "earlier" if old else "incomplete", path)
                fs.remove_checkpoint(path)
        dist.barrier(group=self._pg)
        t0 = time.perf_counter()
        keys = ["model"] if model_only else list(CHECKPOINT_KEYS)
        model = self.states["model"]
        state: dict[str, Any] = {"model": model.saved_state_dict(dtype)}
        for key in keys[1:]:
            state[key] = self.states[key].state_dict()
        meta = self._meta(step, keys, dtype or torch.float32, final=final, model_only=model_only,
                          adapter_only=bool(getattr(model, "adapter_only", False)))
        writer = self._writer(path, step)
        if self.cfg.async_mode != "disabled" and not sync:
            kwargs = {"async_stager": self._stager} if self._stager is not None else {}
            future = dcp.async_save(state, storage_writer=writer, process_group=self._async_pg, **kwargs)
            self._pending = _Pending(step, path, future, meta, t0)
            logger.info("checkpoint step-%d staged in %.2fs; writing in the background", step, time.perf_counter() - t0)
            return
        self.loader.collective_try(lambda: dcp.save(state, storage_writer=writer, process_group=self._pg),
                             f"saving step-{step} to {path} failed", RuntimeError)
        if hf:
            self.loader.collective_try(lambda: self._export_hf(path, dtype), f"HF export of step-{step} failed",
                                 RuntimeError)
        self._complete(path, meta, t0)

    def _writer(self, path: str, step: int) -> FileSystemWriter:
        """The save's DCP writer: a plugin's (utils/extensions.py "storage_writer"), else the file system's."""
        writers = [w for w in extensions.call("storage_writer", path=path, step=step, rank=self.rank) if w is not None]
        return writers[0] if writers else FileSystemWriter(path)

    def _export_hf(self, path: str, dtype: torch.dtype | None) -> None:
        if self.rank != 0:
            return
        adapter = self.model.adapter(self.model.args)
        out = os.path.join(path, "hf")
        summary = export_dcp_to_hf(path, out, adapter, dtype, self.cfg.hf_max_shard_bytes, os.path.basename(path))
        logger.info("Hugging Face export: %s (%d safetensors files, %.1f MB)", out, summary["files"],
                    summary["bytes"] / 1e6)

    def _complete(self, path: str, meta: dict[str, Any], t0: float) -> None:
        """Every rank's files are written: rank 0 marks the checkpoint complete, then purges."""
        if self.rank != 0:
            return
        fs.write_marker(path, meta)
        logger.info("checkpoint saved: %s (%s) in %.2fs", path, ", ".join(meta["contents"]), time.perf_counter() - t0)
        for removed in fs.purge(self.folder, self.cfg.keep_latest_k, meta["step"]):
            logger.info("purged old checkpoint %s (keep_latest_k = %d)", removed, self.cfg.keep_latest_k)

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except Exception as e:
            raise RuntimeError(f"[checkpoint] background save of step-{pending.step} to {pending.path} failed: "
                               f"{type(e).__name__}: {e}") from e
        self._complete(pending.path, pending.meta, pending.t0)

    # ------------------------------------------------------------------ the training loop's hooks
    def after_step(self, step: int, may_save: bool = True) -> bool:
        """Save if due (interval, last step, agreed preemption). True: stop training now (preempted).
        `may_save` False: this job does not write (a replica group other than the saving one under
        fault.replica_ft); preemption still stops it."""
        if not self.enabled:
            return False
        if self._pending is not None and self._pending.future.done():
            self._wait_pending()
        preempt = False
        if self.preemption is not None:
            extensions.call("preemption_check", step=step, rank=self.rank, dump_folder=self.dump_folder,
                            requested=lambda: self.preemption.requested)  # plugins (utils/extensions.py)
            if self.preemption.received:
                logger.warning("rank %d received %s: a checkpoint will be saved and training stopped", self.rank,
                               ", ".join(self.preemption.received))
                self.preemption.received.clear()
            preempt = self.preemption.agreed(self._pg)
        cfg = self.cfg
        if not may_save:
            if preempt:
                logger.info("preemption: stopping after step %d (another replica group writes the checkpoints)", step)
            return preempt
        if step >= self.total_steps:
            model_only = cfg.last_save_model_only
            self.save(step, model_only=model_only, dtype=DTYPES[cfg.export_dtype] if model_only else None,
                      sync=True, final=True, hf=cfg.last_save_in_hf)
        elif preempt:
            logger.info("preemption: all ranks stop after step %d; saving a checkpoint first", step)
            self.save(step, sync=True)
        elif step % cfg.interval == 0:
            self.save(step)
        if preempt:
            logger.info("preemption: checkpoint step-%d saved, exiting (resume by relaunching the same job)", step)
        return preempt

    def restore_latest(self, exclude: tuple[str, ...] = ()) -> int | None:
        """Load the newest complete full-state checkpoint of the folder into the live training state,
        leaving the `exclude`d parts as they are (the guard's rollback keeps the data position). Every
        rank calls it; returns the checkpoint's step, or None when the folder holds none yet."""
        if not self.enabled:
            return None
        self._wait_pending()
        box: list[Any] = [None]
        if self.rank == 0:
            found = [c for c in fs.scan(self.folder) if c.complete and c.full_state]
            box[0] = (found[-1].path, found[-1].step, found[-1].meta) if found else None
        dist.broadcast_object_list(box, src=0, group=self._pg)
        if box[0] is None:
            return None
        path, step, meta = box[0]
        keys = tuple(k for k in CHECKPOINT_KEYS if k in meta.get("contents", ()) and k not in exclude)
        t0 = time.perf_counter()
        self.loader.load_dcp(path, keys, f"step-{step}", meta)
        logger.info("restored %s (%s) in %.1fs", path, ", ".join(keys), time.perf_counter() - t0)
        return step

    def maybe_create_seed(self) -> bool:
        """With create_seed_checkpoint: write the current weights as step-0 and return True (no training)."""
        if not (self.enabled and self.cfg.create_seed_checkpoint):
            return False
        self.save(0, model_only=True, sync=True)
        logger.info("seed checkpoint written to %s; exiting without training", fs.step_dir(self.folder, 0))
        return True

    def close(self) -> None:
        if not self.enabled:
            return
        try:
            self._wait_pending()
        except RuntimeError as e:  # only reachable when training stopped early on another error
            logger.error("%s", e)
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
