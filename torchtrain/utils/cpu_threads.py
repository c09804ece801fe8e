"""Threads per process on a CPU-only machine.

torch's default is a thread per core it sees -- in a container, often the host's cores, not the few this job may
use -- and every rank of a job on one machine takes that many. When the threads outnumber the usable cores, each
parallel region waits for threads that are not running, and a step takes many times as long as it needs. The
launcher therefore gives each local rank `idle cores // local ranks` threads (at least one) unless
`OMP_NUM_THREADS` is set, and the trainer logs the count once.

Idle cores: the usable cores less those other work keeps busy, read from the kernel's per-CPU counters over a
short sample (`IDLE_SAMPLE_S`) at start-up. A core shared with a busy process is worse than no core at all for a
parallel region: its thread runs half the time, and every other thread waits for it at each barrier. Measured on
2 cores beside one process spinning on a core (the debug job): 2 threads per rank ran at 0.34x of the quiet
machine's speed, 1 thread at 0.51x (a quiet machine with 1 thread: 0.56x). Threads that sleep at the barriers
instead of spinning (`OMP_WAIT_POLICY=PASSIVE`) do not change the choice: 2 of them beside the spinning process ran
at 0.52x, 1 thread at 0.59x (60 steps, a later day).
"""

from __future__ import annotations

import os
import time

IDLE_SAMPLE_S = 0.2
"""How long the per-CPU counters are sampled to see which cores other work keeps busy."""


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


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]] | None:
    """{cpu: (idle + iowait ticks, all ticks)} of `cpus` from /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    times = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus and len(fields) >= 5:
            ticks = [int(x) for x in fields[:8]]
            times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return times or None


def idle_cores(sample_s: float = IDLE_SAMPLE_S) -> float | None:
    """How many of this process's CPUs sat idle over the next `sample_s` seconds (a sum of idle fractions); None
    where the kernel's counters cannot be read (not Linux)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    before = _cpu_times(cpus)
    if before is None:
        return None
    time.sleep(sample_s)
    after = _cpu_times(cpus) or {}
    idle = 0.0
    for cpu, (idle0, total0) in before.items():
        if cpu in after and after[cpu][1] > total0:
            idle += (after[cpu][0] - idle0) / (after[cpu][1] - total0)
    return idle


def threads_per_rank(local_ranks: int, idle: float | None = None) -> int:
    """The default thread count of each of `local_ranks` processes sharing this machine's usable cores, of which
    `idle` (when known) are not kept busy by other work (a core counts when it is idle more than half the time)."""
    cores = usable_cores()
    if idle is not None:
        cores = min(cores, int(idle + 0.5))
    return max(1, cores // max(1, local_ranks))


DEFAULTED = "TORCHTRAIN_DEFAULT_THREADS"
"""Set beside OMP_NUM_THREADS where the count is the default chosen here, not the user's: how it was chosen."""


def choose_threads(local_ranks: int) -> None:
    """Set `OMP_NUM_THREADS` for the workers about to start (every rank's torch reads it), unless the user set it."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores, idle = usable_cores(), idle_cores()
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(local_ranks, idle))
        busy = "" if idle is None or int(idle + 0.5) >= cores else f", {cores - int(idle + 0.5)} kept busy by other work"
        os.environ[DEFAULTED] = f"{cores} usable cores{busy} / {local_ranks} local rank(s)"


def apply_threads(local_ranks: int) -> str:
    """In a training process on the CPU: the default thread count where neither the user nor the launcher set one
    (`python -m torchtrain.train` run directly); returns the start-up line's account of it."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        choose_threads(local_ranks)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    how = (f"{os.environ[DEFAULTED]}; OMP_NUM_THREADS overrides" if os.environ.get(DEFAULTED) else "OMP_NUM_THREADS")
    return f"CPU threads per rank: {torch.get_num_threads()} ({how})"
