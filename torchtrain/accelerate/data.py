"""A user's DataLoader re-sharded over the data-parallel ranks, placed on the device, resumable.

Batches: with `split_batches` (the default) the user's `batch_size` is the global batch -- each
data-parallel rank gets its contiguous 1/dp slice of every batch the user's loader would produce, so
the ranks' slices together are exactly the one-process batch (the same samples in the same order
under every layout). Without it (Accelerate's default), every rank gets whole batches of
`batch_size`, dealt round-robin: rank r takes batches r, r + dp, ...
A final batch that cannot be split evenly (or an incomplete round of batches) is dropped, so every
rank takes the same number of equal steps.

Map-style datasets keep the user's sampler (its shuffling, its generator); the batch sampler is
sharded by index, so no rank loads samples it does not use. Iterable datasets are read in full by
every rank and sharded by sample (no worker processes then: they would each read the whole stream).

Resuming: the state is the epoch, the number of batches taken in it, and the random state the epoch
started from (torch's global generator and the sampler's/loader's own generators). `load_state_dict`
makes the next iteration replay that start -- so a shuffled order is the same -- and skip the batches
already taken, by index, without loading them.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from torchtrain.config.fields import ConfigError


def _slice(items: list, dp: int, rank: int, split: bool) -> list | None:
    """This rank's part of one global group (None when the group cannot be dealt evenly)."""
    if len(items) % dp:
        return None
    share = len(items) // dp
    return items[rank * share:(rank + 1) * share] if split else items[rank]


class ShardedBatchSampler:
    """The user's batch sampler, dealt over data-parallel ranks; skips `skip` global steps."""

    def __init__(self, batch_sampler, dp: int, rank: int, split: bool):
        self.batch_sampler, self.dp, self.rank, self.split = batch_sampler, dp, rank, split
        self.skip = 0

    def _groups(self) -> Iterator[list]:
        if self.split:
            yield from ([list(b)] for b in self.batch_sampler)
        else:
            it = iter(self.batch_sampler)
            while group := list(itertools.islice(it, self.dp)):
                yield group

    def __iter__(self):
        for i, group in enumerate(self._groups()):
            part = _slice(group[0] if self.split else group, self.dp, self.rank, self.split)
            if part is None:
                return
            if i >= self.skip:
                yield part

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        if not self.split:
            return n // self.dp
        last_even = getattr(self.batch_sampler, "drop_last", True) or len(self.batch_sampler.sampler) % \
            self.batch_sampler.batch_size % self.dp == 0
        return n if last_even else n - 1


class ShardedIterable(IterableDataset):
    """An iterable dataset read by every rank, each keeping its share of every group of `group` samples."""

    def __init__(self, dataset, group: int, dp: int, rank: int, split: bool):
        self.dataset, self.group, self.dp, self.rank, self.split = dataset, group, dp, rank, split
        self.skip = 0

    def __iter__(self):
        it = iter(self.dataset)
        for i in itertools.count():
            group = list(itertools.islice(it, self.group))
            if len(group) < self.group:
                return
            if i >= self.skip:
                share = self.group // self.dp
                yield from group[self.rank * share:(self.rank + 1) * share]


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    if hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    return batch


class PreparedDataLoader:
    """What `Accelerator.prepare` returns for a DataLoader: iterate it like the original."""

    def __init__(self, loader: DataLoader, dp: int, rank: int, device: torch.device, split: bool):
        self.original, self.device, self.dp = loader, device, dp
        batch_size = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler,
                                                                                     "batch_size", None)
        if split and (batch_size is None or batch_size % dp):
            raise ConfigError(f"DataLoader batch_size {batch_size} is not divisible by the data-parallel degree {dp}: "
                              f"with split_batches each rank takes batch_size / {dp} samples of every batch; use a "
                              f"multiple of {dp}")
        common = dict(collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                      worker_init_fn=loader.worker_init_fn, generator=loader.generator)
        if isinstance(loader.dataset, IterableDataset):
            if loader.num_workers:
                raise ConfigError("a DataLoader of an IterableDataset is sharded by sample in the main process; set "
                                  "num_workers = 0 (worker processes would each read the whole stream)")
            group = batch_size if split else batch_size * dp
            self.shard = ShardedIterable(loader.dataset, group, dp, rank, split)
            self.loader = DataLoader(self.shard, batch_size=group // dp, drop_last=True, **common)
        else:
            if loader.batch_sampler is None:
                raise ConfigError("a DataLoader with batch_size=None (no batching) cannot be sharded; give it a "
                                  "batch_size")
            self.shard = ShardedBatchSampler(loader.batch_sampler, dp, rank, split)
            workers = dict(num_workers=loader.num_workers, persistent_workers=loader.persistent_workers,
                           prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context
                           ) if loader.num_workers else {}
            self.loader = DataLoader(loader.dataset, batch_sampler=self.shard, **common, **workers)
        self.epoch, self.position, self._next_epoch = 0, 0, 0
        self._start: dict[str, torch.Tensor] = {}
        self._resume: dict[str, torch.Tensor] | None = None

    @property
    def dataset(self):
        return self.original.dataset

    @property
    def batch_size(self):
        return self.original.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def _generators(self) -> dict[str, torch.Generator]:
        found = {"loader_rng": self.original.generator,
                 "sampler_rng": getattr(getattr(self.original, "sampler", None), "generator", None)}
        return {k: g for k, g in found.items() if isinstance(g, torch.Generator)}

    def _set_start(self, start: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(start["rng"])
        for key, gen in self._generators().items():
            if key in start:
                gen.set_state(start[key])

    def __iter__(self):
        resume, self._resume = self._resume, None
        if resume is not None:
            current = torch.get_rng_state()
            self.epoch, self.position = int(resume["epoch"]), int(resume["position"])
            self._start = {k: v for k, v in resume.items() if k not in ("epoch", "position")}
            self._set_start(self._start)
        else:
            self.epoch, self.position = self._next_epoch, 0
            self._start = {"rng": torch.get_rng_state(), **{k: g.get_state() for k, g in self._generators().items()}}
        self._next_epoch = self.epoch + 1
        self.shard.skip = self.position
        it = iter(self.loader)
        if resume is not None:  # the sampler draws its order at the first batch: replay the epoch's start, then
            first = next(it, None)  # go on from the restored state
            torch.set_rng_state(current)
            if first is None:
                return
            it = itertools.chain([first], it)
        for batch in it:
            self.position += 1
            yield to_device(batch, self.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        start = self._start or {"rng": torch.get_rng_state(),
                                **{k: g.get_state() for k, g in self._generators().items()}}
        return {"epoch": torch.tensor(self.epoch), "position": torch.tensor(self.position), **start}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._resume = dict(state)
