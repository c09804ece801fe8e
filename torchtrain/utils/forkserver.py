"""The launcher's forkserver, forked from the launcher itself (`torchtrain/launcher.py`, "forkserver" in its doc).

On a machine without a visible GPU the launcher's workers start from multiprocessing's forkserver. Started the
usual way, that server is a fresh interpreter that imports torch and the trainer again (2-3 s of CPU); here it is
the launcher forked once it has imported them and before it runs any thread, so every worker forked from it starts
warm. The server and multiprocessing's resource tracker ignore the workers' signals (`WORKER_SIGNALS`), so a signal
to the whole process group cannot end them under the workers (a worker's save would be interrupted).
"""

from __future__ import annotations

import gc
import os
import signal

# Signals meant for the workers: the forkserver and the resource tracker start with them ignored.
WORKER_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def ensure_forkserver(preload: list[str]) -> None:
    """Start the forkserver (and the resource tracker it starts first), unless running, with the workers'
    signals ignored: a process inherits ignored signals, so neither dies of a signal sent to the whole
    process group. The forkserver is the parent of every worker, and torch.multiprocessing gives each
    worker a parent-death signal of SIGINT: the server's death would interrupt every worker wherever it is,
    in a checkpoint save too. Both still end when the launcher has gone: the server by its own parent-death
    signal (`_end_with`), the tracker when its pipe closes.

    The server is this process forked (`_fork_server`), after it imported `preload` (what the server preloads), rather than
    a fresh interpreter importing torch and the trainer again: that import is most of a small CPU job's start-up.
    This process has started no thread yet (the agent starts its own later), so the fork is safe."""
    import importlib
    import multiprocessing.forkserver
    from multiprocessing import util

    for module in preload:
        importlib.import_module(module)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in WORKER_SIGNALS}
    spawn = util.spawnv_passfds
    util.spawnv_passfds = lambda path, args, passfds: (_fork_server(args, passfds) if _is_server(args)
                                                       else spawn(path, args, passfds))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawn
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _is_server(args: list[str]) -> bool:
    return "-c" in args and "multiprocessing.forkserver import main" in args[args.index("-c") + 1]


SERVER_NAME = "forkserver"
"""The forked server's process name (what `pgrep -x forkserver` finds; its command line is the launcher's)."""


def _prctl(option: int, value) -> bool:
    """Linux's prctl(option, value) for this process; False where there is none."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def set_process_name(name: str) -> None:
    """This process's name as `ps` and `pgrep` show it (Linux prctl; elsewhere unchanged)."""
    _prctl(15, name.encode()[:15])  # PR_SET_NAME


def _end_with(parent: int) -> None:
    """This process ends (SIGKILL) when `parent`, the launcher, does, however it ends (kill -9, the OOM killer).
    The server's pipe from the launcher is not enough: every worker holds a copy of the launcher's end (multiprocessing
    hands it on), so the pipe stays open as long as the workers live, and they would train on, headless, beside the
    next launch in the same folder. The server's death gives each worker its parent-death signal (SIGINT, which a
    checkpoint save defers: `components/checkpoint/preemption.py`), and the workers end too. Linux (prctl); elsewhere
    the pipe alone."""
    if _prctl(1, signal.SIGKILL) and os.getppid() != parent:  # PR_SET_PDEATHSIG; the launcher ended before it
        os._exit(0)


def _fork_server(args: list[str], passfds) -> int:
    """multiprocessing's start of the forkserver (`python -c "from multiprocessing.forkserver import main;
    main(...)"` with `passfds` open) done by forking this process: the child keeps only its standard streams and
    `passfds`, and runs the same command in the interpreter it already has."""
    code = args[args.index("-c") + 1]
    launcher = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: the server, until its last client has gone (SystemExit) or the launcher has
        _end_with(launcher)
        import multiprocessing.forkserver

        # The parent is inside ForkServer.ensure_running, holding its lock: the server (and every worker it forks)
        # starts with the state a fresh interpreter has, so that a worker's own forkserver (a data loader's) starts.
        multiprocessing.forkserver._forkserver.__init__()
        # What it has imported (torch, the trainer) outlives every worker: kept out of the cyclic collector's reach
        # (gc.freeze), a worker's full collections scan only its own objects and leave the shared pages unwritten.
        gc.collect()
        gc.freeze()
        set_process_name(SERVER_NAME)
        keep = sorted({0, 1, 2, *passfds})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            if high > low + 1:  # (closerange(n, n) would close every descriptor on some Pythons)
                os.closerange(low + 1, high)
        exec(code, {"__name__": "__forkserver__"})
    except SystemExit:
        pass
    except BaseException:  # the server failed: say why (its clients then start one the usual way)
        import traceback

        traceback.print_exc()
    finally:
        os._exit(0)
