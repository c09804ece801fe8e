"""The live-tensor-memory tracker shared by the trainer (`metrics.track_tensor_memory`) and the planner.

All figures are exact byte counts of tensor storages, so the assertions are exact.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.components.observability.tensor_memory import CATEGORIES, StepMemoryMeter, TensorMemoryTracker


def test_counts_new_storages_once_and_releases_them():
    tracker = TensorMemoryTracker()
    with tracker:
        a = torch.zeros(1000)              # 4000 B
        view = a.view(10, 100)             # same storage: not counted again
        b = a + 1                          # 4000 B
        assert tracker.current == 8000
        del b
        assert tracker.current == 4000
        c = torch.ones(250)                # 1000 B while a is alive
    assert tracker.peak == 8000
    del a, view, c
    assert tracker.current == 0


def test_in_place_resize_is_tracked():
    """FSDP2 frees and re-allocates gathered parameters with UntypedStorage.resize_."""
    tracker = TensorMemoryTracker()
    with tracker:
        t = torch.empty(256)
        t.untyped_storage().resize_(0)
        assert tracker.current == 0
        t.untyped_storage().resize_(2048)
        assert tracker.current == 2048
    assert torch.UntypedStorage.resize_ is not None and tracker.peak == 2048


def test_peak_breakdown_labels_params_grads_and_optimizer_state():
    model = nn.Linear(100, 10, bias=False)     # 1000 params = 4000 B
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    tracker = TensorMemoryTracker()
    tracker.register_model(model)
    tracker.watch_optimizer(opt)
    with tracker:
        for _ in range(2):
            model(torch.randn(4, 100)).sum().backward()
            opt.step()
            opt.zero_grad()
    parts = tracker.peak_breakdown()
    assert set(parts) == set(CATEGORIES) and sum(parts.values()) == tracker.peak
    assert parts["params"] == 4000 and parts["grads"] == 4000
    assert parts["optimizer"] == 8000 + 4  # exp_avg, exp_avg_sq and the step counter
    tracker.remove_hooks()


def test_step_meter_disabled_is_free_and_enabled_reports_gib():
    model = nn.Linear(8, 8)
    off = StepMemoryMeter(False, [model], [])
    with off.track():
        model(torch.randn(2, 8))
    assert off.record() == {}
    on = StepMemoryMeter(True, [model], [])
    with on.track():
        y = model(torch.randn(2, 8))
    record = on.record()
    assert record["memory_tensor_peak_gib"] * 2**30 >= 8 * 8 * 4 + y.numel() * 4
    assert set(record["memory_tensor_breakdown_gib"]) == set(CATEGORIES)
