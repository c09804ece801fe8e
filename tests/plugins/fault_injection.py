"""Fault injection for the fault-tolerance and checkpoint tests, plugged into the run's extension
points (torchtrain/utils/extensions.py) when a job imports it: `--job.custom_imports fault_injection`
with tests/plugins on PYTHONPATH (conftest puts it there for every subprocess). Each fault is chosen
by an environment variable; unset, the hook does nothing.

* ``TORCHTRAIN_TEST_PARK_IN_STEP=STEP:RANK``: in the forward_backward phase of step STEP, global rank
  RANK writes its pid to ``{dump_folder}/test_parked_rank{RANK}.pid`` and waits there (at most 300 s),
  so a test can stop (SIGSTOP) or kill (SIGKILL) that exact process mid-step. Only in the first
  attempt of a job (torchrun's restart count 0): the restarted job runs through.
* ``TORCHTRAIN_TEST_STOP_IN_STEP=STEP:RANK``: in the forward_backward phase of step STEP, global rank
  RANK stops itself (SIGSTOP) and goes on once something continues it (the hang monitor does). Only
  in the first attempt of a job.
* ``TORCHTRAIN_TEST_REPLICA_WAIT=STEP[:MARKER]``: with fault.replica_ft, before step STEP every replica
  group waits until all replica groups take part in the quorum, so a test knows the step by which a
  restarted group has rejoined. With MARKER (a file path), a group first waits (at most 300 s) until
  the file exists -- the restarted group creates it when it is about to join (REJOIN_AFTER) -- so a slow
  restart on a busy machine cannot outlast the quorum's wait (fault.replica_timeout_s).
* ``TORCHTRAIN_TEST_REJOIN_AFTER=PATH:STEP``: with fault.replica_ft, a restarted job (torchrun's restart
  count > 0) waits before its first quorum until the metrics file PATH (a surviving group's
  metrics.jsonl) holds the record of step STEP, which that group trained without it; so the survivors'
  loss of the group is on record and the rejoin happens at step STEP + 1, however fast the restart.
* ``TORCHTRAIN_TEST_CRASH_IN_SAVE=STEP:RANK``: while saving step STEP, global rank RANK kills itself
  with SIGKILL (kill -9 semantics: no cleanup, no exception) right after writing its own data files,
  i.e. in the middle of the save: the other ranks' files may exist, the metadata and the completion
  marker do not.
* ``TORCHTRAIN_TEST_SIGNAL_IN_SAVE=RANK:SIGNAL[:group]``: during every save, rank RANK sends itself SIGNAL
  (e.g. a second SIGTERM arriving while the preemption checkpoint is written); with ``:group``, to the
  launcher's whole process group instead (its parent's group: the launcher's agent or forkserver), as a
  scheduler that signals every process again would.
* ``TORCHTRAIN_TEST_FAIL_SAVE=STEP[,STEP...]:RANK[:ERRNO]``: while saving each listed step, global rank
  RANK's write fails as a full disk makes it fail (ERRNO default ENOSPC; EROFS: a read-only folder, EIO:
  an I/O error): its data file is cut to half its size, then the write raises OSError. The other ranks'
  files are written.
* ``TORCHTRAIN_TEST_CONTROL=DIR``: faults requested from outside while the job runs (benchmarks/chaos.py),
  by files dropped into DIR: ``slow-RANK`` (holding seconds): while it exists, rank RANK works that many
  more CPU seconds in every forward_backward phase (a slow rank); ``nonfinite-grad-RANK``: at its next
  step rank RANK puts +inf into one of its gradients; ``bitflip-RANK``: after its next backward rank RANK flips
  one bit of its part of a parameter (silent data corruption); ``fail-save-RANK``: rank RANK's next checkpoint
  write fails as a full disk makes it fail (as FAIL_SAVE). The one-shot ones are renamed to
  ``<name>.done`` holding the step at which they happened. Every rank writes its pid to ``pid-RANK``
  when it starts training, for signals sent from outside.
* ``TORCHTRAIN_TEST_WAIT_FOR_SIGNAL=STEP:RANK``: after step STEP, rank RANK writes its pid to
  ``{dump_folder}/test_waiting_rank{RANK}.pid`` and waits (at most 300 s) until a preemption signal
  has arrived, so a test can signal that exact process at a known step without any timing race.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from torchtrain.utils import extensions

PARK_IN_STEP = "TORCHTRAIN_TEST_PARK_IN_STEP"
STOP_IN_STEP = "TORCHTRAIN_TEST_STOP_IN_STEP"
REPLICA_WAIT = "TORCHTRAIN_TEST_REPLICA_WAIT"
REJOIN_AFTER = "TORCHTRAIN_TEST_REJOIN_AFTER"
CRASH_IN_SAVE = "TORCHTRAIN_TEST_CRASH_IN_SAVE"
SIGNAL_IN_SAVE = "TORCHTRAIN_TEST_SIGNAL_IN_SAVE"
WAIT_FOR_SIGNAL = "TORCHTRAIN_TEST_WAIT_FOR_SIGNAL"
FAIL_SAVE = "TORCHTRAIN_TEST_FAIL_SAVE"
CONTROL = "TORCHTRAIN_TEST_CONTROL"
WAIT_S = 300


def _pair(name: str) -> tuple[str, str] | None:
    value = os.environ.get(name)
    if not value:
        return None
    first, _, second = value.partition(":")
    return first, second


def _write_pid(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def park_in_step(rank: int, step: int, phase: str, dump_folder: str) -> None:
    spec = _pair(PARK_IN_STEP)
    if spec is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if phase != "forward_backward" or (int(spec[0]), int(spec[1])) != (step, rank):
        return
    _write_pid(os.path.join(dump_folder, f"test_parked_rank{rank}.pid"))
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


def stop_in_step(rank: int, step: int, phase: str, dump_folder: str) -> None:
    spec = _pair(STOP_IN_STEP)
    if spec is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if phase == "forward_backward" and (int(spec[0]), int(spec[1])) == (step, rank):
        os.kill(os.getpid(), signal.SIGSTOP)


def _requested(name: str, step: int) -> bool:
    """A one-shot request file of the control folder: True (once) if present.

    The rename claims it (one rank, one step); it then becomes <name>.done holding the step, and appears
    under that name only once the step is written, so a reader never sees it empty.
    """
    folder = os.environ.get(CONTROL)
    if not folder:
        return False
    path = os.path.join(folder, name)
    try:
        os.rename(path, path + ".claimed")
    except OSError:
        return False
    with open(path + ".claimed", "w") as f:
        f.write(str(step))
    os.rename(path + ".claimed", path + ".done")
    return True


_pid_reported: list[bool] = []


def report_pid(rank: int, step: int, phase: str, dump_folder: str) -> None:
    folder = os.environ.get(CONTROL)
    if folder and not _pid_reported:
        _write_pid(os.path.join(folder, f"pid-{rank}"))
        _pid_reported.append(True)


def slow_rank(rank: int, step: int, phase: str, dump_folder: str) -> None:
    folder = os.environ.get(CONTROL)
    if not folder or phase != "forward_backward":
        return
    try:
        seconds = float(open(os.path.join(folder, f"slow-{rank}")).read())
    except (OSError, ValueError):
        return
    end = time.thread_time() + seconds  # work, not sleep: the straggler detection measures CPU time
    while time.thread_time() < end:
        pass


def nonfinite_gradient(step: int, model_parts: list) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if not _requested(f"nonfinite-grad-{rank}", step):
        return
    from torchtrain.distributed.utils import local_part

    grad = next(p.grad for part in model_parts for p in part.parameters() if p.grad is not None)
    local_part(grad).fill_(float("inf"))


def flip_parameter_bit(step: int, model_parts: list) -> None:
    """Silent data corruption: one bit of this rank's part of a parameter flipped (as a faulty GPU would leave it),
    after the backward: its replica now differs from the others, and nothing raises."""
    rank = int(os.environ.get("RANK", "0"))
    if not _requested(f"bitflip-{rank}", step):
        return
    import torch

    from torchtrain.distributed.utils import local_part

    param = next(p for part in model_parts for p in part.parameters() if p.dtype == torch.float32)
    with torch.no_grad():
        local_part(param).reshape(-1)[:1].view(torch.int32).bitwise_xor_(1 << 22)


def _wait_until(ready, failure: str) -> None:
    """Poll `ready()` until it holds; RuntimeError(`failure`) after WAIT_S seconds."""
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.05)


def replica_wait(step: int) -> bool:
    value = os.environ.get(REPLICA_WAIT)
    if not value:
        return False
    at, _, marker = value.partition(":")
    if step != int(at):
        return False
    if marker:
        _wait_until(lambda: os.path.exists(marker), f"{REPLICA_WAIT}: {marker} did not appear within {WAIT_S} s")
    return True


_rejoined: list[bool] = []


def _recorded(path: str, step: int) -> bool:
    if not os.path.exists(path):
        return False
    for line in open(path):
        try:
            if json.loads(line).get("step") == step:
                return True
        except ValueError:  # a line being written
            pass
    return False


def rejoin_after(step: int) -> bool:
    spec = os.environ.get(REJOIN_AFTER)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or _rejoined:
        return False
    path, _, after = spec.rpartition(":")
    _wait_until(lambda: _recorded(path, int(after)),
                f"{REJOIN_AFTER}: {path} has no record of step {after} after {WAIT_S} s")
    _rejoined.append(True)
    marker = os.environ.get(REPLICA_WAIT, "").partition(":")[2]
    if marker:  # the survivors may now wait for this group in their quorum
        open(marker, "w").close()
    return False


class _FaultyWriter(FileSystemWriter):
    def __init__(self, path: str, crash: bool, signum: int | None, group: bool = False, fail: int | None = None):
        super().__init__(path)
        self._crash, self._signum, self._group, self._fail = crash, signum, group, fail

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()  # this rank's files are written
        if self._fail is not None:
            for result in future.value():
                name = os.path.join(self.path, result.storage_data.relative_path)
                if os.path.exists(name):
                    os.truncate(name, os.path.getsize(name) // 2)
            raise OSError(self._fail, os.strerror(self._fail), str(self.path))
        if self._signum is not None and self._group:
            os.killpg(os.getpgid(os.getppid()), self._signum)
        elif self._signum is not None:
            os.kill(os.getpid(), self._signum)
        if self._crash:
            os.kill(os.getpid(), signal.SIGKILL)
        return future


def storage_writer(path: str, step: int, rank: int) -> FileSystemWriter | None:
    crash = _pair(CRASH_IN_SAVE)
    do_crash = crash is not None and (int(crash[0]), int(crash[1])) == (step, rank)
    sig = _pair(SIGNAL_IN_SAVE)
    signum, group = None, False
    if sig is not None and int(sig[0]) == rank:
        name, _, target = sig[1].partition(":")
        signum, group = getattr(signal, name), target == "group"
    fail = _pair(FAIL_SAVE)
    fail_errno = errno.ENOSPC if _requested(f"fail-save-{rank}", step) else None
    if fail is not None:
        steps = {int(s) for s in fail[0].split(",")}
        fail_rank, _, name = fail[1].partition(":")
        if step in steps and int(fail_rank) == rank:
            fail_errno = getattr(errno, name or "ENOSPC")
    if not do_crash and signum is None and fail_errno is None:
        return None
    return _FaultyWriter(path, do_crash, signum, group, fail_errno)


def wait_for_signal(step: int, rank: int, dump_folder: str, requested) -> None:
    spec = _pair(WAIT_FOR_SIGNAL)
    if spec is None or (int(spec[0]), int(spec[1])) != (step, rank):
        return
    _write_pid(os.path.join(dump_folder, f"test_waiting_rank{rank}.pid"))
    deadline = time.monotonic() + WAIT_S
    while not requested():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{WAIT_FOR_SIGNAL}: no preemption signal arrived within {WAIT_S} s")
        time.sleep(0.02)


extensions.register("phase", park_in_step)
extensions.register("phase", stop_in_step)
extensions.register("phase", report_pid)
extensions.register("phase", slow_rank)
extensions.register("gradients", nonfinite_gradient)
extensions.register("gradients", flip_parameter_bit)
extensions.register("quorum", replica_wait)
extensions.register("quorum", rejoin_after)
extensions.register("storage_writer", storage_writer)
extensions.register("preemption_check", wait_for_signal)
