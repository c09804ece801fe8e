"""What the launcher makes of failed workers: each rank's exit in words, the final statuses that end a job without
a restart (a config error, a guard abort, failing checkpoint saves: the same start would fail the same way), and
the agent's restart policy that drops its remaining restarts after one and announces every other restart."""

from __future__ import annotations

import signal
import sys

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


def describe_failures(failures: dict) -> str:
    return ", ".join(f"rank {r}: {describe_exit(f.exitcode)}" for r, f in sorted(failures.items()))


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


def install_restart_policy() -> None:
    """Drop the agent's remaining restarts after a final failure; announce every restart."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    if original is None:
        return

    def monitor(self, worker_group):
        result = original(self, worker_group)
        failures = getattr(result, "failures", None) or {}
        if result.is_failed() and failures:
            failures.update(signalled_peers(self, worker_group, failures))
            if final_status(failures) is not None:
                self._remaining_restarts = 0
            elif getattr(self, "_remaining_restarts", 0) > 0:
                spec = worker_group.spec
                done = spec.max_restarts - self._remaining_restarts + 1
                print(f"torchtrain: worker failure ({describe_failures(failures)}); restarting the workers "
                      f"(restart {done} of {spec.max_restarts})", file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor
