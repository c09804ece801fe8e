"""Writing one checkpoint: its folder, DCP's save (synchronous or in the background), the HF export, the
file hashes, the completion marker, and the purge of older checkpoints.

A save is complete only when every rank's part of it succeeded: after DCP's save each rank hashes its
share of the files (`integrity.py`) and the ranks all-gather what they found, so all of them agree on
the outcome. Rank 0 then writes the marker, last, atomically (`folder.py`), and purges: checkpoints
beyond the newest `keep_latest_k` good ones, where a checkpoint found corrupt (`bad_paths`) or
incomplete never counts, so the newest good one is never deleted because newer ones are bad. A corrupt
one is kept for inspection until a save of its step replaces it.
"""

from __future__ import annotations

import dataclasses
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

from torchtrain.components.checkpoint import folder as fs
from torchtrain.components.checkpoint import integrity
from torchtrain.components.checkpoint.hf import export_dcp_to_hf
from torchtrain.config.checkpoint import CHECKPOINT_KEYS
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


def _outcome(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn's result, None), or (None, the error in one line)."""
    try:
        return fn(), None
    except Exception as e:  # DCP/torch/OS errors of this rank: reported by every rank (agree)
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:1000]}"


class CheckpointSaver:
    def __init__(self, cfg, folder: str, states: dict[str, Any], dims, model, group, async_group, stager):
        self.cfg, self.folder, self.states, self.parallel_dims, self.model = cfg, folder, states, dims, model
        self._pg, self._async_pg, self._stager = group, async_group, stager
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.pending: _Pending | None = None
        self.bad_paths: set[str] = set()
        """Checkpoints of the folder found corrupt (rank 0): never counted as kept, never purged."""

    # ------------------------------------------------------------------ one save
    def save(self, step: int, *, model_only: bool = False, dtype: torch.dtype | None = None, sync: bool = False,
             final: bool = False, hf: bool = False) -> None:
        """Save step `step` (every rank). Synchronous: complete when it returns; else staged, and completed
        by `finish_pending` once written."""
        self.finish_pending()
        path = fs.step_dir(self.folder, step)
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            if os.path.exists(path):
                old, _ = fs.read_marker(path)
                kind = "corrupt" if path in self.bad_paths else "earlier" if old else "incomplete"
                logger.warning("replacing the %s checkpoint %s", kind, path)
                fs.remove_checkpoint(path)
                self.bad_paths.discard(path)
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
            hashed: Future = Future()
            future.add_done_callback(lambda f: hashed.set_result(
                _outcome(lambda: (f.result(), self._hash_share(path))[1])))  # in the writer thread
            self.pending = _Pending(step, path, future, meta, t0, hashed)
            logger.info("checkpoint step-%d staged in %.2fs; writing in the background", step, time.perf_counter() - t0)
            return
        _, problem = _outcome(lambda: dcp.save(state, storage_writer=writer, process_group=self._pg))
        if problem is None and hf:
            _, problem = _outcome(lambda: self._export_hf(path, dtype))
        if hf:
            dist.barrier(group=self._pg)  # rank 0's export is written before any rank lists the files
        files = None
        if problem is None:
            files, problem = _outcome(lambda: self._hash_share(path))
        self._complete(path, meta, t0, files, problem)

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

    def _complete(self, path: str, meta: dict[str, Any], t0: float, hashed, problem: str | None) -> None:
        """Every rank, after its part of the save: agree on the outcome; rank 0 writes the marker with every
        file's hash and purges older checkpoints."""
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, (problem, hashed), group=self._pg)
        failed = [(r, p) for r, (p, _) in enumerate(every) if p]
        if failed:
            rank, problem = failed[0]
            raise RuntimeError(f"[checkpoint] saving step-{meta['step']} to {path} failed on rank {rank}: {problem}")
        if self.rank != 0:
            return
        files = {name: info for files, _ in (h for _, h in every) for name, info in files.items()}
        hash_s = max(s for _, s in (h for _, h in every))
        fs.write_marker(path, {**meta, "hash": integrity.HASH, "files": files})
        size = sum(f["bytes"] for f in files.values())
        logger.info("checkpoint saved: %s (%s) in %.2fs; %d files, %.1f MB, hashed in %.3fs", path,
                    ", ".join(meta["contents"]), time.perf_counter() - t0, len(files), size / 1e6, hash_s)
        for removed in fs.purge(self.folder, self.cfg.keep_latest_k, meta["step"], self.bad_paths):
            logger.info("purged old checkpoint %s (keep_latest_k = %d)", removed, self.cfg.keep_latest_k)
            self.bad_paths.discard(removed)

    # ------------------------------------------------------------------ background saves
    def pending_done(self) -> bool:
        """This rank's background save (if any) is written and hashed (no collective)."""
        return self.pending is not None and self.pending.hashed.done()

    def finish_pending(self) -> None:
        """Every rank, at the same point: wait for the background save and complete it."""
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
