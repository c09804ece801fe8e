"""Parameter offload (the Infinity tier): each FSDP2 unit's sharded parameters kept in a store (host
memory or NVMe files) and brought into the training memory only while they are used.

The sharded parameters always sit in host memory here: on a CPU run that is the training memory
itself, on CUDA the shards live there under FSDP2's CPUOffloadPolicy and this tier swaps them on to
NVMe. A shard is in use

* for its unit's all-gather: `FSDPParamGroup.unshard` is wrapped to fetch the unit's shards first and
  release them once the all-gather has copied them in; the next unit in the order of the last step's
  all-gathers (forward, then backward) is read ahead by an I/O thread;
* for the optimizer step, bucket by bucket (`StreamedOptimizer`), written back after its update;
* for a checkpoint (`resident()`).

Releasing frees the shard's storage (its size set to 0, as FSDP2 frees unsharded parameters), so the
parameter objects, the optimizer's references and the DTensor metadata stay as they are. Offloading
starts after the first optimizer step (FSDP2's lazy initialisation re-reads the shards on the first
forward). Needs FSDP sharding over 2 or more ranks: with one, FSDP2's unsharded parameters are the
shards themselves.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from torchtrain.components.offload.store import FileStore, HostStore


def _fsdp_groups(parts: list[nn.Module]) -> list:
    """Every FSDP2 parameter group of the parts, in module order."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    groups.append(group)
    return groups


class ParamOffload:
    """The parameter tier of the model parts (see the module docstring)."""

    def __init__(self, parts: list[nn.Module], store: "HostStore | FileStore", pool: ThreadPoolExecutor):
        self.store, self.pool = store, pool
        self.groups = _fsdp_groups(parts)
        self.active = False
        self._by_param: dict[int, tuple[str, object]] = {}  # id(sharded param) -> (key, FSDPParam)
        self._ahead: dict[str, Future] = {}
        self._order: list[int] = []  # group indices in the order of the last step's all-gathers
        self._seen: list[int] = []
        self._writes: list[Future] = []
        for g, group in enumerate(self.groups):
            self._wrap(g, group)

    # ------------------------------------------------------------------ shards in and out
    def _resident(self, fp) -> bool:
        data = fp._sharded_param_data
        return data.untyped_storage().nbytes() > 0 or data.numel() == 0

    def _read_ahead(self, key: str) -> None:
        if key not in self._ahead and key in self.store:
            self._ahead[key] = self.pool.submit(self.store.get, key)

    def _fetch_one(self, key: str, fp) -> None:
        if self._resident(fp):
            return
        data = fp._sharded_param_data
        future = self._ahead.pop(key, None)
        host = future.result() if future is not None else self.store.get(key)
        data.untyped_storage().resize_(data.numel() * data.element_size())
        data.copy_(host.view(data.shape))

    def _release_one(self, key: str, fp, write: bool) -> None:
        data = fp._sharded_param_data
        if data.numel() == 0:
            return
        if write or key not in self.store:
            self.store.put(key, data.view(-1))
        data.untyped_storage().resize_(0)

    @staticmethod
    def _adopt(fp) -> None:
        """Give the shard a storage of its own that can be freed and re-grown (a materialised or pinned
        one cannot be resized): a copy, with the parameter's local tensor re-pointed into it."""
        data = fp._sharded_param_data
        if data.untyped_storage().resizable() and data.untyped_storage().nbytes() == data.numel() * data.element_size():
            return
        local = fp.sharded_param._local_tensor
        fresh = torch.empty(data.shape, dtype=data.dtype)
        fresh.copy_(data)
        fp._sharded_param_data = fresh
        fp.sharded_param._local_tensor = fresh.as_strided(local.shape, local.stride(),
                                                          local.storage_offset() - data.storage_offset())

    def _entries(self, params: list[torch.Tensor]) -> list[tuple[str, object]]:
        return [self._by_param[id(p)] for p in params if id(p) in self._by_param]

    # ------------------------------------------------------------------ the optimizer's side
    def prefetch(self, params: list[torch.Tensor]) -> None:
        for key, _ in self._entries(params):
            self._read_ahead(key)

    def fetch(self, params: list[torch.Tensor]) -> None:
        for key, fp in self._entries(params):
            self._fetch_one(key, fp)

    def release(self, params: list[torch.Tensor], write: bool) -> None:
        """Take the shards out after an update (`write`: their new values go to the store first, in an
        I/O thread; the storage is freed when written)."""
        if not self.active:
            return
        entries = [(key, fp) for key, fp in self._entries(params) if self._resident(fp)]
        if entries:
            self._writes.append(self.pool.submit(lambda: [self._release_one(k, fp, write) for k, fp in entries]))

    def wait(self) -> None:
        """After the optimizer step: every write has landed; the first step switches offloading on."""
        for w in self._writes:
            w.result()
        self._writes.clear()
        self._ahead.clear()  # reads ahead of shards the step has since updated would be stale
        if not self.active:
            self.active = True
            for g, group in enumerate(self.groups):
                for i, fp in enumerate(group.fsdp_params):
                    self._adopt(fp)
                    self._by_param[id(fp.sharded_param)] = (f"param.u{g}.p{i}", fp)
            for key, fp in self._by_param.values():
                self._release_one(key, fp, write=True)
        self._order, self._seen = self._seen or self._order, []

    # ------------------------------------------------------------------ the all-gathers' side
    def _wrap(self, g: int, group) -> None:
        unshard = group.unshard

        def offloaded_unshard(async_op: bool = False):
            if not self.active or group._all_gather_result is not None or group.is_unsharded:
                return unshard(async_op)
            self._seen.append(g)
            entries = [(f"param.u{g}.p{i}", fp) for i, fp in enumerate(group.fsdp_params)]
            for key, fp in entries:
                self._fetch_one(key, fp)
            self._prefetch_after(len(self._seen) - 1)
            try:
                return unshard(async_op)
            finally:
                if group.device.type == "cuda":
                    torch.cuda.synchronize(group.device)  # the copy-in (on FSDP's own stream) read the shards
                for key, fp in entries:
                    self._release_one(key, fp, write=False)

        group.unshard = offloaded_unshard

    def _prefetch_after(self, position: int) -> None:
        if position + 1 < len(self._order):
            nxt = self._order[position + 1]
            for i, _ in enumerate(self.groups[nxt].fsdp_params):
                self._read_ahead(f"param.u{nxt}.p{i}")

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every shard in memory for the block (checkpoints); released again after, what the block
        wrote into them (a loaded checkpoint) kept."""
        entries = list(self._by_param.values()) if self.active else []
        for key, fp in entries:
            self._fetch_one(key, fp)
        try:
            yield
        finally:
            for key, fp in entries:
                self._release_one(key, fp, write=True)
