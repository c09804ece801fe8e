"""The chaos benchmark's short variant (benchmarks/chaos.py): one deterministic job of 2 processes, 60 steps, a
checkpoint every 5, under a seeded schedule of five faults injected from outside while it runs -- a flipped byte
in the newest checkpoint then kill -9 of a rank; a truncated shard of the newest checkpoint then kill -9 of every
process of the launch and the same command again; a full disk during a save (injected ENOSPC); SIGTERM to every
process of the launch and the same command again; +inf in a gradient. The final per-step losses must equal the
uninterrupted run's BITWISE (deterministic CPU kernels, exact resume and replay: any difference is a bug), and no
step's loss may be logged twice with different values; every fault must have been detected as designed.

The benchmark's full run (4 processes, 300 steps, all eight faults, SIGSTOP, a slow rank and kill -9 of a rank
included) is in docs/resilience.md. One launch of the reference and three of the chaos run: 20-35 s on 2 CPU
cores.
"""

from __future__ import annotations

import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
pytestmark = [pytest.mark.dist, pytest.mark.slow]
FAULTS = ["flip", "truncate", "enospc", "preempt", "nonfinite"]


def test_a_seeded_chaos_run_ends_bitwise_equal_to_the_uninterrupted_run(tmp_path):
    import chaos

    lines: list[str] = []
    ok, outcomes = chaos.chaos(str(tmp_path / "chaos"), nproc=2, steps=60, interval=5, seed=1, kinds=FAULTS,
                               out=lines.append)
    report = "\n".join(lines)
    print(report)
    assert ok, report
    detected = {o.kind: o.detected for o in outcomes}
    assert sorted(detected) == sorted(FAULTS), report
    assert "is corrupt: __" in detected["flip"] and "its content changed since the save" in detected["flip"], report
    assert "is corrupt: __" in detected["truncate"] and "(truncated)" in detected["truncate"], report
    assert "No space left on device" in detected["enospc"], report
    assert "non-finite gradient norm" in detected["nonfinite"], report
    assert "preemption: all ranks stop after step" in detected["preempt"], report
    assert all("resumed from step-" in o.action for o in outcomes if o.kind in ("flip", "truncate", "preempt")), report
