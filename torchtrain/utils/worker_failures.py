"""What the launcher makes of failed workers: each rank's exit in words, the final statuses that end a job without
a restart (a config error, a guard abort, failing checkpoint saves: the same start would fail the same way), and
the agent's restart policy that drops its remaining restarts after one, bounds the restarts within a window
(`RestartBudget`: fault.restart_window_s) and announces every other restart."""

from __future__ import annotations

import re
import signal
import sys
import time
from typing import Callable

from torchtrain.utils import exit_codes

EXPLAINED = {exit_codes.CONFIG_ERROR: "config error", exit_codes.GUARD_ABORT: "guard abort",
             exit_codes.HANG: "hang detected", exit_codes.SAVE_FAILED: "checkpoint saves failed",
             exit_codes.SILENT_CORRUPTION: "silent data corruption"}


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}" + (f" ({EXPLAINED[code]})" if code in EXPLAINED else "")


REASON_CHARS = 160
"""The most of a failed worker's error record shown in the launcher's one line (its whole record: the rank logs)."""


SOURCE_LOCATION = re.compile(r"^(\w+: )\[[^\]]*\.(?:cc|cpp|h|hpp|cu):\d+\] ")
"""The C++ source location a native error starts with (gloo's `[.../pair.cc:537] Read error ...`): left out."""


def failure_reason(failure) -> str:
    """The first line of the exception a failed worker recorded (torchrun's error file: `error.json` in the rank logs),
    e.g. `RuntimeError: ... Connection reset by peer` where a peer's process ended; "" where it recorded none (a
    signal, an exit status of its own)."""
    record = failure.message
    text = record.get("message", "") if isinstance(record, dict) else ""
    lines = text.strip().splitlines()
    line = SOURCE_LOCATION.sub(r"\1", lines[0]) if lines else ""
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 3] + "..."


def describe_failures(failures: dict) -> str:
    def one(rank: int, failure) -> str:
        reason = failure_reason(failure)
        return f"rank {rank}: {describe_exit(failure.exitcode)}" + (f" ({reason})" if reason else "")

    return ", ".join(one(r, f) for r, f in sorted(failures.items()))


def final_status(failures: dict) -> int | None:
    """The final status (config error, guard abort) the failed workers reported, if that is what stopped
    them: every worker that exited by itself exited with it (the others were ended by a signal, the
    agent's SIGTERM when it stopped the group)."""
    codes = {f.exitcode for f in failures.values() if f.exitcode > 0}
    return codes.pop() if len(codes) == 1 and codes <= set(exit_codes.FINAL) else None


def signalled_peers(agent, worker_group, failures: dict) -> dict:
    """Workers a signal other than the agent's SIGTERM ended, which torch's report (its first failed worker: maybe a
    rank that only saw its peer go, exit 1) left out: a rank killed (kill -9, the OOM killer) is named beside it."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    context = agent._pcontext
    if not isinstance(context, MultiprocessContext) or context._pc is None:
        return {}
    out = {}
    for local_rank, proc in enumerate(context._pc.processes):
        rank, code = worker_group.workers[local_rank].global_rank, proc.exitcode
        if rank not in failures and code is not None and code < 0 and code != -signal.SIGTERM:
            out[rank] = ProcessFailure(local_rank, proc.pid, code, "")
    return out


UNBOUNDED_RESTARTS = 1_000_000
"""torchrun's --max-restarts where a `RestartBudget` decides instead (it never runs out first)."""


class RestartBudget:
    """At most `burst` restarts within any `window_s` seconds (fault.max_restarts within fault.restart_window_s):
    a restart older than the window no longer counts, so a failure now and then never ends a long run, while a
    fault that comes back at every restart ends the job after `burst` quick restarts."""

    def __init__(self, burst: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self.recent: list[float] = []
        """When the restarts within the window happened."""

    def take(self) -> bool:
        """Whether one more restart is allowed now (counted when it is)."""
        now = self.clock()
        self.recent = [t for t in self.recent if now - t < self.window_s]
        if len(self.recent) >= self.burst:
            return False
        self.recent.append(now)
        return True

    def describe(self) -> str:
        """The restarts within the window, against the most allowed."""
        return f"{len(self.recent)} of {self.burst} within {self.window_s:g} s"


def restart_monitor(original: Callable, budget: RestartBudget | None = None) -> Callable:
    """torchrun's `_monitor_workers` (`original`) with the launcher's restart policy: no restart after a final failure;
    with a `budget`, a restart only where it allows one (torchrun's own count is then unbounded:
    `UNBOUNDED_RESTARTS`); every restart announced in one line."""

    def monitor(self, worker_group):
        result = original(self, worker_group)
        failures = getattr(result, "failures", None) or {}
        if not (result.is_failed() and failures):
            return result
        failures.update(signalled_peers(self, worker_group, failures))
        what = f"torchtrain: worker failure ({describe_failures(failures)})"
        spec = worker_group.spec
        done = spec.max_restarts - getattr(self, "_remaining_restarts", 0) + 1  # this restart's number
        if final_status(failures) is not None:
            self._remaining_restarts = 0
        elif budget is not None:
            if budget.take():
                print(f"{what}; restarting the workers (restart {done}; {budget.describe()})", file=sys.stderr,
                      flush=True)
            else:
                self._remaining_restarts = 0
                print(f"{what}; not restarted: {len(budget.recent)} restarts within the last {budget.window_s:g} s "
                      f"already, as many as fault.max_restarts allows within fault.restart_window_s", file=sys.stderr,
                      flush=True)
        elif getattr(self, "_remaining_restarts", 0) > 0:
            print(f"{what}; restarting the workers (restart {done} of {spec.max_restarts})", file=sys.stderr,
                  flush=True)
        return result

    return monitor


def install_restart_policy(budget: RestartBudget | None = None) -> None:
    """The launcher's restart policy (`restart_monitor`) in torchrun's agent."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    if original is not None:
        LocalElasticAgent._monitor_workers = restart_monitor(original, budget)
