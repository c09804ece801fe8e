"""torchrun, with the job's restart policy and clean failure reports:

    python -m torchtrain.launcher [torchrun options] -m torchtrain.train --job.config_file JOB.toml [...]

run_train.sh and scripts/multinode_trainer.slurm start training through this module instead of the
`torchrun` command. It runs torchrun itself (`torch.distributed.run`, in this process) and adds:

* the job's `fault.max_restarts` as `--max-restarts` (unless the command line sets it): a crashed,
  killed or hung worker group is restarted by torchrun's elastic agent and resumes from the newest
  complete checkpoint (docs/resilience.md);
* no restart after a final failure: a worker that exits with a config error (2) or a guard abort (3)
  would fail the same way again, so the agent's remaining restarts are dropped (the one private hook
  used here, on the agent's worker monitoring; where a future torch lacks it, such failures are
  simply restarted until the restarts run out);
* one line per restart, naming the failed ranks and their exit statuses;
* clean exits: when every failed worker already explained itself (config error, guard abort) the
  launcher exits with that status and no traceback of its own (torchrun would add its
  ChildFailedError traceback); after a detected hang it prints the hang summary and exits 4; any
  other failure prints torchrun's failure report, without the launcher's traceback, and exits 1.
  The agent's own log lines are silenced (they repeat these reports); set $LOGLEVEL (e.g. INFO) to
  see them.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import sys

from torchtrain.utils import exit_codes

EXPLAINED = {exit_codes.CONFIG_ERROR: "config error", exit_codes.GUARD_ABORT: "guard abort",
             exit_codes.HANG: "hang detected"}


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}" + (f" ({EXPLAINED[code]})" if code in EXPLAINED else "")


def _describe_failures(failures: dict) -> str:
    return ", ".join(f"rank {r}: {describe_exit(f.exitcode)}" for r, f in sorted(failures.items()))


def final_status(failures: dict) -> int | None:
    """The final status (config error, guard abort) the failed workers reported, if that is what stopped
    them: every worker that exited by itself exited with it (the others were ended by a signal, the
    agent's SIGTERM when it stopped the group)."""
    codes = {f.exitcode for f in failures.values() if f.exitcode > 0}
    return codes.pop() if len(codes) == 1 and codes <= set(exit_codes.FINAL) else None


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
            if final_status(failures) is not None:
                self._remaining_restarts = 0
            elif getattr(self, "_remaining_restarts", 0) > 0:
                spec = worker_group.spec
                done = spec.max_restarts - self._remaining_restarts + 1
                print(f"torchtrain: worker failure ({_describe_failures(failures)}); restarting the workers "
                      f"(restart {done} of {spec.max_restarts})", file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor


def _job(trainer_args: list[str]):
    """The job's config (None when it cannot be parsed: the trainer then reports the error itself)."""
    from torchtrain.config import ConfigError, parse_args

    try:
        return parse_args(trainer_args)
    except ConfigError:
        return None


def hang_report(job) -> str:
    """The newest hang summary of the job's run folder."""
    from torchtrain.distributed.replica_ft import run_folder

    folder = run_folder(job.job.dump_folder, job.fault) if job is not None else "."
    found = sorted(glob.glob(os.path.join(folder, "hangs", "*", "summary.txt")))
    if not found:
        return f"hang detected; the stacks are under {os.path.join(folder, 'hangs')}"
    with open(found[-1]) as f:
        return f.read().strip() + f"\nstacks: {os.path.dirname(found[-1])}"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if "LOGLEVEL" not in os.environ:  # the agent's lines ("Sending process ... closing signal", "failed
        # (exitcode: 2)") repeat what the launcher reports in one line
        logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(logging.CRITICAL)

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    job = _job(args.training_script_args) if args.training_script == "torchtrain.train" else None
    explicit = any(a.split("=")[0] in ("--max-restarts", "--max_restarts") for a in argv)
    if job is not None and not explicit:
        args.max_restarts = job.fault.max_restarts
    install_restart_policy()
    try:
        run(args)
    except ChildFailedError as e:
        if any(f.exitcode == exit_codes.HANG for f in e.failures.values()):
            print(f"torchtrain: {hang_report(job)}", file=sys.stderr, flush=True)
            return exit_codes.HANG
        final = final_status(e.failures)
        if final is not None:
            return final  # the workers printed the one-line reason already
        print(f"torchtrain: training failed ({_describe_failures(e.failures)})\n{e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
