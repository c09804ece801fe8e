"""The run's offload ([offload]): the stores, the I/O threads, the streamed optimizers and the
parameter tier, built once by the trainer from the section and the layout (docs/offload.md).

`state_bytes_per_rank` is the size the nvme folder must have room for (the planner reports the same
figure as its NVMe memory row)."""

from __future__ import annotations

import contextlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from torchtrain.components.offload.optimizer import StreamedOptimizer
from torchtrain.components.offload.params import ParamOffload
from torchtrain.components.offload.store import FileStore, HostStore, check_folder
from torchtrain.config.offload import Offload
from torchtrain.utils.logging import logger

if TYPE_CHECKING:
    from torchtrain.components.optim.optimizer import OptimizersContainer

STATE_BYTES_PER_PARAM = {"AdamW": 8, "Adam": 8, "Muon": 8}  # fp32 moments (Muon: its AdamW share is the bound)
PARAM_BYTES = 4  # fp32 master parameters


def state_bytes_per_rank(num_params: int, optimizer: str, param_shards: int) -> int:
    """Optimizer-state bytes one rank holds: its 1/param_shards of the parameters' fp32 state."""
    return STATE_BYTES_PER_PARAM[optimizer] * num_params // max(param_shards, 1)


def nvme_bytes_per_rank(cfg: Offload, num_params: int, optimizer: str, param_shards: int) -> int:
    """What one rank writes under offload.nvme_path."""
    total = state_bytes_per_rank(num_params, optimizer, param_shards) if cfg.optimizer == "nvme" else 0
    return total + (PARAM_BYTES * num_params // max(param_shards, 1) if cfg.params == "nvme" else 0)


def check_nvme_folder(cfg: Offload, num_params: int, optimizer: str, param_shards: int) -> None:
    """The nvme folder is writable and has room for this node's ranks (LOCAL_WORLD_SIZE of them)."""
    if not cfg.uses_nvme:
        return
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    check_folder(cfg.nvme_path, ranks * nvme_bytes_per_rank(cfg, num_params, optimizer, param_shards))


class OffloadRuntime:
    """Builds and owns this rank's offload; `swap_params`: the layout's parameter tier runs here (on CUDA
    the cpu tier is FSDP2's own CPUOffloadPolicy, so only nvme does). `device`: where the optimizer
    steps (the layout's `state_device_type`: the CPU under CPUOffloadPolicy)."""

    def __init__(self, cfg: Offload, parts: list[nn.Module], optimizers: "OptimizersContainer", device: torch.device,
                 rank: int, swap_params: bool):
        self.cfg = cfg
        self.pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="offload-io")
        pin = device.type == "cuda"
        self.folder = folder = os.path.join(cfg.nvme_path, f"rank{rank}") if cfg.uses_nvme else ""
        self.stores = []
        self.params = None
        if swap_params:
            store = FileStore(os.path.join(folder, "params"), pin) if cfg.params == "nvme" else HostStore(pin)
            self.stores.append(store)
            self.params = ParamOffload(parts, store, self.pool)
        opt_store = None
        if cfg.optimizer != "none":
            opt_store = (FileStore(os.path.join(folder, "optimizer"), pin, keep_bytes=2 * cfg.bucket_mb * 2**20)
                         if cfg.optimizer == "nvme" else HostStore(pin))
            self.stores.append(opt_store)
        self.streamed = [StreamedOptimizer(opt, opt_store, f"opt{i}", device, cfg.bucket_mb * 2**20, self.pool,
                                           self.params) for i, opt in enumerate(optimizers)]
        if opt_store is not None or self.params is not None:  # else FSDP2's CPUOffloadPolicy does it all
            optimizers.streamed = self.streamed
        logger.info("offload: optimizer state -> %s, parameter shards -> %s%s; streamed in buckets of %d MiB, %d I/O "
                    "threads", cfg.optimizer, cfg.params if swap_params or cfg.params == "none" else
                    f"{cfg.params} (FSDP2 CPUOffloadPolicy)", f" (scratch folder {folder})" if folder else "",
                    cfg.bucket_mb, cfg.io_threads)

    @contextlib.contextmanager
    def params_resident(self) -> Iterator[None]:
        with self.params.resident() if self.params is not None else contextlib.nullcontext():
            yield

    def bytes_moved(self) -> tuple[int, int]:
        """(read, written) bytes of every store so far."""
        return sum(s.bytes_read for s in self.stores), sum(s.bytes_written for s in self.stores)

    def close(self) -> None:
        read, written = self.bytes_moved()
        logger.info("offload: %.3f GiB read, %.3f GiB written", read / 2**30, written / 2**30)
        self.pool.shutdown(wait=True)
        for s in self.stores:
            s.close()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


class ResidentModelState:
    """The checkpoint's model state with offloaded parameter shards: read and written while every shard
    is in memory; what `state_dict` hands out are copies (the shards leave again before DCP writes)."""

    def __init__(self, inner, runtime: OffloadRuntime):
        self.inner, self.runtime = inner, runtime
        self.model_parts = inner.model_parts

    def __getattr__(self, name: str):  # everything else (adapter_only, ...) is the wrapped state's
        return getattr(self.inner, name)

    def _resident_copy(self, read, *args, **kwargs) -> dict:
        with self.runtime.params_resident():
            sd = read(*args, **kwargs)
            return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}

    def state_dict(self, *args, **kwargs) -> dict:
        return self._resident_copy(self.inner.state_dict, *args, **kwargs)

    def saved_state_dict(self, *args, **kwargs) -> dict:
        return self._resident_copy(self.inner.saved_state_dict, *args, **kwargs)

    def load_state_dict(self, state: dict) -> None:
        with self.runtime.params_resident():
            self.inner.load_state_dict(state)
