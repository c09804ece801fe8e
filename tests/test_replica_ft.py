"""Replica-group fault tolerance (fault.replica_ft, distributed/replica_ft.py) under real torchrun + gloo + torchft:
HSDP 2 x 2 as two replica groups of 2 processes each (each its own launcher and torchrun), one torchft lighthouse.

Group 1's rank 1 is killed (SIGKILL) in step 4. Group 0 must go on alone (the step in which the group was lost
is skipped, the following ones train on group 0's half of the global batch), group 1's torchrun restarts it
(fault.max_restarts 1): it resumes from the newest checkpoint group 0 wrote, rejoins, and receives group 0's
live training state. Two test hooks pin the rejoin to step 8 whatever the restart takes: the restarted group
waits until group 0 has recorded step 7 (trained without it) before it joins a quorum (then creates a marker
file), and group 0 waits before step 8 for that marker, then until both groups are in the quorum. From then on both groups must hold BITWISE equal state: the same per-step
loss and gradient norm, and the same final `state_digest` (a hash of model, optimizer, schedule, data
position, counters and RNG of every rank). The NaN guard (a NaN injected at step 10) must skip the step in
both groups alike; only group 0 (the lowest live group) writes checkpoints.

One launch of 4 processes (+ 2 restarted) and the lighthouse: about 20 s on 2 CPU cores.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import FAULT_INJECTION, REPO, TINY_JOB, read_metrics, wait_for_pid_file

from torchtrain.distributed.utils import free_port

pytest.importorskip("torchft")
pytestmark = [pytest.mark.dist, pytest.mark.slow]
STEPS, KILL_STEP, REJOIN_STEP, NAN_STEP = 12, 4, 8, 10
FULL_TOKENS = 8 * 64  # 2 groups x 2 ranks x 2 sequences of 64 tokens
ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "LOG_RANK": "0", "PYTHONUNBUFFERED": "1"}


def job(dump, group: int) -> list[str]:
    return [*TINY_JOB, "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--debug.deterministic",
            "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump), "--checkpoint.enable",
            "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
            "--parallelism.data_parallel_replicate_degree", "2", "--fault.replica_ft", "--fault.replica_id", str(group),
            "--fault.replica_timeout_s", "10", "--fault.hang_timeout_s", "20", "--fault.max_restarts", "1",
            "--guard.policy", "skip", "--debug.inject_nonfinite_loss_steps", str(NAN_STEP), *FAULT_INJECTION]


def launch(args: list[str], **env: str) -> subprocess.Popen:
    full = dict(os.environ, **ENV, **env)
    full.pop("RANK", None)
    # torchrun's own start method (fresh interpreters), as on a GPU machine
    cmd = [sys.executable, "-m", "torchtrain.launcher", "--start-method", "spawn", "--nproc_per_node=2",
           "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
           "-m", "torchtrain.train", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    dump = tmp_path_factory.mktemp("replica_ft")
    port = free_port()
    lighthouse = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or "torchft_lighthouse"
    house = subprocess.Popen([lighthouse, "--min_replicas", "1", "--bind", f"[::]:{port}", "--join_timeout_ms", "10000",
                              "--heartbeat_timeout_ms", "2000", "--quorum_tick_ms", "100"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = dump / "group_1_joining"  # written by the restarted group 1 right before its first quorum
    env = dict(TORCHFT_LIGHTHOUSE=f"http://localhost:{port}", TORCHTRAIN_TEST_REPLICA_WAIT=f"{REJOIN_STEP}:{marker}")
    try:
        first = launch(job(dump, 0), **env)
        record = os.path.join(str(dump), "replica_0", "metrics.jsonl")  # group 0's steps, 5-7 without group 1
        second = launch(job(dump, 1), TORCHTRAIN_TEST_PARK_IN_STEP=f"{KILL_STEP}:1",
                        TORCHTRAIN_TEST_REJOIN_AFTER=f"{record}:{REJOIN_STEP - 1}", **env)
        pid = wait_for_pid_file(second, dump / "replica_1" / "test_parked_rank1.pid", "group 1 never reached step 4")
        os.kill(pid, signal.SIGKILL)
        outs = [p.communicate(timeout=300)[0] for p in (first, second)]
    finally:
        house.terminate()
        house.wait(timeout=30)
    for proc, out in zip((first, second), outs):
        assert proc.returncode == 0, out[-6000:]
    return dump, outs


def records(dump, group: int) -> dict[int, dict]:
    """Step -> metrics record of one group (a step run again after a restart keeps its latest record)."""
    return {r["step"]: r for r in read_metrics(os.path.join(str(dump), f"replica_{group}"))}


def test_survivors_continue_on_their_share_of_the_batch(groups):
    dump, (out0, _) = groups
    got = records(dump, 0)
    assert sorted(got) == list(range(1, STEPS + 1))  # group 0 never stopped or restarted
    assert "a replica group was lost during the step" in out0
    assert sum(r["replica_lost_steps"] > 0 for r in got.values()) > 0
    alone = [s for s, r in got.items() if r["replica_groups_live"] == 1]
    assert alone and all(KILL_STEP < s < REJOIN_STEP for s in alone), alone
    tokens = {s: got[s]["tokens_seen"] - got.get(s - 1, {"tokens_seen": 0})["tokens_seen"] for s in got}
    for step in alone:  # the rule: an absent group's share is not trained on
        assert tokens[step] == FULL_TOKENS // 2, (step, tokens)
    for step in range(REJOIN_STEP, STEPS + 1):
        assert got[step]["replica_groups_live"] == 2 and tokens[step] == FULL_TOKENS, (step, tokens)


def test_restarted_group_rejoins_with_the_survivors_exact_state(groups):
    dump, (out0, out1) = groups
    assert "restarting the workers (restart 1 of 1)" in out1 and "rank 1: signal SIGKILL" in out1
    assert f"replica group 1 rejoined: received the live training state after step {REJOIN_STEP - 1}" in out1, out1
    zero, one = records(dump, 0), records(dump, 1)
    for step in range(REJOIN_STEP, STEPS + 1):
        assert (one[step].get("loss"), one[step].get("grad_norm")) == (zero[step].get("loss"), zero[step].get("grad_norm"))
        assert one[step]["tokens_seen"] == zero[step]["tokens_seen"]  # the data position came along
    assert zero[STEPS]["state_digest"] == one[STEPS]["state_digest"]


def test_guard_and_checkpoints_keep_working(groups):
    dump, (out0, out1) = groups
    for group in (0, 1):
        bad = records(dump, group)[NAN_STEP]
        assert bad["guard_action"] == "skip" and bad["loss"] != bad["loss"], bad  # NaN, skipped in both groups
    assert "checkpoint saved" in out0 and "checkpoint saved" not in out1  # the lowest live group writes
    assert f"resumed from {os.path.join(str(dump), 'checkpoint')}" in out1  # the restarted group's own start
    complete = [p for p in glob.glob(os.path.join(str(dump), "checkpoint", "step-*"))
                if os.path.exists(os.path.join(p, "complete.json"))]
    assert os.path.join(str(dump), "checkpoint", f"step-{STEPS}") in complete
    for path in complete:
        assert os.path.exists(os.path.join(path, ".metadata")) and len(glob.glob(os.path.join(path, "*.distcp"))) == 2
