"""End to end, one process: the default job through run_train.sh trains and writes its outputs."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REPO, assert_no_trainer_traceback, read_metrics, run_train

from torchtrain.config import parse_args


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("default_job")
    out = subprocess.run(["./run_train.sh", "--training.steps", "20", "--job.dump_folder", str(dump)],
                         capture_output=True, text=True, cwd=REPO, timeout=600,
                         env=dict(os.environ, NGPU="1", CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return dump, out


def test_default_job_loss_falls(default_run):
    dump, _ = default_run
    records = read_metrics(str(dump))
    assert [r["step"] for r in records] == list(range(1, 21))
    first, last = records[0]["loss"], records[-1]["loss"]
    assert first > 7.0  # ~ln(2048) at initialisation
    assert last < first - 3.0, (first, last)  # byte-level Python source is quickly learnable


def test_metrics_fields(default_run):
    dump, out = default_run
    record = read_metrics(str(dump))[-1]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s_per_device", "tflops_per_device", "mfu_pct",
                "memory_peak_gib", "data_loading_pct", "step_time_s", "tokens_seen"):
        assert key in record
    assert record["mfu_pct"] is None  # CPU: no known peak, never a guess
    assert record["tokens_seen"] == 20 * 8 * 256
    assert record["tokens_per_s_per_device"] > 0 and record["tflops_per_device"] > 0
    assert "step    20 | loss" in out.stdout and "MFU n/a" in out.stdout


def test_tensorboard_events_readable(default_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump, _ = default_run
    acc = EventAccumulator(str(dump / "tb"))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("loss")]
    assert len(losses) == 20 and losses[-1] < losses[0]


def test_resolved_config_saved(default_run):
    dump, _ = default_run
    saved = dump / "job_config.toml"
    cfg = parse_args(["--job.config_file", str(saved)])
    assert cfg.training.steps == 20 and cfg.job.dump_folder == str(dump)
    assert cfg.model.flavor == "debugmodel" and cfg.training.dataset == "python_stdlib"


def test_config_error_before_process_group(tmp_path, tiny_job):
    out = run_train(tiny_job + ["--parallelism.data_parallel_shard_degree", "3"], nproc=2, timeout=120)
    assert out.returncode != 0
    assert "config error: [parallelism] degrees multiply to 3" in out.stderr
    # the trainer exits with a message, not a traceback (torchrun then reports the failed child itself)
    assert out.stderr.count("config error") == 1
    assert_no_trainer_traceback(out.stderr)
