"""Metrics: throughput/MFU arithmetic, peak-FLOPs lookup, and the jsonl / TensorBoard sinks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from torchtrain.components.hardware import MemoryMonitor, gpu_spec_for_name, peak_tflops
from torchtrain.components.metrics import MetricsLogger, ThroughputMeter


def test_throughput_arithmetic(monkeypatch):
    clock = iter([100.0, 102.0, 102.0])  # start, summary, the reset after it
    monkeypatch.setattr("torchtrain.components.metrics.time.perf_counter", lambda: next(clock))
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

    log = MetricsLogger(str(tmp_path), enable_tensorboard=True, tb_folder="tb", enabled=True)
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
    log = MetricsLogger(str(tmp_path / "x"), enable_tensorboard=True, tb_folder="tb", enabled=False)
    log.log(1, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "x").exists()


def test_jsonl_is_strict_json_with_non_finite_values_flagged(tmp_path):
    """NaN / Infinity are not JSON: they are written as null and named under "non_finite", so strict
    parsers (jq, JSON.parse, pandas) read every line; read_jsonl restores the floats."""
    from torchtrain.utils.strict_json import read_jsonl

    log = MetricsLogger(str(tmp_path), enable_tensorboard=True, tb_folder="tb", enabled=True)
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
