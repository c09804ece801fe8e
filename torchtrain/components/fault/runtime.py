"""The trainer's side of [fault]: phase boundaries in; heartbeats, compute clocks, restart counts out.

`FaultRuntime.phase` is the PhaseTimer's listener, so every phase boundary the trainer and the
TrainStep already mark (data, forward_backward, optimizer, validation, checkpoint, profiler, and the
time between them) reaches the hang monitor (`monitor.py`) and the straggler clock (`straggler.py`)
with no further calls in the loop. Straggler windows are exchanged through the job's TCPStore, one
slot per rank: each rank posts its window at the start of the step after it, and rank 0 compares the
ranks one step later (by then every rank has passed a collective of the step it posted in, so all
reports are there; a slot not yet filled is simply read at a later step).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Callable, Protocol

import torch

from torchtrain.components.fault.monitor import HangMonitor, connect_store
from torchtrain.components.fault.straggler import KernelClock, ThreadClock, compare
from torchtrain.config.fault import Fault
from torchtrain.config.job import Debug
from torchtrain.utils import extensions
from torchtrain.utils.logging import logger


def restart_count() -> tuple[int, int]:
    """(this attempt's restart number, torchrun's --max-restarts); (0, 0) outside torchrun."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)))


def busy_compute(seconds: float, device: torch.device) -> None:
    """Work (not sleep) for `seconds`: a CPU busy loop on this thread's CPU time, or a GPU sleep kernel."""
    if device.type == "cuda":
        khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 1_500_000)
        torch.cuda._sleep(int(seconds * khz * 1000))
        return
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's words


