"""Writing one checkpoint: its folder, DCP's save (synchronous or in the background), the HF export, the
file hashes, the completion marker, and the purge of older checkpoints.

A save is complete only when every rank's part of it succeeded: after DCP's save each rank hashes its
share of the files (`integrity.py`) and the ranks all-gather what they found, so all of them agree on
the outcome. Rank 0 then writes the marker, last, atomically (`folder.py`), and purges: checkpoints
beyond the newest `keep_latest_k` good ones, where a checkpoint found corrupt (`bad_paths`) or
incomplete never counts, so the newest good one is never deleted because newer ones are bad. A corrupt
one is kept for inspection until a save of its step replaces it.

A save that fails anywhere (no space left, a read-only folder, an I/O error on one rank, a failed
marker) does not end the run: every rank learns the same outcome, rank 0 removes the partial folder
(or, if even that fails, leaves it without a marker: an incomplete save the next start skips), the
failure is logged and counted in the metrics, and training goes on; the next due save tries again.
After `max_consecutive_save_failures` failures in a row every rank raises `SaveFailed` together and the
run stops with the reason (exit status 5).
"""

from __future__ import annotations

import datetime
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from torchtrain.components.checkpoint import folder as fs
from torchtrain.components.checkpoint import integrity
from torchtrain.components.checkpoint.hf import export_dcp_to_hf
from torchtrain.components.checkpoint.safety import failure_line
from torchtrain.config.checkpoint import CHECKPOINT_KEYS
from torchtrain.models.registry import model_record
from torchtrain.utils import extensions
from torchtrain.utils.logging import logger


@dataclass
class _Pending:
    """A save written in the background; `hashed` is this rank's share of its file hashes, taken by the
    writer thread once the write is done."""

    step: int
    path: str
    future: Future
    meta: dict[str, Any]
    t0: float
    hashed: Future


class SaveFailed(RuntimeError):
    """Raised on every rank together when checkpoint saves failed `max_consecutive_save_failures` times in
    a row; the trainer exits with status 5 (utils/exit_codes.py)."""


def _outcome(fn: Callable[[], Any], rank: int) -> tuple[Any, str | None]:
    """(fn's result, None), or (None, the error in one line naming the rank(s) where it happened: DCP's own
    agreement gives every rank every rank's failure; a torch/OS error of this rank is reported by every
    rank through `_complete`)."""
    try:
        return fn(), None
    except (CheckpointException, Exception) as e:
        return None, failure_line(e, rank)


