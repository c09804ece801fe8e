"""TEST-ONLY fault injection for the fault-tolerance tests (tests/test_fault.py, tests/test_replica_ft.py).
Never set these environment variables in a real job; unset, every function here is a no-op.

* ``TORCHTRAIN_TEST_PARK_IN_STEP=STEP:RANK``: in the forward_backward phase of step STEP, global rank
  RANK writes its pid to ``{dump_folder}/test_parked_rank{RANK}.pid`` and waits there (at most 300 s),
  so a test can stop (SIGSTOP) or kill (SIGKILL) that exact process mid-step. Only in the first
  attempt of a job (torchrun's restart count 0): the restarted job runs through.
* ``TORCHTRAIN_TEST_REPLICA_WAIT=STEP``: with fault.replica_ft, before step STEP every replica group
  waits until all replica groups take part in the quorum, so a test knows the step by which a
  restarted group has rejoined.
"""

from __future__ import annotations

import os
import time

PARK_IN_STEP = "TORCHTRAIN_TEST_PARK_IN_STEP"
REPLICA_WAIT = "TORCHTRAIN_TEST_REPLICA_WAIT"


def park_spec() -> tuple[int, int] | None:
    """(STEP, RANK) of TORCHTRAIN_TEST_PARK_IN_STEP in the first attempt of a job, else None."""
    spec = os.environ.get(PARK_IN_STEP)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    step, _, rank = spec.partition(":")
    return int(step), int(rank)


def park_in_step(rank: int, dump_folder: str) -> None:
    """Write this process's pid file and wait (see the module docstring)."""
    pid_file = os.path.join(dump_folder, f"test_parked_rank{rank}.pid")
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        time.sleep(0.05)


def replica_wait_step() -> int | None:
    value = os.environ.get(REPLICA_WAIT)
    return int(value) if value else None
