"""The compile monitor (components/observability/compile_monitor.py) notices a recompilation after step 2.

The trainer-level check (compiled runs never recompile, compile time logged) is in
test_parallel_features.py::test_compile; here a compiled function is fed a new shape on step 3 so the
warning path is proven to fire, and the first two steps' bookkeeping is checked. Dynamo's "eager"
backend keeps it fast: the monitor counts Dynamo's graphs, whatever backend compiles them."""

from __future__ import annotations

import logging

import torch

from torchtrain.components.observability.compile_monitor import CompileMonitor, compiled_graphs


def test_monitor_reports_compile_time_and_flags_a_later_recompilation(caplog):
    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x.sin() * 2).sum(), backend="eager", dynamic=False)
    monitor = CompileMonitor(True, torch.device("cpu"))
    assert compiled_graphs() is not None
    shapes = {1: (8, 4), 2: (8, 4), 3: (8, 4), 4: (16, 4), 5: (16, 4)}
    records = {}
    with caplog.at_level(logging.INFO, logger="torchtrain"):
        for step, shape in shapes.items():
            monitor.start()
            fn(torch.randn(*shape))
            monitor.stop(step)
            records[step] = monitor.record()
    assert records[1]["compile_graphs"] == 1 and "compile_time_s" not in records[1]
    assert records[2]["compile_time_s"] >= 0 and "compile_time_s" not in records[3]  # reported once
    assert records[3] == {"compile_graphs": 1, "compile_recompiles": 0}
    assert records[4] == {"compile_graphs": 2, "compile_recompiles": 1}  # the new shape: one recompilation
    assert records[5]["compile_recompiles"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "step 4 recompiled 1 graph" in warnings[0], warnings
    assert any("spent compiling" in r.getMessage() for r in caplog.records)


def test_monitor_is_inert_without_compile():
    monitor = CompileMonitor(False, torch.device("cpu"))
    monitor.start()
    monitor.stop(1)
    assert monitor.record() == {}
