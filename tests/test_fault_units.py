"""[fault] pieces in one process, no torchrun: the config rules, the straggler arithmetic (both clocks'
inputs), the hang report, the replica-group layout and the launcher's exit statuses. The end-to-end
behaviour is in tests/test_fault.py and tests/test_replica_ft.py."""

from __future__ import annotations

import time
from collections import namedtuple
from types import SimpleNamespace

import pytest
from conftest import TINY_JOB

from torchtrain.components.fault.monitor import summarize
from torchtrain.components.fault.runtime import busy_compute
from torchtrain.components.fault.straggler import ThreadClock, compare, kernel_seconds_by_phase
from torchtrain.config import ConfigError, parse_args
from torchtrain.distributed.layout import resolve_layout
from torchtrain.utils.worker_failures import (
    UNBOUNDED_RESTARTS,
    RestartBudget,
    describe_exit,
    final_status,
    restart_monitor,
)

FT = ["--parallelism.data_parallel_replicate_degree", "2", "--fault.replica_ft", "--fault.replica_id", "1"]


@pytest.mark.parametrize("argv, message", [
    (["--fault.hang_timeout_s", "120"], "[fault.hang_timeout_s] 120 must be shorter than comm.train_timeout_seconds"),
    (["--fault.slow_phase_timeout_s", "400"], "[fault.slow_phase_timeout_s] 400 must be shorter than comm.init_timeout"),
    (["--debug.inject_delay_s", "0.5"], "[debug.inject_delay_s] needs debug.inject_delay_ranks"),
    (["--fault.replica_ft"], "[fault.replica_ft] needs parallelism.data_parallel_replicate_degree >= 2"),
    (FT[:3], "[fault.replica_id] must name this job's replica group, 0 .. 1"),
    ([*FT[:3], "--fault.replica_id", "2"], "got 2; launch every group with its own --fault.replica_id"),
    ([*FT, "--fault.replica_timeout_s", "60"], "[fault.replica_timeout_s] 60 must be shorter than fault.hang_timeout_s"),
    ([*FT, "--fault.min_replica_groups", "3"], "[fault.min_replica_groups] 3 exceeds the number of replica groups (2)"),
    (["--fault.restart_window_s", "600"], "[fault.restart_window_s] 600 bounds the restarts within a window, but "
                                          "fault.max_restarts is 0"),
])
def test_fault_config_errors_name_the_key(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)


def test_monitor_off_and_timeouts_that_fit():
    assert parse_args(["--fault.hang_timeout_s", "none", "--comm.train_timeout_seconds", "10"]).fault.hang_timeout_s is None
    cfg = parse_args(["--fault.hang_timeout_s", "300", "--comm.train_timeout_seconds", "400"])
    assert cfg.fault.hang_timeout_s == 300


def test_replica_groups_layout_deals_data_over_every_group():
    cfg = parse_args([*TINY_JOB, *FT, "--training.global_batch_size", "8"])
    layout = resolve_layout(cfg, 2, "cpu")  # this job: one group of 2 processes
    assert (layout.dims.dp_replicate, layout.dims.dp_shard, layout.replica_groups, layout.replica_id) == (1, 2, 2, 1)
    assert layout.data_degree == 4 and layout.batch.global_batch_size == 8 and layout.batch.grad_accum_steps == 1
    assert layout.describe() == "replica group 1 of 2 (torchft) x dp_shard 2" and layout.fsdp
    one = resolve_layout(parse_args([*TINY_JOB, *FT]), 1, "cpu")  # groups of one process still use FSDP's hook
    assert one.fsdp and one.data_degree == 2


@pytest.mark.parametrize("argv, message", [
    (["--parallelism.data_parallel_strategy", "ddp"], "[fault.replica_ft] averages FSDP gradients"),
    (["--parallelism.pipeline_parallel_degree", "2"], "[fault.replica_ft] is not combined with pipeline"),
    (["--training.mixed_precision_param", "float16"], "[fault.replica_ft] is not combined with float16"),
])
def test_replica_groups_refuse_what_they_cannot_average(argv, message):
    with pytest.raises(ConfigError) as e:
        resolve_layout(parse_args([*TINY_JOB, *FT, *argv]), 2, "cpu")
    assert message in str(e.value)


