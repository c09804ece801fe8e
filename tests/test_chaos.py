"""The chaos benchmark (benchmarks/chaos.py) in its short variant: one deterministic job of 2 processes (two
replicas of the model, compared every 5 steps), 70 steps, a checkpoint every 5, under a seeded schedule of seven
faults injected from outside while it runs -- a flipped byte in the newest checkpoint then kill -9 of a rank; a
truncated shard of the newest checkpoint then kill -9 of every process of the launch and the same command again;
a full disk during a save (injected ENOSPC); SIGTERM to every process of the launch and the same command again;
+inf in a gradient; a flipped bit of one replica's parameter (silent data corruption); kill -9 of a rank and
then of a restarted worker before it has started (the restart itself fails). The final per-step losses must
equal the uninterrupted run's BITWISE (deterministic CPU kernels, exact resume and replay: any difference is a
bug), and no step's loss may be logged twice with different values but those the corrupted replica trained
before the check; every fault must have been detected as designed.

The benchmark's full run (4 processes, 400 steps, 20 faults of all eleven kinds) is the nightly test below
(`python -m pytest -m nightly`, 2-3 minutes on 2 CPU cores); its figures are in docs/resilience.md.
"""

from __future__ import annotations

import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
pytestmark = [pytest.mark.dist, pytest.mark.slow]
FAULTS = ["flip", "truncate", "enospc", "preempt", "nonfinite", "sdc", "rendezvous"]


def test_a_seeded_chaos_run_ends_bitwise_equal_to_the_uninterrupted_run(tmp_path):
    import chaos

    lines: list[str] = []
    ok, outcomes = chaos.chaos(str(tmp_path / "chaos"), nproc=2, steps=70, interval=5, seed=1, kinds=FAULTS,
                               out=lines.append, warmup=False)
    report = "\n".join(lines)
    print(report)
    assert ok, report
    detected = {o.kind: o.detected for o in outcomes}
    assert sorted(detected) == sorted(FAULTS), report
    assert "is corrupt: __" in detected["flip"] and "its content changed since the save" in detected["flip"], report
    assert "is corrupt: __" in detected["truncate"] and "(truncated)" in detected["truncate"], report
    assert "No space left on device" in detected["enospc"], report
    assert "non-finite" in detected["nonfinite"], report  # rank 0 logs it: its own gradient or its peer's
    assert "preemption: all ranks stop after step" in detected["preempt"], report
    assert "the data-parallel replicas differ" in detected["sdc"], report
    assert "worker failure (rank" in detected["rendezvous"], report
    assert all("resumed from step-" in o.action for o in outcomes
               if o.kind in ("flip", "truncate", "preempt", "rendezvous")), report
    assert "rolled back" in next(o.action for o in outcomes if o.kind == "sdc"), report
    assert next(o.action for o in outcomes if o.kind == "rendezvous").startswith("2 restarts"), report


@pytest.mark.nightly
def test_twenty_faults_of_every_kind_on_four_processes_end_bitwise_equal(tmp_path):
    import chaos

    lines: list[str] = []
    ok, outcomes = chaos.chaos(str(tmp_path / "chaos"), nproc=4, steps=400, interval=10, seed=0,
                               kinds=list(chaos.FAULTS), out=lines.append, count=20)
    report = "\n".join(lines)
    print(report)
    assert ok, report
    assert len(outcomes) == 20 and {o.kind for o in outcomes} == set(chaos.FAULTS), report
    assert all(o.detected_s is not None for o in outcomes), report
    assert os.path.exists(tmp_path / "chaos" / "report.json") and os.path.exists(tmp_path / "chaos" / "timeline.svg")
