"""Preemption: turn a signal on any rank into one coordinated save-and-exit of every rank.

A signal can arrive on one rank (a process killed by the scheduler or the OOM handler of one node),
on all of them, or twice (SLURM signals every process of the step and torchrun forwards the SIGTERM
it received to its workers as well). So the handler does nothing but set a flag: no I/O, no
collective, nothing that could interrupt a save in progress. At each step boundary the ranks
all-reduce the flag (MAX) over the checkpoint process group (`CheckpointManager._agree`); when it is set anywhere, every rank
sees it at the same step, and they save a checkpoint, flush metrics and exit 0 together.

A signal that arrives while a rank is blocked inside a collective waits (Python runs handlers between
byte-codes of the main thread), which is harmless here: the flag is read at the next step boundary.

`DeferredSignals` protects a save from every other signal that would end the process: while a
checkpoint is written, SIGINT (a KeyboardInterrupt: Ctrl-C, or the parent-death signal that
torch.multiprocessing gives its workers when their parent dies), and SIGTERM, SIGHUP, SIGQUIT,
SIGUSR1, SIGUSR2 when they still have their default action, only record their arrival. When the save
is done the handlers are put back and each recorded signal is raised again, so it is honoured right
after the save instead of leaving a half-written checkpoint behind.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from torchtrain.utils.logging import logger


class PreemptionWatcher:
    def __init__(self, signal_names: list[str]):
        self.requested = False
        self.received: list[str] = []
        self._previous: dict[int, object] = {}
        for name in signal_names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: a second signal during a save must not disturb it.
        self.requested = True
        self.received.append(signal.Signals(signum).name)

    def restore(self) -> None:
        """Put the previous handlers back (at shutdown)."""
        for signum, handler in self._previous.items():
            try:
                signal.signal(signum, handler)
            except (TypeError, ValueError) as e:  # e.g. not in the main thread
                logger.warning("could not restore the handler of signal %d: %s", signum, e)
        self._previous.clear()


# Signals that end a process by default (SIGINT: by a KeyboardInterrupt), deferred during a save.
ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


class DeferredSignals:
    """`with DeferredSignals(what):` no signal that would end the process interrupts the block; the ones
    that arrived are raised again, in order, when it ends (see the module docstring). Signals handled
    otherwise (the preemption flag, ignored ones) keep their handlers. Only the main thread can change
    signal handlers: elsewhere the block runs unprotected."""

    def __init__(self, what: str):
        self.what = what
        self.arrived: list[int] = []
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.arrived.append(signum)

    def __enter__(self) -> "DeferredSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in ENDING_SIGNALS:
            handler = signal.getsignal(signum)
            if handler in (signal.SIG_DFL, signal.default_int_handler):
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        arrived, self.arrived = self.arrived, []
        for signum in dict.fromkeys(arrived):  # each signal once, in order of arrival
            logger.warning("%s arrived during %s: honoured now that it is done", signal.Signals(signum).name,
                           self.what)
            signal.raise_signal(signum)
