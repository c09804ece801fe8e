"""Elastic resume: a job saved on N ranks resumes on M ranks with the same global batch (gradient accumulation
adjusts), the same data position and the same learning-rate schedule, under real torchrun + gloo (FSDP 4 -> 2
and 2 -> 4); a job whose global batch would follow the world size is refused instead of changing it silently.

Tolerance: 1e-6 relative per step for the loss. The resumed steps read the same global batch from the same
state; only the reduction order differs (4 ranks x 1 micro-batch against 2 ranks x 2 accumulated ones), which
moves a float32 loss by a few ulps (~5e-7 observed).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from conftest import TINY_JOB, read_metrics, run_together

from torchtrain.components.checkpoint.safety import CheckpointError
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