def _peer_gone(error: BaseException) -> bool:
    """A collective failed because another rank's process ended (gloo), or the communicator failed (NCCL)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(error, dist_error) or (isinstance(error, RuntimeError) and any(t in str(error) for t in PEER_GONE))


def _one_client(connect: Callable[[], Any]) -> Callable[[], Any]:
    """`connect`, made once and shared: the hang monitor's thread and the straggler windows (training thread) use
    one client of the job's store, whichever asks first (their operations never block: checks, sets, reads of keys
    already there). Every connection is one more socket on the agent's server per rank, and one more lookup of the
    peer's name at both ends (torch's store resolves the addresses as it connects)."""
    lock, made = threading.Lock(), []

    def get():
        with lock:
            if not made:
                made.append(connect())
            return made[0]

    return get


class StepCounter(Protocol):
    """What the runtime reads of the run's state (the trainer's `TrainState`): the current step."""

    step: int


class FaultRuntime:
    def __init__(self, cfg: Fault, debug: Debug, dump_folder: str, state: StepCounter, device: torch.device,
                 rank: int, world_size: int, user_profiler: bool):
        self.cfg, self.state, self.device, self.dump_folder = cfg, state, device, dump_folder
        self.rank, self.world_size = rank, world_size
        self.restart, self.max_restarts = restart_count()
        if self.restart:
            budget = (f" (at most {cfg.max_restarts} within {cfg.restart_window_s:g} s: fault.restart_window_s)"
                      if cfg.restart_window_s else f" of {self.max_restarts} (torchrun --max-restarts)")
            logger.warning("restart %d%s: resuming from the newest complete checkpoint", self.restart, budget)
        self.delay = debug.inject_delay_s if rank in debug.inject_delay_ranks else 0.0
        self._first: int | None = None
        self._step = -1
        timeout = cfg.slow_phase_timeout_s
        self.monitor = None
        store = _one_client(lambda: connect_store(timeout))
        if cfg.hang_timeout_s is not None:
            local, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            node = range(rank - local, rank - local + local_world)
            self.monitor = HangMonitor(store, rank, node, world_size, dump_folder,
                                       cfg.hang_timeout_s, cfg.slow_phase_timeout_s)
        self.clock, self.store = None, None
        if cfg.straggler_freq and world_size > 1:
            if device.type == "cuda" and user_profiler:
                logger.info("straggler detection is off while [profiling] traces are recorded (one profiler at a time)")
            else:
                self.clock = KernelClock(device) if device.type == "cuda" else ThreadClock()
                self.store = store()
        self._measured = 0
        self._pending: list[tuple[int, int]] = []  # rank 0: (window, step it was posted at)
        self._result: dict | None = None

    # ------------------------------------------------------------------ the PhaseTimer's listener
    def phase(self, name: str | None) -> None:
        step = self.state.step
        if name == "data" and step != self._step:
            self._new_step(step)
        if self.monitor is not None:
            self.monitor.progress(step, name or "other")
        if self.clock is not None:
            self.clock.switch(name)
        if name == "forward_backward" and self.delay:
            busy_compute(self.delay, self.device)
        if name is not None:  # plugins (utils/extensions.py)
            extensions.call("phase", rank=self.rank, step=step, phase=name, dump_folder=self.dump_folder)

    def mark(self, phase: str) -> None:
        """Work outside the PhaseTimer's phases: "checkpoint" (a guard rollback's restore), "quorum" (waiting
        for the replica groups under fault.replica_ft) -- both slow phases for the hang monitor --, and "rollout"
        (GRPO's sampling and rewards, marked at every token step and completion: progress within the data phase)."""
        if self.monitor is not None:
            self.monitor.progress(self.state.step, phase)

    def _new_step(self, step: int) -> None:
        self._step = step
        if self._first is None:
            self._first = step
        elif self.monitor is not None:
            self.monitor.started = True  # the first step of this process is done: normal limits from now
        if self.clock is None:
            return
        freq = self.cfg.straggler_freq
        if step == self._first + 1:  # the first step (compilation, warm-up) is not measured
            self.clock.take()
            self._measured = 0
        elif (step - 1) % freq == 0 and self._measured:
            window = (step - 1) // freq
            self.store.set(self._slot(self.rank, window), json.dumps({
                "window": window, "phases": self.clock.take(), "steps": self._measured,
                "host": socket.gethostname()}))
            self._measured = 0
            if self.rank == 0:
                self._pending.append((window, step))
        if self.rank == 0:
            self._collect(step)
        self._measured += 1 if isinstance(self.clock, ThreadClock) else int(step % freq == 0)
        self.clock.step_begins(sampled=step % freq == 0)

    @staticmethod
    def _slot(rank: int, window: int) -> str:
        # Two slots per rank, alternating: window w is overwritten only by w + 2, posted at least two
        # steps after rank 0 could read w.
        return f"strag/{rank}/{window % 2}"

    def _collect(self, step: int) -> None:
        """Rank 0: compare the ranks' reports of each window posted before this step, once all are in."""
        while self._pending and self._pending[0][1] < step:
            window = self._pending[0][0]
            keys = [self._slot(r, window) for r in range(self.world_size)]
            if not self.store.check(keys):
                return
            reports = {r: json.loads(v) for r, v in enumerate(self.store.multi_get(keys))}
            if any(w["window"] < window for w in reports.values()):
                return  # not every rank has posted it yet: read again at the next step
            self._pending.pop(0)
            self._report(window, reports)

    def _report(self, window: int, reports: dict[int, dict]) -> None:
        found, summary = compare(reports, self.cfg.straggler_threshold)
        freq = self.cfg.straggler_freq
        span = f"steps {(window - 1) * freq + 1}-{window * freq}"
        for s in found:
            logger.warning("straggler (%s): %s", span, s.describe())
        self._result = {**summary, "straggler_count": len(found)}
        if found:
            worst = found[0]
            self._result.update(straggler_rank=worst.rank, straggler_host=worst.host, straggler_phase=worst.phase,
                                straggler_slowdown=worst.slowdown)

    # ------------------------------------------------------------------ metrics, shutdown
    def record(self) -> dict:
        """Metrics of this logged step: the restart number, and the latest straggler comparison."""
        out = {"restarts": self.restart} if self.restart or self.max_restarts else {}
        failed = self.clock.failed if self.clock is not None else None
        if failed:
            logger.warning("straggler detection stopped: the kernel timing failed (%s)", failed)
            self.clock = None
        if self._result is not None:
            out.update(self._result)
            self._result = None
        return out

    def on_error(self, error: BaseException) -> None:
        """The training thread failed. When the failure is a peer gone while a hang is handled, end as a
        hang (exit 4), not as a crash: see HangMonitor.hold_for_hang_exit."""
        if self.monitor is not None:
            # a peer gone from a collective may be the first sign of a hang the monitor declares within an
            # interval; any other error ends the process at once (unless a hang is already being handled)
            self.monitor.hold_for_hang_exit(2 * self.monitor.interval if _peer_gone(error) else 0.0)

    def finish(self) -> None:
        """The training loop has ended normally: no hang is declared from now on (monitor.py)."""
        if self.monitor is not None:
            self.monitor.finish()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