class CheckpointSaver:
    def __init__(self, cfg, folder: str, states: dict[str, Any], dims, model, group, async_group, stager):
        self.cfg, self.folder, self.states, self.parallel_dims, self.model = cfg, folder, states, dims, model
        self._pg, self._async_pg, self._stager = group, async_group, stager
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.pending: _Pending | None = None
        self.bad_paths: set[str] = set()
        """Checkpoints of the folder found corrupt (rank 0): never counted as kept, never purged."""
        self.failures = 0  # failed saves of this process, and the current run of them (same on every rank)
        self.failures_in_a_row = 0
        self.last_failure: str | None = None  # "step-N: reason" of a failure not yet in the metrics
        self.newest_good: int | None = None  # step of the newest good checkpoint: resumed from, or saved

    # ------------------------------------------------------------------ one save
    def save(self, step: int, *, model_only: bool = False, dtype: torch.dtype | None = None, sync: bool = False,
             final: bool = False, hf: bool = False) -> bool:
        """Save step `step` (every rank). Synchronous: complete when it returns True; else staged, and
        completed by `finish_pending` once written. False: the save failed (`_failed`)."""
        self.finish_pending()
        path = fs.step_dir(self.folder, step)
        problem = None
        if self.rank == 0:
            _, problem = _outcome(lambda: self._prepare(path), 0)
        problem = self._from_rank0(problem)  # also the barrier: the folder is ready before anyone writes
        if problem:
            self._failed(step, path, problem, remove=False)
            return False
        t0 = time.perf_counter()
        keys = ["model"] if model_only else [k for k in CHECKPOINT_KEYS if k in self.states]  # (reference: [dpo])
        model = self.states["model"]
        state: dict[str, Any] = {"model": model.saved_state_dict(dtype)}
        for key in keys[1:]:
            state[key] = self.states[key].state_dict()
        meta = self._meta(step, keys, dtype or torch.float32, final=final, model_only=model_only,
                          adapter_only=model.adapter_only)
        writer = self._writer(path, step)
        if self.cfg.async_mode != "disabled" and not sync:
            kwargs = {"async_stager": self._stager} if self._stager is not None else {}
            future, problem = _outcome(lambda: dcp.async_save(state, storage_writer=writer,
                                                              process_group=self._async_pg, **kwargs), self.rank)
            if problem is not None:
                return self._complete(path, meta, t0, None, problem)
            hashed: Future = Future()
            future.add_done_callback(lambda f: hashed.set_result(
                _outcome(lambda: (f.result(), self._hash_share(path))[1], self.rank)))  # in the writer thread
            self.pending = _Pending(step, path, future, meta, t0, hashed)
            logger.info("checkpoint step-%d staged in %.2fs; writing in the background", step, time.perf_counter() - t0)
            return True
        _, problem = _outcome(lambda: dcp.save(state, storage_writer=writer, process_group=self._pg), self.rank)
        if problem is None and hf:
            _, problem = _outcome(lambda: self._export_hf(path, dtype), self.rank)
        if hf:
            dist.barrier(group=self._pg)  # rank 0's export is written before any rank lists the files
        files = None
        if problem is None:
            files, problem = _outcome(lambda: self._hash_share(path), self.rank)
        return self._complete(path, meta, t0, files, problem)

    def _prepare(self, path: str) -> None:
        """Rank 0, before a save: the folder exists, an older save of the same step is gone."""
        os.makedirs(self.folder, exist_ok=True)
        if os.path.exists(path):
            old, _ = fs.read_marker(path)
            kind = "corrupt" if path in self.bad_paths else "earlier" if old else "incomplete"
            logger.warning("replacing the %s checkpoint %s", kind, path)
            fs.remove_checkpoint(path)
            self.bad_paths.discard(path)

    def _from_rank0(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]

    def _meta(self, step: int, contents: list[str], dtype: torch.dtype, **extra: Any) -> dict[str, Any]:
        train = self.states["train_state"].state_dict()
        return {
            "step": step, "contents": contents, "tokens_seen": int(train.get("tokens_seen", 0)),
            "world_size": self.world_size, "layout": self.parallel_dims.describe(), "dp_degree": self.parallel_dims.dp,
            "model": model_record(self.model.name, self.model.flavor, self.model.args),
            "tokenizer": self.model.tokenizer,
            "dtype": str(dtype).replace("torch.", ""), "torch_version": torch.__version__,
            "saved_at": datetime.datetime.now().isoformat(timespec="seconds"), **extra,
        }

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

    def _hash_share(self, path: str) -> tuple[dict[str, Any], float]:
        """This rank's share of the checkpoint's file hashes, and the seconds they took."""
        t0 = time.perf_counter()
        names = integrity.share(integrity.checkpoint_files(path, fs.MARKER), self.rank, self.world_size)
        return integrity.digests(path, names), time.perf_counter() - t0

    def _complete(self, path: str, meta: dict[str, Any], t0: float, hashed, problem: str | None) -> bool:
        """Every rank, after its part of the save: agree on the outcome; rank 0 writes the marker with every
        file's hash and purges older checkpoints. A failure anywhere is handled by `_failed` on every rank
        (False)."""
        step = meta["step"]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, (problem, hashed), group=self._pg)
        failed = next((p for p, _ in every if p), None)
        files: dict[str, Any] = {}
        if failed is None and self.rank == 0:
            files = {name: info for digest, _ in (h for _, h in every) for name, info in digest.items()}
            _, failed = _outcome(lambda: fs.write_marker(path, {**meta, "hash": integrity.HASH, "files": files}), 0)
        failed = self._from_rank0(failed)
        if failed:
            self._failed(step, path, failed)
            return False
        self.failures_in_a_row, self.newest_good = 0, step
        if self.rank != 0:
            return True
        size = sum(f["bytes"] for f in files.values())
        logger.info("checkpoint saved: %s (%s) in %.2fs; %d files, %.1f MB, hashed in %.3fs", path,
                    ", ".join(meta["contents"]), time.perf_counter() - t0, len(files), size / 1e6,
                    max(s for _, s in (h for _, h in every)))
        try:
            for removed in fs.purge(self.folder, self.cfg.keep_latest_k, step, self.bad_paths):
                logger.info("purged old checkpoint %s (keep_latest_k = %d)", removed, self.cfg.keep_latest_k)
        except OSError as e:  # e.g. the folder became read-only: the checkpoints stay, training goes on
            logger.warning("could not purge old checkpoints of %s: %s", self.folder, e)
        return True

    def _failed(self, step: int, path: str, problem: str, remove: bool = True) -> None:
        """Every rank, the same failed save: remove its partial folder (rank 0; `remove` False: the save
        never began), count it, log it; raise SaveFailed on every rank at the limit."""
        self.failures += 1
        self.failures_in_a_row += 1
        self.last_failure = f"step-{step}: {problem}"
        limit = self.cfg.max_consecutive_save_failures
        newest = f"step-{self.newest_good}" if self.newest_good is not None else "none yet"
        if self.rank == 0:
            left = "removed" if remove else "not touched (the save never began)"
            if remove and os.path.exists(path):
                try:
                    fs.remove_checkpoint(path)
                except OSError as e:
                    left = f"left without a completion marker (removing it failed: {e}), so it is skipped as incomplete"
            then = "stopping" if self.failures_in_a_row >= limit else "training goes on and the next save tries again"
            logger.warning("checkpoint step-%d failed: %s; its partial folder was %s; %s (%d of "
                           "checkpoint.max_consecutive_save_failures = %d in a row; newest good checkpoint: %s)", step,
                           problem, left, then, self.failures_in_a_row, limit, newest)
        if self.failures_in_a_row >= limit:
            raise SaveFailed(f"{self.failures_in_a_row} saves in a row failed (checkpoint.max_consecutive_save_failures "
                             f"= {limit}), the last: {self.last_failure}; newest good checkpoint: {newest}")

    def record(self) -> dict[str, Any]:
        """Metrics of a logged step: the failed saves so far, and the reason of a failure not yet logged."""
        if not self.failures:
            return {}
        out: dict[str, Any] = {"checkpoint_failures": self.failures,
                               "checkpoint_failures_in_a_row": self.failures_in_a_row}
        if self.last_failure is not None:
            out["checkpoint_failure"] = self.last_failure
            self.last_failure = None
        return out

    # ------------------------------------------------------------------ background saves
    def pending_done(self) -> bool:
        """This rank's background save (if any) is written and hashed (no collective)."""
        return self.pending is not None and self.pending.hashed.done()

    def finish_pending(self) -> None:
        """Every rank, at the same point: wait for the background save and complete it (or count its
        failure)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        hashed, problem = pending.hashed.result()
        self._complete(pending.path, pending.meta, pending.t0, hashed, problem)

    def drop_pending(self) -> None:
        """This rank only (training stopped early): let the background write end; no marker is written."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.hashed.result()
            logger.warning("the background save of step-%d was not marked complete: training stopped before it "
                           "was (it is skipped as incomplete)", pending.step)