def window(fwd: float, data: float = 0.01, opt: float = 0.005, steps: int = 4, host: str = "h") -> dict:
    return {"phases": {"data": data * steps, "forward_backward": fwd * steps, "optimizer": opt * steps},
            "steps": steps, "host": host}


def test_a_slow_rank_is_named_with_its_phase_and_none_without_one():
    even = {r: window(0.10 + 0.002 * r) for r in range(8)}
    found, summary = compare(even, threshold=0.2)
    assert found == [] and summary["compute_s_max"] / summary["compute_s_median"] < 1.1
    uneven = {**even, 5: window(0.40, host="slow-node")}
    (straggler,), _ = compare(uneven, threshold=0.2)
    assert (straggler.rank, straggler.host, straggler.phase) == (5, "slow-node", "forward_backward")
    assert straggler.slowdown == pytest.approx(0.415 / 0.122, rel=1e-6)
    assert straggler.excess == pytest.approx(0.40 - 0.107, rel=1e-6)
    assert "rank 5 (host slow-node)" in straggler.describe() and "mostly in forward_backward" in straggler.describe()


def test_thread_clock_counts_work_not_waiting():
    clock = ThreadClock()
    clock.switch("data")
    time.sleep(0.2)  # waiting, as in a collective: no CPU time
    clock.switch("forward_backward")
    busy_compute(0.1, SimpleNamespace(type="cpu"))
    clock.switch(None)
    totals = clock.take()
    assert totals["data"] < 0.05 and 0.09 < totals["forward_backward"] < 0.2, totals


Kernel = namedtuple("Kernel", ["name", "device", "duration"])


def event(name: str, start: float, end: float, kernels=()) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), kernels=list(kernels))


def test_kernel_time_is_attributed_by_launch_time_without_communication():
    events = [event("torchtrain.phase.forward_backward", 0, 100), event("torchtrain.phase.optimizer", 100, 150),
              event("aten::mm", 10, 20, [Kernel("sm90_gemm", 0, 300.0)]),
              event("autograd::engine::evaluate_function: MmBackward0", 60, 70, [Kernel("sm90_gemm", 0, 500.0)]),
              event("c10d::allgather_", 30, 31, [Kernel("ncclDevKernel_AllGather_RING_LL", 0, 9000.0)]),
              event("aten::_foreach_add_", 120, 125, [Kernel("multi_tensor_apply_kernel", 0, 40.0)]),
              event("aten::copy_", 200, 201, [Kernel("copy", 0, 7.0)])]  # after the step's phases: not counted
    totals = kernel_seconds_by_phase(events)
    assert totals == pytest.approx({"data": 0.0, "forward_backward": 800e-6, "optimizer": 40e-6})


def test_hang_report_names_the_rank_that_is_not_waiting():
    ranks = {str(r): {"reported": True, "step": 5, "phase": "forward_backward", "host": "h", "pid": 100 + r,
                      "age_s": 4.2, "limit_s": 4.0, "responsive": r != 2} for r in range(4)}
    ranks["2"]["state"] = "T"
    decl = {"declared_by": 0, "ranks": ranks}
    waiting = {"where": "distributed_c10d.py:1 all_gather", "waiting": True, "step": 5, "phase": "forward_backward",
               "age_s": 4.3}
    acks = {0: waiting, 1: waiting, 3: waiting,
            2: dict(waiting, where="model.py:7 forward", waiting=False)}
    text = summarize(decl, acks, host="elsewhere")
    assert text.splitlines()[0] == "hang detected (declared by rank 0): stuck rank(s) 2"
    assert "rank 2 (host h, pid 102): step 5 forward_backward" in text and "state T; continued" in text
    assert "rank 1 (host h, pid 101)" in text and "waiting in a collective at distributed_c10d.py:1" in text
    silent = summarize(decl, {r: a for r, a in acks.items() if r != 2}, host="elsewhere")
    assert "stuck rank(s) 2" in silent and "did not respond" in silent
    assert "every rank waits in torch.distributed" in summarize(decl, {r: waiting for r in range(4)}, host="x")


