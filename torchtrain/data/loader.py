"""The loader: this data-parallel rank's batches, in order, with a state that is one global counter.

Rank r of dp, with local batch b, reads its k-th batch (counting from the global sample counter c at
which iteration started) as the global samples

    c + (k b + j) dp + r        for j = 0 .. b-1,

so one micro-batch over all ranks is exactly the global samples [c + k b dp, c + (k+1) b dp): the
batch a single process would read with a dp times larger batch, and every layout trains on
identical data. The state is c after the batches handed out so far: the same on every rank, exact
under any number of background workers (prefetched batches are simply read again after a resume),
and valid for another data-parallel degree, since a step always consumes the same global samples.

Background loading uses torchdata's StatefulDataLoader (a drop-in torch DataLoader) over the
map-style `WindowDataset`, fetching whole batches at once; pinned memory on CUDA. Its workers are forked from the
rank (`WORKER_START`) and close the rank's network connections (`_close_inherited_connections`).
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import warnings
from typing import Any, Iterator

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtrain.data.dataset import WindowDataset
from torchtrain.utils.logging import logger

WORKER_START = "fork" if sys.platform.startswith("linux") else None
"""How the background workers start: on Linux forked from the rank, whose death each then sees (its parent's) and
ends with. Under multiprocessing's default here, the forkserver the rank inherits from the launcher, a worker is the
child of a server that lives as long as any worker holds its pipe: a rank killed (OOM, kill -9) left both behind for
good, holding the launch's output open, so a launch piped to `tee` never ended. Elsewhere: the platform's default."""


def _close_inherited_connections(worker_id: int) -> None:
    """A forked worker's first act: close the network connections it inherited from the rank (its process group's
    links to the other ranks, its store connection), which it never uses. Held open by a worker, they would outlive
    a rank that is killed, and the other ranks, waiting in a collective for it, would learn of its death only when
    its workers end (seconds later: a hang instead of a crash). Unix sockets and pipes (the worker's queues) stay."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # (the listing's own descriptor, closed by now)
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.close()
        else:
            sock.detach()


# torchdata 0.11 calls a deprecated torch API on every loader start; the warning is not actionable here.
warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")


class RankBatches:
    """Batches of global sample indices for one data-parallel rank, from `start` (docstring above);
    `limit`: stop before a round of batches would read sample `limit` or beyond."""

    def __init__(self, start: int, local_batch_size: int, dp_rank: int, dp_degree: int, limit: int | None = None):
        self.start, self.b, self.r, self.dp, self.limit = start, local_batch_size, dp_rank, dp_degree, limit

    def __iter__(self) -> Iterator[list[int]]:
        base = self.start
        while self.limit is None or base + self.b * self.dp <= self.limit:
            yield [base + j * self.dp + self.r for j in range(self.b)]
            base += self.b * self.dp


def _batch_as_is(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dataset returns whole batches (`__getitems__`): nothing left to collate."""
    return batch


class DataLoader:
    """Iterates this rank's batches {"input_ids", "labels", "positions"} (each local_batch_size x
    seq_len; with image data also "pixel_values" and "image_grid": `chat/packing.py`); `state_dict` /
    `load_state_dict` hold the global sample counter."""

    def __init__(self, dataset: WindowDataset, local_batch_size: int, dp_rank: int, dp_degree: int,
                 workers: int = 0, pin_memory: bool = False, limit: int | None = None, log_epochs: bool = True):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_degree {dp_degree}")
        self.dataset, self.local_batch_size = dataset, local_batch_size
        self.dp_rank, self.dp_degree, self.limit = dp_rank, dp_degree, limit
        self.workers, self.pin_memory, self.log_epochs = workers, pin_memory, log_epochs
        self.samples = 0
        self._generation = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        generation = self._generation
        batches = RankBatches(self.samples, self.local_batch_size, self.dp_rank, self.dp_degree, self.limit)
        # A private generator for the loader's worker base seed: iterating never draws from the global
        # RNG, so a resumed (or rejoining replica-group) run's RNG stream is the uninterrupted run's.
        loader = StatefulDataLoader(self.dataset, batch_sampler=batches, num_workers=self.workers,
                                    collate_fn=_batch_as_is, pin_memory=self.pin_memory,
                                    prefetch_factor=2 if self.workers else None,
                                    multiprocessing_context=WORKER_START if self.workers else None,
                                    worker_init_fn=_close_inherited_connections if WORKER_START == "fork" else None,
                                    persistent_workers=False, generator=torch.Generator())
        epochs = self.dataset.epochs(self.samples)
        for batch in loader:
            if generation != self._generation:
                raise RuntimeError("the loader's state was loaded during iteration: start a new iteration")
            self.samples += self.local_batch_size * self.dp_degree
            if self.log_epochs:
                epochs = self._log_new_epochs(epochs)
            yield batch

    def _log_new_epochs(self, before: list[int]) -> list[int]:
        now = self.dataset.epochs(self.samples)
        for source, old, new in zip(self.dataset.sources, before, now):
            if new > old:
                logger.info("data: %s has been read %d time(s) through; epoch %d of it starts (global sample %d)",
                            source.name, new, new + 1, self.samples)
        return now

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "epochs": self.dataset.epochs(self.samples),
                "fingerprint": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "samples" not in state:
            raise ValueError(f"loader state lacks 'samples' (got keys {sorted(state)}): saved by another loader")
        saved = state.get("fingerprint")
        if saved is not None and saved != self.dataset.fingerprint():
            logger.warning("data: the checkpoint's loader read %s; this run reads %s: continuing at global sample %d "
                           "of the new order", saved, self.dataset.fingerprint(), int(state["samples"]))
        self.samples = int(state["samples"])
        self._generation += 1
