"""Fault tolerance end to end under real torchrun + gloo ([fault], docs/resilience.md): 4 processes (FSDP 4),
the tiny model, 10 steps, a checkpoint every 2 steps, deterministic mode, torchrun restarts allowed once.

* a hang: rank 2 is stopped (SIGSTOP) in the forward_backward phase of step 5 (a test hook parks it there
  first, so the stop lands mid-step); the monitor must declare the hang within hang_timeout_s + its slack
  (2.5 check intervals, plus 5 s for this shared, loaded machine), every rank must leave its stacks (the
  stopped one after being continued), the summary must name rank 2, and the restarted job must finish
  with losses and gradient norms BITWISE equal to the uninterrupted run's (exact resume from step-4:
  weights, optimizer, schedule, data position and RNG restored, deterministic CPU kernels; any
  difference is a bug);
* a crash: rank 1 is killed (SIGKILL) in step 5: the same restart and the same bitwise equality (its restart
  counted within a window, fault.restart_window_s: the launcher's budget allows it, not torchrun's count);
* a straggler: in the killed run rank 3 works 0.2 s more per step (debug.inject_delay_*): it is named
  with its phase; the uninterrupted run names nobody (threshold 1.0 = twice the median: the ranks' CPU
  times differ by a few percent, the injected delay is several times the step's compute);
* a config error found by the workers (not by the launch check): one line, exit 2, no traceback, no
  restart;
* a finished run: a rank stopped (SIGSTOP) in the last step is continued by the monitor, the run finishes,
  and the declared hang resolves without a restart.

Three 4-process runs (two of them restarted once) and two 2-process runs: about 85 s on 2 CPU cores.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import FAULT_INJECTION, REPO, TINY_JOB, assert_no_traceback, read_metrics, wait_for_pid_file

from torchtrain.launcher import _children

pytestmark = pytest.mark.dist
NPROC, STEPS, HANG_S = 4, 10, 4.0
INTERVAL = HANG_S / 8  # the monitor's check interval (monitor.py)
ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "LOG_RANK": "0", "PYTHONUNBUFFERED": "1"}


CONFIG = "train_configs/debug_model.toml"  # what run_train.sh passes; the launcher runs get it too


def job(dump, *extra: str) -> list[str]:
    return ["--job.config_file", CONFIG, *TINY_JOB, "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--debug.deterministic",
            "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump), "--checkpoint.enable",
            "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0", "--fault.hang_timeout_s", str(HANG_S),
            "--fault.max_restarts", "1", "--fault.straggler_freq", "3", "--fault.straggler_threshold", "1.0",
            *FAULT_INJECTION, *extra]


def launch(args: list[str], nproc: int = NPROC, **env: str) -> subprocess.Popen:
    """The launcher (torchrun inside python -m torchtrain.launcher), as run_train.sh starts it."""
    full = dict(os.environ, **ENV, **env)
    full.pop("RANK", None)
    cmd = [sys.executable, "-m", "torchtrain.launcher", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
           "-m", "torchtrain.train", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-6000:]
    return out


def latest(dump) -> dict[int, tuple]:
    """Step -> (loss, grad_norm); a step run again after a restart keeps its latest values."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(str(dump))}