def test_launcher_exit_statuses():
    failure = lambda code: SimpleNamespace(exitcode=code)  # noqa: E731
    assert describe_exit(-9) == "signal SIGKILL" and describe_exit(4) == "exit 4 (hang detected)"
    assert final_status({0: failure(2), 1: failure(-15)}) == 2  # the others were stopped by the agent
    assert final_status({0: failure(3)}) == 3 and final_status({0: failure(5), 1: failure(-15)}) == 5
    assert describe_exit(5) == "exit 5 (checkpoint saves failed)"
    assert final_status({0: failure(2), 1: failure(1)}) is None  # a crash too: not a clean, final error
    assert final_status({0: failure(-9)}) is None and final_status({0: failure(4)}) is None


def test_a_burst_of_failures_ends_the_job_but_failures_spread_over_the_run_do_not(capsys):
    """fault.restart_window_s: at most fault.max_restarts restarts within the window. Failures at 0, 10 and 20 s
    (2 within 100 s) restart twice and end the job at the third; after the window has passed, restarts are allowed
    again. torchrun's agent is driven through the launcher's monitor: its own count is unbounded, the budget's
    refusal takes its remaining restarts away."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    clock = [0.0]
    failed = RunResult(state=WorkerState.FAILED, failures={1: ProcessFailure(1, 11, -9, "")})
    monitor = restart_monitor(lambda agent, group: failed, RestartBudget(2, 100.0, clock=lambda: clock[0]))
    agent = SimpleNamespace(_pcontext=None, _remaining_restarts=UNBOUNDED_RESTARTS)
    group = SimpleNamespace(spec=SimpleNamespace(max_restarts=UNBOUNDED_RESTARTS), workers=[])
    allowed = []
    for now in (0, 10, 20, 150, 160, 200):
        clock[0], agent._remaining_restarts = now, UNBOUNDED_RESTARTS - len([a for a in allowed if a])
        monitor(agent, group)
        allowed.append(agent._remaining_restarts > 0)
    assert allowed == [True, True, False, True, True, False]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("torchtrain: worker failure (rank 1: signal SIGKILL); restarting the workers "
                        "(restart 1; 1 of 2 within 100 s)"), lines
    assert lines[2] == ("torchtrain: worker failure (rank 1: signal SIGKILL); not restarted: 2 restarts within the "
                        "last 100 s already, as many as fault.max_restarts allows within fault.restart_window_s")
    assert lines[3].endswith("(restart 3; 1 of 2 within 100 s)"), lines  # 0 and 10 s are out of the window at 150 s
    # without a window: torchrun's count, announced as before
    agent._remaining_restarts = 1
    restart_monitor(lambda agent, group: failed)(agent, SimpleNamespace(spec=SimpleNamespace(max_restarts=2)))
    assert capsys.readouterr().err.strip().endswith("restarting the workers (restart 2 of 2)")


def test_a_peer_gone_from_a_collective_is_told_from_other_errors():
    """Only these make a rank wait for its own hang monitor before ending (HangMonitor.hold_for_hang_exit)."""
    import torch.distributed as dist

    from torchtrain.components.fault.runtime import _peer_gone

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9614")
    assert _peer_gone(gloo) and _peer_gone(dist.DistBackendError("NCCL communicator was aborted"))
    assert not _peer_gone(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) and not _peer_gone(KeyError("x"))


def test_extension_points_call_what_a_plugin_registered_and_refuse_unknown_points():
    from torchtrain.utils import extensions

    seen = []

    def wait_for_all(step):
        seen.append(step)
        return step == 3

    assert extensions.call("quorum", step=3) == []  # nothing registered: nothing happens
    extensions.register("quorum", wait_for_all)
    try:
        assert extensions.call("quorum", step=3) == [True] and extensions.call("quorum", step=4) == [False]
    finally:
        extensions.unregister("quorum", wait_for_all)
    assert seen == [3, 4] and extensions.call("quorum", step=3) == []
    with pytest.raises(ValueError, match="unknown extension point 'park'"):
        extensions.register("park", wait_for_all)


def test_fault_injection_lives_in_the_tests_plugin_not_in_the_package():
    """The package reads no test-only environment variable; the tests' faults come in through the
    extension points (tests/plugins/fault_injection.py, loaded with job.custom_imports)."""
    import os

    from conftest import REPO

    for folder, _, files in os.walk(os.path.join(REPO, "torchtrain")):
        for name in files:
            if name.endswith(".py"):
                assert "TORCHTRAIN_TEST_" not in open(os.path.join(folder, name)).read(), name
    plugin = open(os.path.join(REPO, "tests", "plugins", "fault_injection.py")).read()
    for point in ("phase", "quorum", "storage_writer", "preemption_check", "gradients"):
        assert f'extensions.register("{point}",' in plugin


def _monitor_with_store(caplog):
    """A HangMonitor of rank 0 (node ranks 0, 1) over an in-process store, its thread stopped: the
    test drives `_stale` / `_declare` itself with hand-written heartbeats of rank 1."""
    import torch.distributed as dist

    from torchtrain.components.fault.monitor import HangMonitor
    from torchtrain.utils.logging import logger

    store = dist.HashStore()
    monitor = HangMonitor(lambda: store, 0, range(2), 2, "/nonexistent", timeout_s=1.0, slow_timeout_s=10.0)
    monitor.stop()
    monitor._thread.join()
    monitor._stop.clear()  # its waits wait again
    monitor.store = store
    logger.addHandler(caplog.handler)
    return monitor, store


def test_a_stall_that_resolves_before_the_declaration_is_logged_not_declared(caplog):
    import json
    import threading

    from torchtrain.components.fault.monitor import DONE_KEY, HANG_KEY
    from torchtrain.utils.logging import logger

    monitor, store = _monitor_with_store(caplog)
    try:
        def beat(seq: int, age: float, step: int) -> None:
            store.set("hb/1", json.dumps({"seq": seq, "step": step, "phase": "forward_backward", "age": age,
                                          "limit": 1.0, "host": "h", "pid": 1}))

        monitor._publish()
        beat(1, 3.0, 7)
        assert monitor._stale(range(2)) == [1]
        threading.Timer(0.1, beat, (2, 0.05, 8)).start()  # rank 1 goes on while the evidence is read
        assert monitor._declare([1]) is False and not store.check([HANG_KEY])
        assert "stall: rank 1 made no progress for" in caplog.text and "at step 7" in caplog.text
        assert "not a hang, nothing restarted" in caplog.text
        beat(3, 3.0, 8)  # stale again, and stays so: a hang
        assert monitor._stale(range(2)) == [1] and monitor._declare([1]) is True and store.check([HANG_KEY])
        store.delete_key(HANG_KEY)
        monitor.finish()  # the training loop ended: never declared from now on
        assert store.check([DONE_KEY]) and monitor._declare([1]) is False and not store.check([HANG_KEY])
    finally:
        logger.removeHandler(caplog.handler)


def test_a_crash_without_a_declared_hang_is_not_held_back():
    """A rank's error with no hang declared in the store (a peer killed: gloo's "connection closed") ends the
    rank at once, so torchrun restarts the job without waiting; with a declaration it waits for its monitor."""
    import threading

    import torch.distributed as dist

    from torchtrain.components.fault.monitor import HANG_KEY, HangMonitor

    release = threading.Event()

    def store_never_ready():  # keeps the monitor thread alive and away from the store
        release.wait(30)
        raise ConnectionError("test over")

    monitor = HangMonitor(store_never_ready, 0, range(2), 2, "/nonexistent", timeout_s=60.0, slow_timeout_s=240.0)
    try:
        monitor.store = dist.HashStore()
        t0 = time.monotonic()
        monitor.hold_for_hang_exit(2 * monitor.interval)  # 15 s at the default hang_timeout_s
        assert time.monotonic() - t0 < 1.0
        monitor.store.set(HANG_KEY, "{}")
        t0 = time.monotonic()
        monitor.hold_for_hang_exit(0.3)  # declared: waits for this rank's monitor to take it up
        assert time.monotonic() - t0 >= 0.3
    finally:
        monitor._stop.set()
        release.set()
        monitor._thread.join(5)
