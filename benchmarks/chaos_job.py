"""The job of the chaos benchmark (benchmarks/chaos.py), launched and followed from outside: its command, its
launches (each in a process group of its own, as under a scheduler), its metrics as they are written, its
checkpoints, its training processes' pids (written by the test plugin into the control folder).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field

from torchtrain.utils.forkserver import SERVER_NAME

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "8", "--model.n_kv_heads", "4",
         "--model.vocab_size", "512", "--training.dataset", "synthetic", "--training.seq_len", "64",
         "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
         "--job.print_config", "false"]
STRAGGLER_FREQ, HANG_S = 10, 4.0


SDC_FREQ = 5


def job(dump: str, steps: int, interval: int, nproc: int) -> list[str]:
    """The job: HSDP with two replicas (their parameters compared every SDC_FREQ steps and before each save: a
    flipped bit is caught), deterministic kernels, checkpoints every `interval` steps, every detector on."""
    replicas = 2 if nproc % 2 == 0 else 1
    return [*MODEL, "--parallelism.data_parallel_replicate_degree", str(replicas), "--fault.sdc_check_freq",
            str(SDC_FREQ), "--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--debug.deterministic", "--job.dump_folder", dump, "--checkpoint.enable", "--checkpoint.interval",
            str(interval), "--checkpoint.keep_latest_k", "3", "--fault.max_restarts", "40", "--fault.hang_timeout_s",
            str(HANG_S), "--fault.straggler_freq", str(STRAGGLER_FREQ), "--fault.straggler_threshold", "0.5",
            "--guard.policy", "rollback", "--guard.rollback_replay", "--guard.spike_zscore", "none",
            "--job.custom_imports", "fault_injection"]


@dataclass
class Record:
    step: int
    loss: float | None
    seen: float  # wall time when the driver first read it
    launch: int  # which launch of the job wrote it
    restarts: int = 0  # torchrun's restarts of the launch's workers before the attempt that wrote it


@dataclass
class Run:
    """One job, launched (and relaunched) by the driver, its metrics followed as they are written."""

    folder: str
    nproc: int
    args: list[str]
    records: list[Record] = field(default_factory=list)
    launches: int = 0
    proc: subprocess.Popen | None = None
    _offset: int = 0

    @property
    def dump(self) -> str:
        return os.path.join(self.folder, "job")

    @property
    def control(self) -> str:
        return os.path.join(self.folder, "control")

    def launch(self) -> None:
        self.launches += 1
        os.makedirs(self.control, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", LOG_RANK="0", PYTHONUNBUFFERED="1",
                   TORCHTRAIN_TEST_CONTROL=self.control)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.path.join(REPO, "tests", "plugins"),
                                                        env.get("PYTHONPATH")) if p)
        env.pop("RANK", None)
        cmd = [sys.executable, "-m", "torchtrain.launcher", f"--nproc_per_node={self.nproc}", "--rdzv_backend=c10d",
               "--rdzv_endpoint=localhost:0", "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
               "-m", "torchtrain.train", *self.args]
        log = open(os.path.join(self.folder, f"launch-{self.launches}.log"), "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its own process group, as under a scheduler

    def poll(self) -> None:
        path = os.path.join(self.dump, "metrics.jsonl")
        if not os.path.exists(path):
            return
        with open(path) as f:
            f.seek(self._offset)
            text = f.read()
        complete = text[:text.rfind("\n") + 1]
        self._offset += len(complete.encode())
        now = time.time()
        for line in complete.splitlines():
            r = json.loads(line)
            self.records.append(Record(r["step"], r.get("loss"), now, self.launches, r.get("restarts", 0)))

    @property
    def last(self) -> int:
        return self.records[-1].step if self.records else 0

    def wait(self, until, timeout: float = 300, what: str = "") -> None:
        deadline = time.time() + timeout
        while not until():
            if self.proc is not None and self.proc.poll() not in (None, 0, 128 + signal.SIGTERM, -signal.SIGKILL):
                raise RuntimeError(f"the job failed (exit {self.proc.returncode}) while waiting for {what}; see "
                                   f"{self.folder}/launch-{self.launches}.log")
            if time.time() > deadline:
                raise TimeoutError(f"waited {timeout} s for {what}")
            time.sleep(0.02)
            self.poll()

    def wait_step(self, step: int, timeout: float = 600) -> None:
        self.wait(lambda: self.last >= step, timeout, f"step {step}")

    def finish(self, timeout: float = 900) -> None:
        self.proc.wait(timeout=timeout)
        self.poll()
        if self.proc.returncode != 0:
            raise RuntimeError(f"the job exited {self.proc.returncode}; see {self.folder}/launch-{self.launches}.log")

    def stop(self) -> None:
        """End whatever is left of the launch (after a failure of the benchmark itself)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)

    def log(self) -> str:
        paths = (os.path.join(self.folder, f"launch-{n}.log") for n in range(1, self.launches + 1))
        return "".join(open(p, errors="replace").read() for p in paths if os.path.exists(p))

    def worker_pid(self, rank: int) -> int:
        """The training process of `rank` (the test plugin writes it into the control folder)."""
        return int(open(os.path.join(self.control, f"pid-{rank}")).read())

    def workers(self) -> set[int]:
        """The training processes of the launch now: the forkserver's children (the launch's own process group)."""
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    text = open(f"/proc/{entry}/stat").read()
                except OSError:
                    continue
                name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
                stats[int(entry)] = (name, int(rest[1]), int(rest[2]))  # (name, parent, process group)
        group = {pid for pid, (_, _, pgrp) in stats.items() if pgrp == self.proc.pid}
        servers = {pid for pid in group if stats[pid][0] == SERVER_NAME}
        return {pid for pid in group if stats[pid][1] in servers}

    def attempts_after(self, t0: float) -> int | None:
        """The index of the first record of a new attempt (a torchrun restart, a relaunch or a guard rollback:
        the launch or its restarts change, or the step goes back) read after `t0`; None if there is none yet."""
        for i in range(1, len(self.records)):
            a, b = self.records[i - 1], self.records[i]
            if b.seen >= t0 and (b.launch != a.launch or b.restarts != a.restarts or b.step <= a.step):
                return i
        return None

    def complete_checkpoints(self) -> list[int]:
        steps = []
        for path in glob.glob(os.path.join(self.dump, "checkpoint", "step-*")):
            if os.path.exists(os.path.join(path, "complete.json")):
                steps.append(int(path.rsplit("-", 1)[1]))
        return sorted(steps)


def final_tensors(dump: str, step: int) -> dict:
    """Every tensor of the job's checkpoint of `step` (model and optimizer state, by their stored names), read in
    this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(dump, "checkpoint", f"step-{step}")
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items()
             if isinstance(m, TensorStorageMetadata) and k.startswith(("model.", "optimizer."))}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process reads it: meant
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def same_tensors(a: dict, b: dict) -> bool:
    """Bitwise equal, name by name."""
    import torch

    def raw(t):
        return t.reshape(-1).contiguous().view(torch.uint8)

    return a.keys() == b.keys() and all(torch.equal(raw(a[k]), raw(b[k])) for k in a)
