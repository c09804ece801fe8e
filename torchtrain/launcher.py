"""torchrun, with the job's restart policy and clean failure reports:

    python -m torchtrain.launcher [torchrun options] -m torchtrain.train --job.config_file JOB.toml [...]

run_train.sh and scripts/multinode_trainer.slurm start training through this module instead of the
`torchrun` command. It runs torchrun itself (`torch.distributed.run`, in this process) and adds:

* the job's `fault.max_restarts` as `--max-restarts` (unless the command line sets it): a crashed,
  killed or hung worker group is restarted by torchrun's elastic agent and resumes from the newest
  complete checkpoint (docs/resilience.md); with `fault.restart_window_s`, the restarts are counted within that
  window instead (`worker_failures.RestartBudget`);
* no restart after a final failure: a worker that exits with a config error (2), a guard abort (3) or
  failing checkpoint saves (5) would fail the same way again, so the agent's remaining restarts are
  dropped (a private hook, on the agent's worker monitoring; where a future torch lacks it, such
  failures are simply restarted until the restarts run out);
* one line per restart, naming the failed ranks and their exit statuses;
* clean exits: when every failed worker already explained itself (config error, guard abort, failing
  checkpoint saves) the launcher exits with that status and no traceback of its own (torchrun would
  add its ChildFailedError traceback); after a detected hang it prints the hang summary and exits 4; any
  other failure prints torchrun's failure report, without the launcher's traceback, and exits 1.
  The agent's own log lines are silenced (they repeat these reports); set $LOGLEVEL (e.g. INFO) to
  see them;
* every rank's output kept with the run: torchrun's files of each local rank (run_train.sh tees every rank's
  stdout and stderr; the console shows LOG_RANK's) and a failed rank's error record go to the job's run folder,
  `rank_logs/<host>/` (`keep_rank_logs`), instead of a new temporary folder per launch that nothing removes (a Python
  file's launch keeps them in a temporary folder, removed when it succeeds);
* on a machine without a visible GPU, the workers of `-m torchtrain.train`, or of a Python file (a loop
  of the user's own: `torchtrain.accelerate`), start from a forkserver (`--start-method forkserver`, `utils/forkserver.py`;
  torchrun's function entry points `_worker` and `_script_worker`): the launcher imports torch and the
  trainer once and, before the agent starts any thread, forks itself into the single-threaded server,
  which forks every worker from itself, instead of each worker (and the server) starting a fresh
  interpreter that imports them again (2-3 s of CPU a process: most of a small job's start-up when the
  workers outnumber the cores). A file runs as `python FILE ARGS` would run it: as `__main__`, with its
  folder first on `sys.path` and `sys.argv` set. The agent itself is never forked once it runs threads.
  An explicit `--start-method` (e.g. `spawn`) keeps torchrun's own way;
* signals that let a preemption save finish (docs/checkpointing.md, Preemption): torchrun answers the
  first SIGTERM (SIGINT, SIGHUP, SIGQUIT) by passing it to the workers and waiting for them; a repeat
  of it while they save and stop is ignored instead of ending the agent (whose death would interrupt
  the workers' save). SIGUSR1 and SIGUSR2, which torchrun does not handle and which would otherwise kill
  it, are passed on to the workers (unless they are ignored, as the SLURM script does). The forkserver,
  the parent of the workers it forks, and multiprocessing's resource tracker start with all of these
  ignored, so a signal to the whole process group cannot end them under the workers; the server dies with
  the launcher all the same (a kill -9 of the launcher ends every worker: `utils/forkserver.py::_end_with`). The
  launcher then exits with 128 + the signal's number and one line, without a traceback;
* the workers' stores (`distributed/agent_stores.py`): each start of the workers counted in the agents' shared
  store, or, for an elastic range of nodes (`--nnodes MIN:MAX`), a store per rendezvous round, so that a node can
  join a running job as well as leave it.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from torchtrain.distributed.agent_stores import install_start_count, store_per_round
from torchtrain.utils import elastic_events, exit_codes
from torchtrain.utils.cpu_threads import choose_threads
from torchtrain.utils.forkserver import WORKER_SIGNALS, ensure_forkserver, set_process_name
from torchtrain.utils.process_exit import run_exit_handlers
from torchtrain.utils.worker_failures import (
    UNBOUNDED_RESTARTS,
    RestartBudget,
    describe_failures,
    final_status,
    install_restart_policy,
)


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


# What the forkserver imports before it forks a worker: the trainer (and torch), and torch._dynamo (a first tensor init's).
FORKSERVER_PRELOAD = ["torchtrain.train", "torch._dynamo"]
RANK_LOGS = "rank_logs"
"""The run folder's sub-folder of torchrun's per-rank files, by host (the nodes of a job share the run folder):
`<host>/<run id>_<suffix>/attempt_<restart>/<local rank>/` `stdout.log` and `stderr.log` (run_train.sh tees every
rank's output there; the console shows LOG_RANK's), and a failed rank's `error.json`."""
RDZV_ID_UNSET = "none"
"""torchrun's rendezvous id where neither `--rdzv-id` nor PET_RDZV_ID gives one."""
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
"""Signals torchrun does not handle, passed on to the workers."""


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc; empty where it cannot be read)."""
    found: list[int] = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(task) as f:
                found += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return found


def _forward_to_workers(signum: int, frame) -> None:
    """SIGUSR1 / SIGUSR2 at the launcher: pass it on to the workers -- its children, and the children of
    its forkserver (which ignores the signal itself)."""
    for child in _children(os.getpid()):
        for pid in [child, *_children(child)]:
            try:
                os.kill(pid, signum)
            except OSError:
                pass


def install_signal_policy() -> None:
    """A repeated stop signal leaves the agent waiting for its workers; SIGUSR1/2 are passed on (module
    docstring). Two private hooks: torchrun's handler, looked up by name when torchrun installs it at
    every start of the workers (where a future torch lacks it, a repeat ends the agent as before); and the
    shutdown of function workers (the forkserver's): a worker that returned waits until the agent has read
    its result, which an agent that is shutting down never does, so the shutdown releases them first
    (else a worker that finished its preemption save would wait for the agent's SIGKILL, 30 s later)."""
    from torch.distributed.elastic.multiprocessing import api

    close = getattr(api.MultiprocessContext, "_close", None)
    if close is not None and not getattr(close, "torchtrain_release", False):
        def close_releasing(self, *args, **kwargs):
            finished = getattr(self, "_worker_finished_event", None)
            if finished is not None:
                finished.set()
            return close(self, *args, **kwargs)

        close_releasing.torchtrain_release = True
        api.MultiprocessContext._close = close_releasing

    original = getattr(api, "_terminate_process_handler", None)
    if original is not None and not getattr(original, "torchtrain_once", False):
        received: list[int] = []

        def terminate_once(signum: int, frame) -> None:
            if received:  # the workers are stopping (saving) already: let them finish
                return
            received.append(signum)
            original(signum, frame)

        terminate_once.torchtrain_once = True
        api._terminate_process_handler = terminate_once
    for signum in FORWARDED_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _forward_to_workers)


def _given(argv: list[str], *options: str) -> bool:
    """Whether the command line sets one of torchrun's `options` (each in both spellings, `--a-b` and `--a_b`)."""
    names = {n for o in options for n in (o, "--" + o[2:].replace("-", "_"))}
    return any(a.split("=")[0] in names for a in argv)


def keep_rank_logs(args, argv: list[str], job) -> str | None:
    """Where torchrun keeps its files of each local rank (its teed stdout and stderr, a failed rank's error record):
    a training job's run folder, `RANK_LOGS`; a Python file's launch, a temporary folder returned to be removed after
    a launch that succeeds (torchrun's own would stay behind after every launch); a --log-dir or --logs-specs on the
    command line keeps its own. In the folder, torchrun names each launch `<rendezvous id>_<random>`: a one-node job
    without an id of its own gets the launch's date and time (`20261205-113000_...`: the launches sort in time)."""
    from torchtrain.distributed.replica_ft import run_folder

    if _given(argv, "--log-dir", "--logs-specs"):
        return None
    if job is not None:
        args.log_dir = os.path.join(run_folder(job.job.dump_folder, job.fault), RANK_LOGS, socket.gethostname())
        if args.rdzv_id == RDZV_ID_UNSET and args.nnodes in ("1", "1:1") and not args.standalone:
            args.rdzv_id = time.strftime("%Y%m%d-%H%M%S")  # (one node: no other agent has to agree on it)
        return None
    args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    return args.log_dir


def _runs_python_file(args) -> bool:
    """`torchrun FILE.py ARGS`: a Python file run by the interpreter (not a module, not --no-python)."""
    return not args.module and not args.no_python and args.training_script.endswith(".py")


def _runs_trainer(args) -> bool:
    return bool(args.module) and args.training_script == "torchtrain.train"


def choose_start_method(args, argv: list[str]) -> None:
    """Start the workers of the trainer or of a Python file from a forkserver on a machine without a
    visible GPU, unless the command line names a start method. With CUDA the workers start as torchrun
    starts them."""
    if not _given(argv, "--start-method") and (_runs_trainer(args) or _runs_python_file(args)):
        import torch

        if not torch.cuda.is_available():
            args.start_method = "forkserver"


def _default_threads(args) -> None:
    """Without a visible GPU: each local worker's thread count, unless OMP_NUM_THREADS is set (utils/cpu_threads.py;
    torchrun itself would give every worker of a multi-process node one thread, and one process all the cores torch
    sees)."""
    import torch

    if not torch.cuda.is_available():
        nproc = str(args.nproc_per_node)
        choose_threads(int(nproc) if nproc.isdigit() else 1)


def uses_forkserver(args) -> bool:
    """`--start-method forkserver` with `-m torchtrain.train` or a Python file, on a c10d rendezvous
    (run_train.sh's one-node one, --standalone, or a multi-node endpoint). torchrun itself honours the
    start method only for a function entry point; other workers start as fresh interpreters."""
    return (args.start_method == "forkserver" and (_runs_trainer(args) or _runs_python_file(args))
            and (args.standalone or args.rdzv_backend == "c10d"))


def _as_fresh_worker() -> None:
    """A forked worker's signals and thread count, as a fresh interpreter of its own would have them."""
    import torch

    set_process_name("python")  # not the server's name
    for sig in WORKER_SIGNALS:  # the forkserver ignores them
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the worker's thread count from its own
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # environment, not the server's


def _worker(*argv: str) -> None:
    """One worker forked by the forkserver: the trainer's command, as a fresh interpreter would run it.
    It returns like a function (the agent collects the result); a failure leaves with the trainer's
    exit status."""
    from torchtrain import train

    _as_fresh_worker()
    _end_worker(train.main(list(argv)))


def _script_worker(script: str, *argv: str) -> None:
    """One worker forked by the forkserver running a Python file as `python FILE ARGS` would. The file
    ends like a function too: its `sys.exit(code)` or `exit_process(code)` (utils/process_exit.py, which
    returns through SystemExit here instead of leaving the process) becomes the worker's status."""
    import runpy

    from torchtrain.utils import process_exit

    _as_fresh_worker()
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    process_exit.EXIT_BY_SYSTEM_EXIT = True
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    _end_worker(code)


def _end_worker(code) -> None:
    """A forked worker's end: its exit handlers run (TensorBoard, logging), then it returns to the agent,
    or leaves with `code` when that is a failure."""
    run_exit_handlers()
    if code:
        sys.exit(code)


def start_forkserver(args):
    """torchrun's launch config; the forkserver starts now (unless it did already), before the agent meets
    the other nodes."""
    import multiprocessing
    import uuid

    from torch.distributed.run import config_from_args

    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(args)  # sets OMP_NUM_THREADS: each worker applies its own (_worker)
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    ensure_forkserver(FORKSERVER_PRELOAD)
    return config


def run_forkserver(config, args) -> None:
    from torch.distributed.launcher.api import elastic_launch

    # the entry points by their importable names (this file may run as __main__)
    from torchtrain.launcher import _script_worker, _worker

    if _runs_trainer(args):
        elastic_launch(config=config, entrypoint=_worker)(*args.training_script_args)
    else:
        elastic_launch(config=config, entrypoint=_script_worker)(args.training_script, *args.training_script_args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    from torch.distributed.run import parse_args

    from torchtrain.components.fault.replica_check import excluded_here

    if "LOGLEVEL" not in os.environ:  # the agent's lines ("Sending process ... closing signal", "failed
        # (exitcode: 2)") repeat what the launcher reports in one line
        logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(logging.CRITICAL)

    args = parse_args(argv)
    _default_threads(args)
    job = _job(args.training_script_args) if args.training_script == "torchtrain.train" else None
    refusal = excluded_here(job.fault.sdc_exclude_file) if job is not None else None
    if refusal:  # never on a host a replica check suspects (before any worker starts)
        print(f"torchtrain: sdc: {refusal}", file=sys.stderr, flush=True)
        return exit_codes.SILENT_CORRUPTION
    if job is not None and not _given(argv, "--max-restarts"):
        args.max_restarts = job.fault.max_restarts
    budget = None
    if job is not None and job.fault.restart_window_s:  # the budget counts the restarts, not torchrun
        budget, args.max_restarts = RestartBudget(args.max_restarts, job.fault.restart_window_s), UNBOUNDED_RESTARTS
    temporary = keep_rank_logs(args, argv, job)
    store_per_round(args)
    choose_start_method(args, argv)
    elastic_events.install()
    install_start_count()
    config = start_forkserver(args) if uses_forkserver(args) else None
    install_restart_policy(budget)
    install_signal_policy()
    code = _launch(config, args, job)
    if temporary is not None and code == 0:
        shutil.rmtree(temporary, ignore_errors=True)
    return code


def _launch(config, args, job) -> int:
    """Run the agent; its outcome as the launcher's exit status, each failure reported in one place."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run_forkserver(config, args) if config is not None else run(args)
    except SignalException as e:
        print(f"torchtrain: stopped by {e.sigval.name}: the workers were passed the signal and have ended (with "
              f"checkpoint.preemption_signals they saved a checkpoint first; the same command resumes)",
              file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if any(f.exitcode == exit_codes.HANG for f in e.failures.values()):
            print(f"torchtrain: {hang_report(job)}", file=sys.stderr, flush=True)
            return exit_codes.HANG
        final = final_status(e.failures)
        if final is not None:
            return final  # the workers printed the one-line reason already
        logs = f"\nevery rank's output: {args.log_dir}" if args.log_dir else ""
        print(f"torchtrain: training failed ({describe_failures(e.failures)})\n{e}{logs}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from torchtrain.utils.process_exit import exit_process

    exit_process(main())
