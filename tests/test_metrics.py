"""Metrics: throughput/MFU arithmetic, peak-FLOPs lookup, and the jsonl / TensorBoard sinks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from torchtrain.components.hardware import MemoryMonitor, gpu_spec_for_name, peak_tflops
from torchtrain.components.observability.metrics import MetricsLogger, ThroughputMeter
from torchtrain.config import ConfigError
from torchtrain.config.job import Metrics


def test_throughput_arithmetic(monkeypatch):
    clock = iter([100.0, 102.0, 102.0])  # start, summary, the reset after it
    monkeypatch.setattr("torchtrain.components.observability.metrics.time.perf_counter", lambda: next(clock))
    meter = ThroughputMeter(flops_per_token=1_000_000, peak_tflops=0.004, world_size=4)
    meter.add_step(global_tokens=8000, data_time=0.5)
    meter.add_step(global_tokens=8000, data_time=0.1)
    s = meter.summary()
    assert s["tokens_per_s_per_device"] == pytest.approx(16000 / 2 / 4)
    assert s["tflops_per_device"] == pytest.approx(2000 * 1e6 / 1e12)
    assert s["mfu_pct"] == pytest.approx(100 * 0.002 / 0.004)
    assert s["step_time_s"] == pytest.approx(1.0) and s["data_loading_pct"] == pytest.approx(30.0)


def test_mfu_is_na_without_a_known_peak():
    assert peak_tflops(torch.device("cpu"), torch.float32) is None
    assert peak_tflops(torch.device("cpu"), torch.float32, override=1.5) == 1.5
    meter = ThroughputMeter(10, None, 1)
    meter.add_step(10, 0.0)
    assert meter.summary()["mfu_pct"] is None


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100_pcie"),
                                       ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                       ("NVIDIA A100-SXM4-40GB", "a100_40gb"), ("NVIDIA B200", "b200"),
                                       ("NVIDIA GeForce RTX 3090", None)])
def test_gpu_lookup(name, key):
    spec = gpu_spec_for_name(name)
    assert (spec.key if spec else None) == key


def test_memory_monitor_cpu():
    mon = MemoryMonitor(torch.device("cpu"))
    assert mon.kind == "rss" and 0.01 < mon.peak_gib() < 64


def test_jsonl_and_tensorboard_are_written_and_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(Metrics(), str(tmp_path), enabled=True)
    for step in (1, 2, 3):
        log.log(step, {"loss": 5.0 - step, "grad_norm": 1.0, "mfu_pct": None, "memory_kind": "rss"})
    log.close()
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[2]["loss"] == 2.0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [4.0, 3.0, 2.0]
    assert "mfu_pct" not in acc.Tags()["scalars"]


def test_non_logging_rank_writes_nothing(tmp_path):
    log = MetricsLogger(Metrics(), str(tmp_path / "x"), enabled=False)
    log.log(1, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "x").exists()


def test_jsonl_is_strict_json_with_non_finite_values_flagged(tmp_path):
    """NaN / Infinity are not JSON: they are written as null and named under "non_finite", so strict
    parsers (jq, JSON.parse, pandas) read every line; read_jsonl restores the floats."""
    from torchtrain.utils.strict_json import read_jsonl

    log = MetricsLogger(Metrics(), str(tmp_path), enabled=True)
    log.log(1, {"loss": 2.5, "grad_norm": 1.0})
    log.log(2, {"loss": float("nan"), "grad_norm": float("inf"), "guard_reason": "non-finite loss (nan)",
                "memory_tensor_breakdown_gib": {"grads": float("-inf"), "params": 0.5}})
    log.close()

    def strict(token):
        raise AssertionError(f"bare {token} in metrics.jsonl")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    raw = [json.loads(line, parse_constant=strict) for line in lines]
    assert "non_finite" not in raw[0]
    assert raw[1]["loss"] is None and raw[1]["grad_norm"] is None
    assert raw[1]["non_finite"] == {"loss": "nan", "grad_norm": "inf", "memory_tensor_breakdown_gib.grads": "-inf"}
    assert raw[1]["memory_tensor_breakdown_gib"] == {"grads": None, "params": 0.5}
    back = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert back[0] == {"step": 1, "loss": 2.5, "grad_norm": 1.0}
    assert math.isnan(back[1]["loss"]) and back[1]["grad_norm"] == math.inf
    assert back[1]["memory_tensor_breakdown_gib"] == {"grads": -math.inf, "params": 0.5}
    assert back[1]["guard_reason"] == "non-finite loss (nan)" and "non_finite" not in back[1]


def _wandb_records(path: str):
    """The protobuf records of a W&B run file (`run-ID.wandb`: a 7-byte header, then LevelDB-log
    framing: 32 KiB blocks of chunks with a 7-byte header: crc32c, length, type full/first/middle/last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, pos, chunks = 32768, 7, []
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7]) if left >= 7 else (0, 0)
        if kind == 0:  # the zero padding at a block's end
            pos += left
            continue
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


@pytest.mark.dist
def test_wandb_offline_run_rank0_only_with_name_config_and_metrics(tmp_path, monkeypatch):
    """metrics.enable_wandb in offline mode under torchrun (2 ranks), with no network (a dead proxy
    catches any attempt): rank 0 alone writes one W&B run, named after the dump folder, in project
    "torchtrain", with the job config and every logged step's metrics (equal to metrics.jsonl's)."""
    pytest.importorskip("wandb", reason="the optional wandb extra is not installed (pip install 'torchtrain[wandb]')")
    from conftest import TINY_JOB, read_metrics, run_train

    dump = tmp_path / "wandb_job"
    home = {k: str(tmp_path / "wandb_home") for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    env = dict(home, HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9")
    out = run_train([*TINY_JOB, "--training.steps", "3", "--metrics.log_freq", "1", "--job.dump_folder", str(dump),
                     "--metrics.enable_tensorboard", "false", "--metrics.enable_wandb", "--metrics.wandb_mode",
                     "offline", "--job.description", "wandb offline test"], nproc=2, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = list((dump / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs  # rank 0 only
    history, run = {}, None
    for record in _wandb_records(str(runs[0])):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = items
    assert run is not None and run.display_name == "wandb_job" and run.project == "torchtrain"
    assert run.notes == "wandb offline test"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["training"]["steps"] == 3 and config["model"]["dim"] == 64
    assert config["job"]["dump_folder"] == str(dump)
    jsonl = read_metrics(str(dump))
    assert sorted(history) == [1, 2, 3] == [r["step"] for r in jsonl]
    for r in jsonl:
        assert history[r["step"]]["loss"] == r["loss"] and history[r["step"]]["lr"] == r["lr"]


def test_wandb_enabled_without_the_package_is_a_config_error(monkeypatch):
    import importlib.util

    from torchtrain.components.observability.wandb_sink import check_wandb

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"\[metrics.enable_wandb\] needs the wandb package"):
        check_wandb(Metrics(enable_wandb=True))
    check_wandb(Metrics())  # off: nothing needed
