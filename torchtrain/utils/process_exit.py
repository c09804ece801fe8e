"""How torchtrain's programs end: exit handlers, flushed output, then `os._exit` (no interpreter teardown)."""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from typing import NoReturn

# Set in a worker the launcher forked to run a Python file (launcher._script_worker): exit_process then
# raises SystemExit, which that worker returns as its status, instead of leaving the process.
EXIT_BY_SYSTEM_EXIT = False


def exit_process(code: int) -> NoReturn:
    """End this program with `code` without tearing down the interpreter.

    Once the process group is destroyed, Python's finalisation still destroys the C++ objects that
    module globals hold (c10d groups, stores, their threads). On torch 2.13 with gloo this aborts a
    worker now and then ("terminate called without an active exception", SIGABRT after a run that
    finished correctly; more often on a loaded machine), which torchrun reports as a failure. The
    teardown also costs about a second of CPU in any process that imported torch, which every launch,
    plan and dry run would pay. So after the Python exit handlers have run (they flush TensorBoard,
    logging and stop compile workers) the process leaves with os._exit, which skips only that final
    teardown. Everything the program writes is flushed and closed before it returns its exit code. (In
    a worker the launcher forked, which never finalises an interpreter of its own, it raises
    SystemExit(code) instead.)
    """
    if EXIT_BY_SYSTEM_EXIT:
        raise SystemExit(code)
    try:
        run_exit_handlers()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def run_exit_handlers() -> None:
    """Python's exit handlers, as the interpreter runs them at exit, less the operator libraries' unregistration.

    Every `torch.library.Library` (torch's own, compiled kernels', DTensor's, this package's custom operators)
    leaves a finalizer that unregisters its operators from the dispatcher at interpreter exit: 1-2 s of CPU in a
    process that imported the compile stack, for a dispatcher about to vanish with the process. Those finalizers
    are taken off the exit run (`weakref.finalize.atexit`); every other handler (TensorBoard, logging, temporary
    folders, compile workers) runs as usual. Only for a process that ends right after (os._exit or a forked
    worker's return to its server)."""
    for finalizer in list(weakref.finalize._registry):  # the pending finalizers (CPython's registry)
        pending = finalizer.peek()
        if pending is not None and pending[1].__module__ == "torch.library":
            finalizer.atexit = False
    atexit._run_exitfuncs()
