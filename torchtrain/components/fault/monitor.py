"""Hang detection with evidence: a heartbeat per phase, watched outside the training process group.

Each rank's training thread only records its progress in memory (`progress(step, phase)`: three
attribute writes at every phase boundary, nothing else). A daemon thread per rank publishes it to the
job's TCPStore (torchrun's agent store, which lives in the launcher, so it keeps answering while
workers hang) every `interval` seconds and watches the heartbeats of the ranks on its own node:

    age(r) = the age of r's progress when r last published + the time since its publication changed
             (measured on the watcher's own clock, so hosts need no synchronised clocks)

A rank whose age exceeds its limit (`hang_timeout_s`, or `slow_phase_timeout_s` in start-up until the
first step is done, checkpoint, validation, the replica groups' quorum and shutdown) is hung. The first watcher to see one
declares the hang once for the whole job (`compare_set` of one store key) with every rank's
heartbeat, read twice one interval apart (a rank whose publication did not change has a monitor
thread that does not run: the process is stopped, dead, or stuck outside Python). Then every rank
that can:

1. writes `{dump_folder}/hangs/<time>/rank-<r>.txt`: its heartbeat and all its threads' Python
   stacks (faulthandler), and on CUDA `rank-<r>.nccl_trace.pkl`, the NCCL flight recorder;
2. reports where its training thread is and whether it waits inside torch.distributed;
3. continues a stopped process (Linux state T) on its own host with SIGCONT, so that the stopped
   rank's monitor thread writes its stacks too (the job ends anyway);
4. after a grace period, the declaring rank writes `summary.txt` / `summary.json`: the stuck ranks
   (those that did not answer, and those not waiting inside torch.distributed) and where each rank
   is; rank 0 and the declaring rank log it. A rank that never answered and runs on this host is
   killed (SIGKILL: it cannot act on SIGTERM, and torchrun would wait 30 s for it);
5. exits with status 4 (`utils/exit_codes.HANG`), so torchrun restarts the job (fault.max_restarts)
   or the launcher reports the hang.

A finished run is never restarted. Once a rank's training loop has ended (`finish`: every step trained
and the last checkpoint saved, or a preemption stop) it sets a job-wide key, and from then on no
watcher declares a hang; a hang declared before that whose stuck ranks go on again (a stopped process
that the monitor continued) is waited for while every rank makes progress, and when the loop ends in
the meantime, every rank logs that the hang resolved and carries on to a normal exit. A rank found
stale that makes progress again while the declaration is prepared (the two reads below) is a stall:
logged with its duration, and nothing is declared.

Cost: nothing on the training thread beyond the in-memory record; per rank one store write and one
read of the node's heartbeats per interval (interval = hang_timeout_s / 8, clipped to 0.25 .. 10 s).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from torchtrain.distributed.utils import agent_store, worker_start
from torchtrain.utils import exit_codes
from torchtrain.utils.logging import logger

SLOW_PHASES = ("startup", "checkpoint", "validation", "quorum", "shutdown")
HANG_KEY = "hang"
DONE_KEY = "done"  # set by the first rank whose training loop ended: no hang is declared after it


def connect_store(timeout_s: float) -> dist.Store:
    """A client of the job's rendezvous TCPStore (MASTER_ADDR:MASTER_PORT: torchrun's agent store, or
    the store init_process_group started in a one-process run), under a prefix of this start of the
    workers (`worker_start`: keys of an earlier attempt are never read)."""
    return agent_store(datetime.timedelta(seconds=timeout_s), f"torchtrain/start_{worker_start()}/fault/")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # torchtrain/


def _where(frame) -> tuple[str, bool]:
    """The training thread's position: innermost frame (and innermost torchtrain frame), and whether it
    is inside torch.distributed (waiting in a collective)."""
    if frame is None:
        return "?", False
    stack = traceback.extract_stack(frame)
    fmt = lambda f: f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"  # noqa: E731
    inner = stack[-1]
    ours = next((f for f in reversed(stack) if os.path.abspath(f.filename).startswith(_PACKAGE)), None)
    in_torch_dist = os.path.join("torch", "distributed") + os.sep
    # below the innermost torchtrain frame only: a worker started from a function (torchrun's function
    # entry points) also holds the frames of torchrun's agent (torch/distributed/elastic) above it
    below = stack[stack.index(ours) + 1:] if ours is not None else stack
    waiting = any(in_torch_dist in f.filename for f in below)
    text = fmt(inner) + (f" (from {fmt(ours)})" if ours is not None and ours is not inner else "")
    return text, waiting


def _proc_state(pid: int) -> str | None:
    """The Linux process state letter of a local process (R, S, D, T = stopped, Z, ...), if readable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _exit_as_hang() -> None:
    """End this process at once with the hang status (the training thread may be stuck in a collective)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(exit_codes.HANG)


class HangMonitor:
    def __init__(self, store_factory, rank: int, node_ranks: range, world_size: int, dump_folder: str,
                 timeout_s: float, slow_timeout_s: float):
        self.rank, self.world_size, self.node_ranks = rank, world_size, node_ranks
        self.dump_folder, self.timeout_s, self.slow_timeout_s = dump_folder, timeout_s, slow_timeout_s
        self.interval = min(max(timeout_s / 8, 0.25), 10.0)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._store_factory = store_factory
        self.step, self.phase, self._t = 0, "startup", time.monotonic()
        self.started = False  # the first step of this process is done (until then: start-up limits)
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self.handling = threading.Event()  # set when this rank starts acting on a declared hang
        self.finished = threading.Event()  # this rank's training loop has ended
        self.store = None
        self._seq = 0
        self._seen: dict[int, tuple[int, float, dict]] = {}
        self._thread = threading.Thread(target=self._run, name="torchtrain-hang-monitor", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread
    def progress(self, step: int, phase: str) -> None:
        self.step, self.phase, self._t = step, phase, time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self.handling.is_set() and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._grace() + 5.0)  # a hang that resolved: let it say so

    def finish(self) -> None:
        """Training thread: the training loop has ended (the last step and its checkpoint are done). From
        now on no hang is declared for the job, and a hang being handled ends without a restart."""
        self.finished.set()
        try:
            if self.store is not None:
                self.store.set(DONE_KEY, json.dumps({"rank": self.rank, "step": self.step}))
        except Exception as e:  # the store is gone: the job is ending anyway
            logger.debug("hang monitor: could not publish the end of training: %s", e)

    def _done(self) -> bool:
        return self.finished.is_set() or bool(self.store.check([DONE_KEY]))

    def hold_for_hang_exit(self, wait_s: float) -> None:
        """Training thread, on an exception: when a hang is being handled (or has been declared and this
        rank's monitor takes it up within `wait_s`), block until the monitor ends the process with the hang
        status.

        The first ranks to finish their dumps exit; a peer still inside a collective then sees gloo's
        "connection closed by peer" (NCCL: a communicator error) before its own monitor exits. Left to
        propagate, that error ends the peer as a crash (SIGABRT), and the job's report would blame the
        wrong thing. A hang is always declared in the store before any rank exits for it, so when the
        store holds no declaration the error is a crash (a peer killed, a rank's own exception) and this
        returns at once: torchrun restarts the job without waiting. Returns only when no hang is under way."""
        if not self._thread.is_alive():
            return
        if not self.handling.is_set() and not self._declared():
            return
        if not self.handling.wait(wait_s):
            return
        self._thread.join(timeout=self._grace() + 30.0)
        _exit_as_hang()  # the monitor thread died before it could

    def _declared(self) -> bool:
        """Whether the job's store holds a hang declaration (False when it cannot be read)."""
        try:
            return self.store is not None and bool(self.store.check([HANG_KEY]))
        except Exception:  # the store is gone: the launcher is stopping the job
            return False

    def _grace(self) -> float:
        """How long a rank waits for the others to write their stacks."""
        return max(3 * self.interval, 2.0)

    # ------------------------------------------------------------------ monitor thread
    def _limit(self) -> float:
        return self.slow_timeout_s if self.phase in SLOW_PHASES or not self.started else self.timeout_s

    def _key(self, rank: int) -> str:
        return f"hb/{rank}"

    def _run(self) -> None:
        try:
            self.store = self._store_factory()
            while not self._stop.is_set():
                self._publish()
                if self._done():
                    return  # the training loop has ended: nothing is declared from now on
                if self.store.check([HANG_KEY]):
                    self._on_hang()
                    return  # only returns when the run finished meanwhile
                stale = self._stale(self.node_ranks)
                if stale and not self._stop.is_set() and self._declare(stale):
                    self._on_hang()
                    return
                self._stop.wait(self.interval)
        except Exception as e:  # the store is gone (the launcher is stopping the job) or unreachable
            if not self._stop.is_set():
                logger.warning("hang monitor of rank %d stopped: %s: %s", self.rank, type(e).__name__, e)

    def _publish(self) -> None:
        self._seq += 1
        self.store.set(self._key(self.rank), json.dumps({
            "seq": self._seq, "step": self.step, "phase": self.phase, "age": time.monotonic() - self._t,
            "limit": self._limit(), "host": self.host, "pid": self.pid}))

    def _read(self, ranks) -> dict[int, dict]:
        keys = {r: self._key(r) for r in ranks}
        present = [r for r, k in keys.items() if self.store.check([k])]
        values = self.store.multi_get([keys[r] for r in present]) if present else []
        return {r: json.loads(v) for r, v in zip(present, values)}

    def _stale(self, ranks) -> list[int]:
        """Those of `ranks` (the watched ones: this node's) whose progress is older than their limit."""
        now = time.monotonic()
        stale = []
        for rank, hb in self._read(ranks).items():
            seq, seen, _ = self._seen.get(rank, (-1, now, hb))
            if hb["seq"] != seq:
                seen = now
            self._seen[rank] = (hb["seq"], seen, hb)
            if hb["age"] + (now - seen) > hb["limit"]:
                stale.append(rank)
        return stale

    def _declare(self, stale: list[int]) -> bool:
        """Declare the hang for the job (True), unless the training loop ended or every stale rank made
        progress again while its evidence was read (a stall: logged with its duration)."""
        noticed = {r: self._seen[r][2] for r in stale}
        t_noticed = time.monotonic()
        first = self._read(range(self.world_size))
        self._stop.wait(self.interval * 1.5)
        second = self._read(range(self.world_size))
        if self._done():
            return False
        recovered = [r for r in stale if r in second and second[r]["seq"] != first.get(r, {}).get("seq")
                     and second[r]["age"] < second[r]["limit"]]
        if recovered == stale:
            for r in stale:
                was = noticed[r]
                lasted = was["age"] + (time.monotonic() - t_noticed) - second[r]["age"]
                logger.warning("stall: rank %d made no progress for %.1f s at step %d (phase %s, limit %g s) and then "
                               "went on (now step %d, phase %s): not a hang, nothing restarted", r, lasted,
                               was["step"], was["phase"], was["limit"], second[r]["step"], second[r]["phase"])
            self._seen.clear()
            return False
        now = time.time()
        ranks = {}
        for r in range(self.world_size):
            hb = second.get(r)
            if hb is None:
                ranks[r] = {"reported": False}
                continue
            responsive = r not in first or first[r]["seq"] != hb["seq"]
            ranks[r] = {"reported": True, "step": hb["step"], "phase": hb["phase"], "host": hb["host"],
                        "pid": hb["pid"], "age_s": round(hb["age"], 2), "limit_s": hb["limit"],
                        "responsive": responsive}
            if not responsive and hb["host"] == self.host:
                ranks[r]["state"] = _proc_state(hb["pid"])
        decl = {"time": now, "tag": datetime.datetime.fromtimestamp(now).strftime("%Y%m%d-%H%M%S"),
                "declared_by": self.rank, "noticed": stale, "ranks": ranks}
        self.store.compare_set(HANG_KEY, "", json.dumps(decl))
        return True

    def _wait_publishing(self, seconds: float) -> None:
        """Wait, still publishing this rank's heartbeat (whether the job moves again is read from them)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not self.finished.is_set():
            self._publish()
            self.finished.wait(min(self.interval, left))

    def _finished_meanwhile(self) -> bool:
        """After a declared hang's grace: whether the training loop ended, waiting for it while every rank
        makes progress again (the stuck ones were continued), at most the slow-phase limit. A rank stale
        for one more grace period (a real hang: about 2 s more before the exit) ends the wait."""
        self._seen.clear()
        deadline = time.monotonic() + self.slow_timeout_s
        stale_since: dict[int, float] = {}
        while not self._done():
            self._publish()
            now = time.monotonic()
            stale_since = {r: stale_since.get(r, now) for r in self._stale(range(self.world_size))}
            if now > deadline or any(now - t >= self._grace() for t in stale_since.values()):
                return False
            self.finished.wait(self.interval)
        return True

    def _on_hang(self) -> None:
        """Dump this rank's evidence, wait for the others', summarise, and end the process."""
        self.handling.set()
        decl = json.loads(self.store.get(HANG_KEY))
        folder = os.path.join(self.dump_folder, "hangs", decl["tag"])
        os.makedirs(folder, exist_ok=True)
        where, waiting = _where(sys._current_frames().get(self._main))
        with open(os.path.join(folder, f"rank-{self.rank}.txt"), "w") as f:
            f.write(f"rank {self.rank} host {self.host} pid {self.pid}: step {self.step}, phase {self.phase}, "
                    f"{time.monotonic() - self._t:.1f} s without progress; training thread at {where}"
                    f"{' (waiting in torch.distributed)' if waiting else ''}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self._dump_flight_recorder(folder)
        self.store.set(f"ack/{self.rank}", json.dumps({"where": where, "waiting": waiting, "step": self.step,
                                                       "phase": self.phase, "age_s": time.monotonic() - self._t}))
        for info in decl["ranks"].values():  # a stopped process on this host: let it write its own stacks
            if info.get("state") == "T" and info.get("host") == self.host:
                try:
                    os.kill(info["pid"], signal.SIGCONT)
                except OSError:
                    pass
        self._wait_publishing(self._grace())  # the others write theirs
        if self._finished_meanwhile():
            step = max((info.get("step", 0) for info in decl["ranks"].values()), default=0)
            logger.warning("the hang declared by rank %d (step %d) resolved: the stuck rank(s) went on and training "
                           "finished; stacks in %s; not restarted", decl["declared_by"], step, folder)
            self.handling.clear()
            return
        acks = {}
        for r in range(self.world_size):
            if self.store.check([f"ack/{r}"]):
                acks[r] = json.loads(self.store.get(f"ack/{r}"))
        summary = summarize(decl, acks, self.host)
        if self.rank == decl["declared_by"]:
            with open(os.path.join(folder, "summary.json"), "w") as f:
                json.dump({**decl, "acks": {str(r): a for r, a in acks.items()}}, f, indent=1)
            with open(os.path.join(folder, "summary.txt"), "w") as f:
                f.write(summary + "\n")
        if self.rank in (0, decl["declared_by"]):
            logger.error("%s\nstacks: %s", summary, folder)
        for r, info in decl["ranks"].items():  # unanswered ranks on this host: end them now
            if int(r) not in acks and info.get("host") == self.host and info.get("pid"):
                try:
                    os.kill(info["pid"], signal.SIGKILL)
                except OSError:
                    pass
        _exit_as_hang()

    def _dump_flight_recorder(self, folder: str) -> None:
        """CUDA + NCCL: the flight recorder's record of recent collectives (when torch has it)."""
        dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
        if dump is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        try:
            data = dump()
        except Exception as e:  # no NCCL group, or the recorder is off (TORCH_NCCL_TRACE_BUFFER_SIZE=0)
            data = f"no flight recorder dump: {type(e).__name__}: {e}".encode()
        with open(os.path.join(folder, f"rank-{self.rank}.nccl_trace.pkl"), "wb") as f:
            f.write(data)


def summarize(decl: dict, acks: dict[int, dict], host: str) -> str:
    """The hang report: which ranks are stuck and where every rank is."""
    ranks = {int(r): v for r, v in decl["ranks"].items()}
    silent = [r for r in ranks if r not in acks]  # no stacks: stopped, dead, or not running Python
    busy = [r for r in acks if not acks[r]["waiting"]]  # somewhere else than in a collective
    stuck = sorted(silent + busy)
    lines = [f"hang detected (declared by rank {decl['declared_by']}): "
             + (f"stuck rank(s) {', '.join(map(str, stuck))}" if stuck else
                "every rank waits in torch.distributed: the ranks are in different collectives (compare the stacks)")]
    for r in sorted(ranks):
        info = ranks[r]
        if not info.get("reported"):
            lines.append(f"  rank {r}: never reported a heartbeat")
            continue
        ack = acks.get(r)
        now = ack or info  # a rank that answered says where it is now; else its last heartbeat
        head = (f"  rank {r} (host {info['host']}, pid {info['pid']}): step {now['step']} {now['phase']}, "
                f"{now['age_s']:.1f} s without progress (limit {info['limit_s']:g} s)")
        stopped = " (its process was stopped, state T; continued to write its stacks)" if info.get("state") == "T" else ""
        if ack is not None:
            state = ("waiting in a collective at " if ack["waiting"] else "at ") + ack["where"] + stopped
        else:
            proc = _proc_state(info["pid"]) if info["host"] == host else None
            state = ("did not respond: stopped, dead, or not running Python"
                     + (f" (process state {proc})" if proc else "") + "; its last heartbeat is shown")
        lines.append(f"{head}: {state}")
    return "\n".join(lines)
