"""Elastic resume: a job saved on N ranks resumes on M ranks with the same global batch (gradient accumulation
adjusts), the same data position and the same learning-rate schedule, under real torchrun + gloo (FSDP 4 -> 2
and 2 -> 4); a job whose global batch would follow the world size is refused instead of changing it silently.
And within one job: a node lost from an elastic range (NNODES=1:2) leaves the job training on the node that is left,
and a node that comes back joins it again.

Tolerance: 1e-6 relative per step for the loss. The resumed steps read the same global batch from the same
state; only the reduction order differs (4 ranks x 1 micro-batch against 2 ranks x 2 accumulated ones), which
moves a float32 loss by a few ulps (~5e-7 observed).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch
from conftest import FAULT_INJECTION, REPO, TINY_JOB, read_metrics, run_together

from torchtrain.components.checkpoint.safety import CheckpointError
from torchtrain.distributed.utils import free_port
from torchtrain.trainer.state import TrainState

STEPS, SAVED = 6, 3


def test_a_resume_keeps_a_stated_global_batch_and_refuses_to_change_a_derived_one(caplog):
    saved = {"step": torch.tensor(3), "tokens_seen": torch.tensor(99), "global_batch_size": torch.tensor(8)}
    TrainState(torch.device("cpu"), 8, False).load_state_dict(saved)  # the same batch: nothing to say
    with pytest.raises(CheckpointError, match=r"trained with a global batch of 8 sequences; this job's would be 4 .*"
                                              r"Set training.global_batch_size = 8 to keep it"):
        TrainState(torch.device("cpu"), 4, False).load_state_dict(saved)
    with caplog.at_level(logging.WARNING, logger="torchtrain"):
        state = TrainState(torch.device("cpu"), 16, True)
        state.load_state_dict(saved)
    assert state.step == 3 and "global batch changes from 8 to 16 sequences at step 4" in caplog.text
    old = {"step": torch.tensor(3), "tokens_seen": torch.tensor(99)}  # saved before the batch was recorded
    TrainState(torch.device("cpu"), 4, False).load_state_dict(old)


def job(dump: str) -> list[str]:
    return [*TINY_JOB, "--training.steps", str(STEPS), "--training.global_batch_size", "8", "--metrics.log_freq", "1",
            "--checkpoint.enable", "--checkpoint.interval", str(SAVED), "--debug.deterministic",
            "--metrics.enable_tensorboard", "false", "--job.dump_folder", dump]


def resume_folder(work, name: str, source: str) -> str:
    dump = os.path.join(work, name)
    shutil.copytree(os.path.join(source, "checkpoint", f"step-{SAVED}"),
                    os.path.join(dump, "checkpoint", f"step-{SAVED}"))
    return dump


@pytest.mark.dist
def test_fsdp_4_to_2_and_2_to_4_keep_the_global_batch_and_the_losses(tmp_path):
    work = str(tmp_path)
    four, two = os.path.join(work, "four"), os.path.join(work, "two")
    (rc, log), = run_together([job(four)], 4, work)
    assert rc == 0, log[-3000:]
    to_two = resume_folder(work, "four_to_two", four)
    outcomes = run_together([job(two), job(to_two)], 2, work)
    assert all(rc == 0 for rc, _ in outcomes), outcomes[-1][1][-3000:]
    to_four = resume_folder(work, "two_to_four", two)
    (rc, log4), = run_together([job(to_four)], 4, work)
    assert rc == 0, log4[-3000:]
    log2 = outcomes[1][1]
    assert "global batch 8 sequences (2 per rank x 2 dp x 2 accumulation)" in log2
    assert "global batch 8 sequences (2 per rank x 4 dp x 1 accumulation)" in log4
    assert "data-parallel degree changed (4 -> 2)" in log2 and "data-parallel degree changed (2 -> 4)" in log4
    for straight, resumed in ((four, to_two), (two, to_four)):
        ref = {r["step"]: r for r in read_metrics(straight)}
        got = read_metrics(resumed)
        assert [r["step"] for r in got] == list(range(SAVED + 1, STEPS + 1))
        for r in got:
            assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-6), (straight, r["step"])
            assert r["lr"] == ref[r["step"]]["lr"] and r["tokens_seen"] == ref[r["step"]]["tokens_seen"]


def saved_degrees(dump) -> dict[int, int]:
    """The complete checkpoints of a dump folder: step -> the data-parallel degree it was saved under."""
    out = {}
    for path in glob.glob(os.path.join(dump, "checkpoint", "step-*", "complete.json")):
        with open(path) as f:
            out[int(os.path.basename(os.path.dirname(path)).split("-")[1])] = json.load(f)["dp_degree"]
    return dict(sorted(out.items()))


@pytest.mark.dist
def test_a_lost_node_leaves_the_job_training_and_a_node_that_comes_back_joins_it(tmp_path):
    """NNODES=1:2 (an elastic range; c10d rendezvous, the first node hosting its store), two one-process nodes through
    run_train.sh:

    1. both train together until the step-10 checkpoint is complete (saved on 2 data-parallel ranks);
    2. the second node is lost (kill -9 of its whole process group): the first node's worker fails on its lost peer,
       its agent restarts it (fault.max_restarts), the rendezvous completes with the node that is left, and the job
       resumes from the newest checkpoint on one rank with the same global batch (2 accumulated micro-batches);
       after step 30 that rank parks (a test hook) until a preemption signal;
    3. the second node is started again: the first node's agent sees it waiting and stops its worker (SIGTERM), which
       saves step 30 as a preemption and exits; the next round has both nodes again (each round's workers on a store
       of their own: torchtrain/distributed/agent_stores.py), and the job resumes from step 30 on 2 ranks, nothing
       lost, and trains to the end."""
    dump = tmp_path / "job"
    args = [*TINY_JOB, *FAULT_INJECTION, "--training.steps", "40", "--training.global_batch_size", "4",
            "--checkpoint.enable", "--checkpoint.interval", "5", "--fault.max_restarts", "1",
            "--job.dump_folder", str(dump), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--debug.inject_delay_ranks", "0,1", "--debug.inject_delay_s", "0.05"]  # (the lost node dies mid-run)
    env = dict(os.environ, NGPU="1", NNODES="1:2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", OMP_NUM_THREADS="1",
               LOG_RANK="0", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", TORCHTRAIN_TEST_WAIT_FOR_SIGNAL="30:0",
               TORCHTRAIN_TEST_NO_ZYGOTE="1")  # (every process of a node in its own session: all of it is lost)
    env.pop("RANK", None)
    # torchrun's rendezvous settings: the first node hosts the store; a round of fewer than 2 nodes completes 2 s after
    # its first node joined (2 complete it at once); a node that stops sending its keep-alive every second is dropped
    # after 3 missed ones. The second node starts first and waits for the first node's store, so both usually join
    # the first round (one joining later is the growth of step 3, earlier).
    conf = "last_call_timeout=2,join_timeout=120,keep_alive_interval=1"

    def node(host: int) -> subprocess.Popen:
        return subprocess.Popen(["./run_train.sh", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, env=dict(env, PET_RDZV_CONF=f"is_host={host},{conf}"))

    def wait(done, what: str, running: list) -> None:
        deadline = time.monotonic() + 240
        while not done():
            assert all(n.poll() is None for n in running), [n.communicate()[0][-3000:] for n in running]
            assert time.monotonic() < deadline, f"{what}: {saved_degrees(dump)}"
            time.sleep(0.05)

    lost = node(0)
    first = node(1)  # (hosts the store)
    back = None
    try:
        wait(lambda: saved_degrees(dump).get(10) == 2, "the two nodes never saved step 10", [first, lost])
        os.killpg(lost.pid, signal.SIGKILL)
        lost_out = lost.communicate(timeout=60)[0]
        wait(lambda: (dump / "test_waiting_rank0.pid").exists(), "the node left never reached step 30", [first])
        back = node(0)
        out, back_out = first.communicate(timeout=300)[0], back.communicate(timeout=300)[0]
    finally:
        for n in (lost, first, back):
            if n is not None and n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    assert first.returncode == 0 and back.returncode == 0, (out[-4000:], back_out[-4000:])
    assert "launch: 2 nodes x 1 processes" in lost_out + out  # (the log rank of the first round: either node)
    assert "restarting the workers (restart 1 of 1)" in out and "launch: 1 node x 1 processes" in out, out[-4000:]
    assert "global batch 4 sequences (2 per rank x 1 dp x 2 accumulation)" in out, out[-4000:]
    resumed = re.search(r"resumed from \S+step-(\d+) .*training continues at step (\d+)", out)
    assert resumed and int(resumed[1]) >= 10 and int(resumed[2]) == int(resumed[1]) + 1, out[-4000:]
    assert "preemption: checkpoint step-30 saved" in out, out[-4000:]  # the node left, stopped for the one back
    after = out[out.index("preemption: checkpoint step-30 saved"):] + back_out  # (either node logs the last round)
    assert "launch: 2 nodes x 1 processes" in after and "training continues at step 31" in after, after[-4000:]
    assert "global batch 4 sequences (2 per rank x 2 dp x 1 accumulation)" in after, after[-4000:]
    degrees = saved_degrees(dump)  # 2 ranks, then 1 after the loss, then 2 again
    assert degrees[10] == 2 and degrees[30] == 1 and degrees[40] == 2, degrees
    records = read_metrics(str(dump))
    assert {r["step"] for r in records} == set(range(1, 41)) and records[-1]["step"] == 40
    assert all(r.get("restarts") == 1 for r in records if int(resumed[1]) < r["step"] <= 30)