def assert_complete_checkpoints_are_whole(dump) -> None:
    """Nothing interrupted leaves a checkpoint that reads as complete: every step-N with a completion
    marker holds DCP's metadata and one data file per rank."""
    for path in glob.glob(os.path.join(str(dump), "checkpoint", "step-*")):
        if os.path.exists(os.path.join(path, "complete.json")):
            assert os.path.exists(os.path.join(path, ".metadata")), path
            assert len(glob.glob(os.path.join(path, "*.distcp"))) == NPROC, path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dump = tmp_path_factory.mktemp("reference")
    return dump, finish(launch(job(dump)))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """Rank 2 stopped mid-step 5 (SIGSTOP)."""
    dump = tmp_path_factory.mktemp("stopped")
    proc = launch(job(dump), TORCHTRAIN_TEST_PARK_IN_STEP="5:2")
    pid = wait_for_pid_file(proc, dump / "test_parked_rank2.pid", "rank 2 never reached step 5")
    os.kill(pid, signal.SIGSTOP)
    t_stop = time.time()
    return dump, finish(proc), t_stop


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Rank 1 killed mid-step 5 (SIGKILL), through run_train.sh, its one restart counted within an hour's window
    (fault.restart_window_s); rank 3 made a straggler. Each rank loads its data in a background worker: the killed
    rank's worker must end with it (one left behind would hold the launch's output open, and `finish` would wait
    for it), and the batches it loaded must be those of the reference run, which loads in the rank."""
    dump = tmp_path_factory.mktemp("killed")
    full = dict(os.environ, **ENV, NGPU=str(NPROC), CONFIG_FILE=CONFIG, TORCHTRAIN_TEST_PARK_IN_STEP="5:1")
    full.pop("RANK", None)
    args = job(dump, "--debug.inject_delay_ranks", "3", "--debug.inject_delay_s", "0.2",
               "--fault.restart_window_s", "3600",
               "--training.dataloader_workers", "1")[2:]  # run_train.sh adds the file
    proc = subprocess.Popen(["./run_train.sh", *args], cwd=REPO, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    pid = wait_for_pid_file(proc, dump / "test_parked_rank1.pid", "rank 1 never reached step 5")
    os.kill(pid, signal.SIGKILL)
    return dump, finish(proc)


def test_stopped_rank_is_reported_with_every_stack_and_the_restart_is_exact(reference, stopped):
    ref, _ = reference
    dump, out, t_stop = stopped
    (folder,) = glob.glob(os.path.join(str(dump), "hangs", "*"))
    summary = json.load(open(os.path.join(folder, "summary.json")))
    waited = summary["time"] - t_stop
    assert HANG_S - 1 <= waited <= HANG_S + 2.5 * INTERVAL + 5, waited
    text = open(os.path.join(folder, "summary.txt")).read()
    assert text.startswith("hang detected") and "stuck rank(s) 2\n" in text, text
    assert "state T; continued to write its stacks" in text and "park_in_step" in text, text
    for rank in range(NPROC):  # every rank's own stacks, the stopped one's included
        stacks = open(os.path.join(folder, f"rank-{rank}.txt")).read()
        assert f"rank {rank} " in stacks and "most recent call first" in stacks and "train.py" in stacks, stacks
    assert "waiting in a collective" in text  # the others wait for rank 2
    # the restart line names the failed worker(s)
    assert "hang detected" in out and re.search(r"\(rank \d: exit 4 \(hang detected\)", out), out[-4000:]
    assert "restarting the workers (restart 1 of 1)" in out and "training continues at step 5" in out, out[-4000:]
    assert "restart 1 of 1 (torchrun --max-restarts): resuming" in out, out[-4000:]
    assert latest(dump) == latest(ref) and len(latest(ref)) == STEPS
    after = [r for r in read_metrics(str(dump)) if r.get("restarts") == 1]
    assert [r["step"] for r in after] == list(range(5, STEPS + 1))
    assert_complete_checkpoints_are_whole(dump)


def test_killed_rank_restarts_the_job_from_the_last_checkpoint_exactly(reference, killed):
    ref, _ = reference
    dump, out = killed
    assert "rank 1: signal SIGKILL" in out and "restarting the workers (restart 1; 1 of 1 within 3600 s)" in out, \
        out[-4000:]
    assert "restart 1 (at most 1 within 3600 s: fault.restart_window_s): resuming" in out, out[-4000:]
    assert "training continues at step 5" in out
    assert latest(dump) == latest(ref)
    assert not glob.glob(os.path.join(str(dump), "hangs", "*"))  # a crash is not a hang
    assert_complete_checkpoints_are_whole(dump)
    # every rank's output of both attempts is kept with the run (the console showed rank 0's)
    (logs,) = glob.glob(os.path.join(str(dump), "rank_logs", socket.gethostname(), "*"))
    assert sorted(os.listdir(logs)) == ["attempt_0", "attempt_1"], os.listdir(logs)
    for attempt in ("attempt_0", "attempt_1"):
        assert sorted(os.listdir(os.path.join(logs, attempt))) == [str(r) for r in range(NPROC)]
    with open(os.path.join(logs, "attempt_1", "0", "stdout.log")) as f:
        assert "training continues at step 5" in f.read()


def test_injected_delay_is_named_a_straggler(killed):
    dump, out = killed
    named = [line for line in out.splitlines() if "straggler (steps" in line]
    assert named and all("rank 3 (host " in line and "mostly in forward_backward" in line for line in named), out
    found = [r for r in read_metrics(str(dump)) if r.get("straggler_count")]
    assert found and all((r["straggler_rank"], r["straggler_phase"], r["straggler_count"]) == (3, "forward_backward", 1)
                         for r in found)
    assert all(r["straggler_slowdown"] > 2 for r in found), found


def test_no_straggler_is_named_without_one(reference):
    dump, out = reference
    compared = [r for r in read_metrics(str(dump)) if "compute_s_median" in r]
    assert len(compared) >= 2 and all(r["straggler_count"] == 0 for r in compared), compared
    assert "straggler (" not in out


def test_worker_config_error_is_one_line_without_traceback_or_restart(tmp_path):
    """A config error found only by the workers (the launch check is bypassed here): the launcher shows
    the worker's one line and exits 2, without torchrun's ChildFailedError traceback or a restart."""
    args = [*TINY_JOB, "--training.dataset", "tokens", "--training.dataset_path", str(tmp_path / "missing"),
            "--job.dump_folder", str(tmp_path), "--fault.max_restarts", "2"]
    proc = launch(args, nproc=2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if "torchtrain: config error:" in line]
    assert len(errors) == 1 and str(tmp_path / "missing") in errors[0], out[-3000:]
    assert_no_traceback(out)
    assert "restarting" not in out and "ChildFailedError" not in out


def test_a_run_that_finishes_after_a_declared_hang_is_not_restarted(tmp_path):
    """Rank 1 stops itself (SIGSTOP) mid-way through the LAST step: the monitor declares the hang and
    continues it to write its stacks; the run then finishes its last step and saves, so every rank logs
    that the hang resolved and the job exits 0 without a restart (one 2-process run, 4 steps)."""
    steps = 4
    proc = launch(job(tmp_path, "--training.steps", str(steps)), nproc=2, TORCHTRAIN_TEST_STOP_IN_STEP=f"{steps}:1")
    out = finish(proc)
    assert "hang declared by rank 0 (step 4) resolved" in out and "not restarted" in out, out[-4000:]
    assert "restarting the workers" not in out and "exit 4" not in out, out[-4000:]
    (folder,) = glob.glob(os.path.join(str(tmp_path), "hangs", "*"))
    assert all(os.path.exists(os.path.join(folder, f"rank-{r}.txt")) for r in range(2))
    assert not os.path.exists(os.path.join(folder, "summary.json"))  # resolved: no hang report
    assert sorted(latest(tmp_path)) == list(range(1, steps + 1))
    assert os.path.exists(os.path.join(str(tmp_path), "checkpoint", f"step-{steps}", "complete.json"))


def _family(pid: int) -> list[int]:
    """`pid`'s descendants (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        found += children
        todo += children
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphaned zombie may wait for a container's init to reap it)."""
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_launcher_takes_its_workers_with_it(tmp_path):
    """kill -9 of the launcher (the OOM killer's pick, a stray kill) mid-run: its forkserver, the workers and their
    background data workers all end within seconds and the launch's output closes. Before, the workers held the
    forkserver's pipe open and trained on, headless, beside whatever launch came next in the same folder (one
    2-process run, rank 1 parked in step 3)."""
    proc = launch(job(tmp_path, "--training.dataloader_workers", "1"), nproc=2, TORCHTRAIN_TEST_PARK_IN_STEP="3:1")
    wait_for_pid_file(proc, tmp_path / "test_parked_rank1.pid", "rank 1 never reached step 3")
    family = _family(proc.pid)
    assert len(family) >= 5, family  # the forkserver, 2 workers, their data workers (and the resource tracker)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)  # every holder of the output has gone
    deadline = time.monotonic() + 30
    while [p for p in family if _running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in family if _running(p)], [open(f"/proc/{p}/cmdline").read()[:80] for p in family
                                                    if _running(p)]
