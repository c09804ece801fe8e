"""TEST-ONLY fault injection for the checkpoint tests (tests/test_checkpoint.py). Never set these
environment variables in a real job; unset, every function here is a no-op.

* ``TORCHTRAIN_TEST_CRASH_IN_SAVE=STEP:RANK``: while saving step STEP, global rank RANK kills itself
  with SIGKILL (kill -9 semantics: no cleanup, no exception) right after writing its own data files,
  i.e. in the middle of the save: the other ranks' files may exist, the metadata and the completion
  marker do not.
* ``TORCHTRAIN_TEST_SIGNAL_IN_SAVE=RANK:SIGNAL``: during every save, rank RANK sends itself SIGNAL
  (e.g. a second SIGTERM arriving while the preemption checkpoint is written).
* ``TORCHTRAIN_TEST_WAIT_FOR_SIGNAL=STEP:RANK``: after step STEP, rank RANK writes its pid to
  ``{dump_folder}/test_waiting_rank{RANK}.pid`` and waits (at most 300 s) until a preemption signal
  has arrived, so a test can signal that exact process at a known step without any timing race.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

CRASH_IN_SAVE = "TORCHTRAIN_TEST_CRASH_IN_SAVE"
SIGNAL_IN_SAVE = "TORCHTRAIN_TEST_SIGNAL_IN_SAVE"
WAIT_FOR_SIGNAL = "TORCHTRAIN_TEST_WAIT_FOR_SIGNAL"


def _pair(name: str) -> tuple[str, str] | None:
    value = os.environ.get(name)
    if not value:
        return None
    first, _, second = value.partition(":")
    return first, second


class _FaultyWriter(FileSystemWriter):
    def __init__(self, path: str, crash: bool, signum: int | None):
        super().__init__(path)
        self._crash, self._signum = crash, signum

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()  # this rank's files are written
        if self._signum is not None:
            os.kill(os.getpid(), self._signum)
        if self._crash:
            os.kill(os.getpid(), signal.SIGKILL)
        return future


def storage_writer(path: str, step: int, rank: int) -> FileSystemWriter:
    """The DCP writer for a save: the plain FileSystemWriter unless a test asked for a fault."""
    crash = _pair(CRASH_IN_SAVE)
    do_crash = crash is not None and (int(crash[0]), int(crash[1])) == (step, rank)
    sig = _pair(SIGNAL_IN_SAVE)
    signum = getattr(signal, sig[1]) if sig is not None and int(sig[0]) == rank else None
    if not do_crash and signum is None:
        return FileSystemWriter(path)
    return _FaultyWriter(path, do_crash, signum)


def wait_for_signal(step: int, rank: int, dump_folder: str, is_requested) -> None:
    spec = _pair(WAIT_FOR_SIGNAL)
    if spec is None or (int(spec[0]), int(spec[1])) != (step, rank):
        return
    pid_file = os.path.join(dump_folder, f"test_waiting_rank{rank}.pid")
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    deadline = time.monotonic() + 300
    while not is_requested():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{WAIT_FOR_SIGNAL}: no preemption signal arrived within 300 s")
        time.sleep(0.02)
