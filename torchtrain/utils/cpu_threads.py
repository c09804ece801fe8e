"""Threads per process on a CPU-only machine.

torch's default is a thread per core it sees -- in a container, often the host's cores, not the few this job may
use -- and every rank of a job on one machine takes that many. When the threads outnumber the usable cores, each
parallel region waits for threads that are not running, and a step takes many times as long as it needs. The
launcher therefore gives each local rank `usable cores // local ranks` threads (at least one) unless
`OMP_NUM_THREADS` is set, and the trainer logs the count once.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (a container's cpu.max, or cgroup
    v1's cfs quota). `os.cpu_count()` counts the host's, which a container may not have."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            with open(quota_file) as f:
                fields = f.read().split()
            if period_file is not None:
                with open(period_file) as f:
                    fields.append(f.read().strip())
            quota, period = fields[0], fields[-1]
            if quota not in ("max", "-1"):
                cores = min(cores, max(1, int(quota) // int(period)))
        except (OSError, ValueError, IndexError):
            continue
    return cores


def threads_per_rank(local_ranks: int) -> int:
    """The default thread count of each of `local_ranks` processes sharing this machine's usable cores."""
    return max(1, usable_cores() // max(1, local_ranks))


DEFAULTED = "TORCHTRAIN_DEFAULT_THREADS"
"""Set (to "1") beside OMP_NUM_THREADS where the count is the default chosen here, not the user's."""


def choose_threads(local_ranks: int) -> None:
    """Set `OMP_NUM_THREADS` for the workers about to start (every rank's torch reads it), unless the user set it."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(local_ranks))
        os.environ[DEFAULTED] = "1"


def apply_threads(local_ranks: int) -> str:
    """In a training process on the CPU: the default thread count where neither the user nor the launcher set one
    (`python -m torchtrain.train` run directly); returns the start-up line's account of it."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        choose_threads(local_ranks)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    how = (f"{usable_cores()} usable cores / {local_ranks} local rank(s); OMP_NUM_THREADS overrides"
           if os.environ.get(DEFAULTED) == "1" else "OMP_NUM_THREADS")
    return f"CPU threads per rank: {torch.get_num_threads()} ({how})"
