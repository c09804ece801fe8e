"""The optimizer step over offloaded state, streamed bucket by bucket.

The optimizer's parameters are cut, in order, into buckets of about `bucket_bytes` of state. For
bucket i the step

1. takes bucket i's state (read ahead by an I/O thread while bucket i-1 computed; on CUDA copied to the
   device on a side stream), and its parameters' shards when parameters are offloaded too;
2. runs the unchanged optimizer (`torch.optim.AdamW`, `Adam` or `Muon`, same kernel) on bucket i alone,
   by giving each param group the bucket's parameters for the call;
3. hands the updated state to an I/O thread, which writes it back while bucket i+1 computes.

Element-wise optimizers update each parameter from its own state only, so a bucket's update is the
same computation as in one whole step: the losses are bitwise equal to no offload. Muon's all-gathers
run per parameter in the same order on every rank. At most two buckets' write-backs are in flight;
the step ends when every write has landed, so the next step reads what this one wrote.

Between steps the optimizer holds only scalar state (Adam's step counts); `resident()` puts the whole
state back for checkpoints (saved and restored exactly; the offload folder is scratch, never the
checkpoint), and takes it out again after.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterator

import torch
from torch.distributed.tensor import DTensor

from torchtrain.distributed.utils import local_part

if TYPE_CHECKING:
    from torchtrain.components.offload.params import ParamOffload
    from torchtrain.components.offload.store import FileStore, HostStore

# state tensors offloaded: every tensor the size of the parameter (Adam moments, Muon momentum)
_STATE_KINDS = 2  # Adam's two moments: the bucket estimate for a parameter without state yet


class StreamedOptimizer:
    """Offloads `opt`'s state to `store` and steps it bucket by bucket (see the module docstring)."""

    def __init__(self, opt: torch.optim.Optimizer, store: "HostStore | FileStore | None", prefix: str, device: torch.device,
                 bucket_bytes: int, pool: ThreadPoolExecutor, params: "ParamOffload | None" = None):
        self.opt, self.store, self.prefix, self.device, self.pool, self.params = opt, store, prefix, device, pool, params
        self.cuda = device.type == "cuda"
        self._h2d = torch.cuda.Stream(device) if self.cuda else None
        self._meta: dict[str, tuple] = {}  # key -> (param, state name, DTensor spec or None)
        self._keys: dict[int, list[str]] = {}  # id(param) -> its offloaded state's keys
        self._index = {id(p): f"{prefix}.g{g}.p{i}" for g, group in enumerate(opt.param_groups)
                       for i, p in enumerate(group["params"])}
        self.buckets: list[list[tuple[int, torch.Tensor]]] = []
        bucket, size = [], 0
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                bucket.append((g, p))
                size += local_part(p).numel() * 4 * _STATE_KINDS
                if size >= bucket_bytes:
                    self.buckets.append(bucket)
                    bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)

    # ------------------------------------------------------------------ state in and out
    def _offloadable(self, p: torch.Tensor, v: object) -> bool:
        return isinstance(v, torch.Tensor) and v.numel() > 1 and v.numel() == p.numel()

    def _take_out(self, bucket: list[tuple[int, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Remove the bucket's offloadable state from the optimizer: (key, host tensor) to write."""
        out = []
        if self.store is None:  # only the parameters are offloaded
            return out
        for _, p in bucket:
            state = self.opt.state.get(p, {})
            for name in [k for k, v in state.items() if self._offloadable(p, v)]:
                v = state.pop(name)
                key = f"{self._index[id(p)]}.{name}"
                spec = (v.device_mesh, v.placements, v.shape, v.stride()) if isinstance(v, DTensor) else None
                self._meta[key] = (p, name, spec)
                if key not in self._keys.setdefault(id(p), []):
                    self._keys[id(p)].append(key)
                local = local_part(v)
                if self.cuda:  # on the compute stream: ordered after the update
                    host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
                    host.copy_(local, non_blocking=True)
                    local = host
                out.append((key, local))
        return out

    def _read(self, bucket: list[tuple[int, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        loaded = [(k, self.store.get(k)) for _, p in bucket for k in self._keys.get(id(p), ())]
        if self.cuda:
            with torch.cuda.stream(self._h2d):
                loaded = [(k, t.to(self.device, non_blocking=True)) for k, t in loaded]
            event = self._h2d.record_event()
            loaded.append(("", event))  # the compute stream waits for it before use
        return loaded

    def _put_back(self, loaded: list[tuple[str, object]]) -> None:
        for key, t in loaded:
            if not key:
                torch.cuda.current_stream(self.device).wait_event(t)
                continue
            p, name, spec = self._meta[key]
            if self.cuda:  # allocated on the copy stream, used and freed on this one
                t.record_stream(torch.cuda.current_stream(self.device))
            if spec is not None:
                mesh, placements, shape, stride = spec
                t = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
            self.opt.state[p][name] = t

    def _write(self, items: list[tuple[str, torch.Tensor]], event: "torch.cuda.Event | None",
               recycle_buffers: bool = True) -> None:
        """Write the items back; with `recycle_buffers` the store may reuse them (the step's own buffers,
        which nothing else references; not a checkpoint's, which the saved state dict still holds)."""
        if event is not None:
            event.synchronize()
        recycle = recycle_buffers and not self.cuda
        for key, t in items:
            self.store.put(key, t)
            if recycle:
                self.store.recycle(t)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        groups = self.opt.param_groups
        kept = [g["params"] for g in groups]
        ahead: Future = self.pool.submit(self._read, self.buckets[0]) if self.buckets else None
        if self.params is not None and self.buckets:
            self.params.prefetch([p for _, p in self.buckets[0]])
        writes: list[Future] = []
        try:
            for i, bucket in enumerate(self.buckets):
                loaded = ahead.result()
                if self.params is not None:
                    self.params.fetch([p for _, p in bucket])
                if i + 1 < len(self.buckets):
                    ahead = self.pool.submit(self._read, self.buckets[i + 1])
                    if self.params is not None:
                        self.params.prefetch([p for _, p in self.buckets[i + 1]])
                self._put_back(loaded)
                for g, group in enumerate(groups):
                    group["params"] = [p for h, p in bucket if h == g]
                self.opt.step()
                out = self._take_out(bucket)
                event = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
                if len(writes) >= 2:
                    writes[-2].result()  # bound the write-backs in flight (and their host buffers)
                writes.append(self.pool.submit(self._write, out, event))
                if self.params is not None:
                    self.params.release([p for _, p in bucket], write=True)
        finally:
            for group, params in zip(groups, kept):
                group["params"] = params
            for w in writes:
                w.result()
            if self.params is not None:
                self.params.wait()

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The whole state back in the optimizer for the block (checkpoint save and load); offloaded again
        after, what the block left there included (a loaded checkpoint's state)."""
        every = [(g, p) for g, group in enumerate(self.opt.param_groups) for p in group["params"]]
        self._put_back(self._read(every))
        try:
            yield
        finally:
            out = self._take_out(every)
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            self._write(out, None, recycle_buffers=False)

