"""Where offloaded tensors live: host memory (`HostStore`) or files on a local disk (`FileStore`, one
file per tensor), behind one interface of named, flat tensors.

`put(key, t)` keeps a copy of `t`'s data under `key`; `get(key)` gives it back as a host tensor (for the
host store, the kept tensor itself: computing on it in place and putting it back copies nothing).
Both are safe to call from the I/O threads for different keys; file reads and writes release the GIL,
so the threads overlap disk transfers with the computing thread. Byte counters say what moved.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import time

import torch


def _bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous host tensor, as a writable buffer (any dtype, bfloat16 included).
    Taken from its address, not through numpy, which would pin the storage's size for good (a parameter
    shard's storage is freed and re-grown)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def return_freed_memory(threshold: int = 1 << 20) -> None:
    """Have glibc serve allocations of `threshold` bytes and more from their own mappings, unmapped when
    freed: a state bucket read from disk and written back is then returned to the OS at once, instead of
    staying in the allocator's heaps (glibc's default raises that threshold to the size of the largest
    freed block, up to 32 MiB, after which freed buckets stay resident). No-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass


class HostStore:
    """Tensors kept in host memory; `pin`: page-locked, for asynchronous copies to a CUDA device."""

    def __init__(self, pin: bool = False):
        self.pin = pin
        self._tensors: dict[str, torch.Tensor] = {}
        self.bytes_read = self.bytes_written = 0
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def put(self, key: str, t: torch.Tensor) -> None:
        kept = self._tensors.get(key)
        if kept is t:
            return
        if kept is None or kept.shape != t.shape or kept.dtype != t.dtype:
            kept = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
            with self._lock:
                self._tensors[key] = kept
        kept.copy_(t)
        with self._lock:
            self.bytes_written += t.numel() * t.element_size()

    def get(self, key: str) -> torch.Tensor:
        t = self._tensors[key]
        with self._lock:
            self.bytes_read += t.numel() * t.element_size()
        return t

    def recycle(self, t: torch.Tensor) -> None:
        """Nothing to reuse: `put` keeps copies of its own (as `FileStore.recycle`)."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def close(self) -> None:
        self._tensors.clear()


class FileStore:
    """Tensors kept in files under `folder` (scratch: emptied when opened and when closed). `get`
    reads into a new host tensor (page-locked with `pin`), so the process holds a tensor's memory only
    while it is in use."""

    def __init__(self, folder: str, pin: bool = False, keep_bytes: int = 0):
        self.folder, self.pin, self.keep_bytes = folder, pin, keep_bytes
        self._free: dict[tuple, list[torch.Tensor]] = {}  # buffers given back by `recycle`, reused by `get`
        self._free_bytes = 0
        return_freed_memory()
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder, exist_ok=True)
        self._meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.bytes_read = self.bytes_written = 0
        self.read_seconds = self.write_seconds = 0.0  # summed over the I/O threads
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        return key in self._meta

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, key + ".bin")

    def put(self, key: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        start = time.perf_counter()
        with open(self._path(key), "wb", buffering=0) as f:
            view, done = _bytes(t), 0
            while done < len(view):
                done += f.write(view[done:])
        with self._lock:
            self._meta[key] = (t.shape, t.dtype)
            self.bytes_written += t.numel() * t.element_size()
            self.write_seconds += time.perf_counter() - start

    def get(self, key: str) -> torch.Tensor:
        shape, dtype = self._meta[key]
        with self._lock:
            spare = self._free.get((shape, dtype))
            t = spare.pop() if spare else None
            if t is not None:
                self._free_bytes -= t.numel() * t.element_size()
        if t is None:
            t = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        start = time.perf_counter()
        with open(self._path(key), "rb", buffering=0) as f:
            view, done = _bytes(t), 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise OSError(f"offload file {self._path(key)} is shorter than the tensor it holds")
                done += n
        with self._lock:
            self.bytes_read += t.numel() * t.element_size()
            self.read_seconds += time.perf_counter() - start
        return t

    def recycle(self, t: torch.Tensor) -> None:
        """`t` (a tensor `get` returned, written back and no longer used) may serve a later `get` of the
        same shape: up to `keep_bytes` of such buffers are kept, which spares the page faults of fresh
        allocations (about two buckets' worth is the step's working set)."""
        size = t.numel() * t.element_size()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != size:
            return  # a view into a larger buffer: not ours to reuse
        with self._lock:
            if self._free_bytes + size <= self.keep_bytes:
                self._free.setdefault((t.shape, t.dtype), []).append(t)
                self._free_bytes += size

    def nbytes(self) -> int:
        return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in self._meta.values())

    def close(self) -> None:
        self._meta.clear()
        self._free.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def check_folder(path: str, needed_bytes: int, key: str = "offload.nvme_path") -> None:
    """A folder the nvme tier can use: it, or the nearest folder above it that exists (the trainer creates
    the rest), is writable and has `needed_bytes` free (ValueError with one line otherwise). Creates
    nothing: the planner runs it too."""
    existing = os.path.abspath(path or ".")
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"[{key}] {path} is not a writable folder ({existing} is not writable by this user); "
                         f"point it at a folder on a local disk this user can write")
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise ValueError(f"[{key}] {path} has {free / 2**30:.2f} GiB free but the offloaded state needs "
                         f"{needed_bytes / 2**30:.2f} GiB on this node; free space or choose another disk")
