"""Threads per rank on a CPU-only machine (torchtrain/utils/cpu_threads.py): the usable cores less those other work
keeps busy, shared by the local ranks; the user's OMP_NUM_THREADS always wins."""

from __future__ import annotations

import os

import pytest

from torchtrain.utils import cpu_threads


@pytest.mark.parametrize("cores, idle, ranks, expected", [
    (8, None, 2, 4),   # counters unreadable: the usable cores
    (8, 7.8, 2, 4),    # a quiet machine
    (2, 1.02, 1, 1),   # one of two cores kept busy by another process
    (2, 1.6, 1, 2),    # a core idle more than half the time counts
    (4, 0.1, 4, 1),    # everything busy: still one thread
    (4, 16.0, 1, 4),   # idle CPUs beyond the quota do not count
])
def test_threads_follow_the_idle_cores(monkeypatch, cores, idle, ranks, expected):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    assert cpu_threads.threads_per_rank(ranks, idle) == expected


def test_idle_cores_are_read_from_the_kernel():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat on this system")
    idle = cpu_threads.idle_cores(0.05)
    assert idle is not None and 0.0 <= idle <= len(os.sched_getaffinity(0)) + 1e-6


def test_the_default_says_how_it_was_chosen_and_the_users_count_wins(monkeypatch):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(cpu_threads, "idle_cores", lambda: 0.97)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(cpu_threads.DEFAULTED, raising=False)
    cpu_threads.choose_threads(1)
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ[cpu_threads.DEFAULTED] == "2 usable cores, 1 kept busy by other work / 1 local rank(s)"

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv(cpu_threads.DEFAULTED)
    cpu_threads.choose_threads(1)
    assert os.environ["OMP_NUM_THREADS"] == "3" and cpu_threads.DEFAULTED not in os.environ
