"""Checkpoint building blocks in one process: the folder rules (marker, discovery, purge), config and
pre-start checks, metadata validation against a real (single-process) DCP checkpoint, signals."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtrain.components.checkpoint import folder as fs
from torchtrain.components.checkpoint.preemption import PreemptionWatcher
from torchtrain.components.checkpoint.startup import plan_start
from torchtrain.components.checkpoint.startup import preflight as checkpoint_preflight
from torchtrain.components.checkpoint.validate import CheckpointError, check_against_metadata, read_metadata
from torchtrain.config import ConfigError, parse_args

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FULL = ["model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"]


def make(folder, step: int, complete: bool = True, contents=FULL, **meta) -> str:
    path = fs.step_dir(str(folder), step)
    os.makedirs(path)
    with open(os.path.join(path, "__0_0.distcp"), "w") as f:
        f.write("data")
    if complete:
        fs.write_marker(path, {"step": step, "contents": list(contents), **meta})
    return path


def test_scan_sees_only_marked_checkpoints_as_complete(tmp_path):
    make(tmp_path, 2)
    make(tmp_path, 10)
    make(tmp_path, 12, complete=False)
    (tmp_path / "step-x").mkdir()
    (tmp_path / "notes.txt").write_text("")
    bad = make(tmp_path, 14, complete=False)
    with open(os.path.join(bad, fs.MARKER), "w") as f:
        f.write("{trunc")
    found = fs.scan(str(tmp_path))
    assert [(c.step, c.complete) for c in found] == [(2, True), (10, True), (12, False), (14, False)]
    assert "no complete.json" in found[2].problem and "unreadable" in found[3].problem
    assert found[0].full_state and fs.scan(str(tmp_path / "missing")) == []


def test_purge_keeps_newest_k_and_drops_stale_partial_saves(tmp_path):
    for step in (2, 4, 6):
        make(tmp_path, step)
    make(tmp_path, 3, complete=False)  # interrupted earlier, superseded
    make(tmp_path, 9, complete=False)  # newer than the newest complete one: left alone (may be in flight)
    removed = fs.purge(str(tmp_path), keep_latest_k=2, newest_complete=6)
    assert sorted(os.path.basename(p) for p in removed) == ["step-2", "step-3"]
    assert sorted(os.listdir(tmp_path)) == ["step-4", "step-6", "step-9"]
    assert fs.purge(str(tmp_path), keep_latest_k=0, newest_complete=6) == []  # 0 keeps everything


def test_remove_is_rename_first(tmp_path, monkeypatch):
    path = make(tmp_path, 5)
    seen = []
    monkeypatch.setattr(fs.shutil, "rmtree", lambda p, ignore_errors=False: seen.append(p))
    fs.remove_checkpoint(path)  # "crash" before the files are gone: no step-5 left behind
    assert not os.path.exists(path) and os.path.basename(seen[0]).startswith(".deleting-step-5")


def test_file_hashes_find_a_flipped_byte_a_truncated_and_a_missing_file(tmp_path):
    from torchtrain.components.checkpoint import integrity

    path = str(tmp_path / "step-3")
    dcp.save({"model": {"w": torch.arange(4000.0)}, "train_state": {"step": torch.tensor(3)}}, checkpoint_id=path,
             no_dist=True)
    open(os.path.join(path, "__1_0.distcp"), "wb").write(os.urandom(5000))  # a second rank's file
    names = integrity.checkpoint_files(path, fs.MARKER)
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # spread over the ranks: a rank's own files to it, the others by position
    assert integrity.share(names, 0, 2) == [".metadata", "__0_0.distcp"] and integrity.share(names, 1, 2) == [
        "__1_0.distcp"]
    assert integrity.share(names, 0, 1) == names
    files = integrity.digests(path, names)
    assert files["__0_0.distcp"]["bytes"] == os.path.getsize(os.path.join(path, "__0_0.distcp"))
    assert integrity.verify(path, files, names) is None
    data = os.path.join(path, "__0_0.distcp")
    with open(data, "r+b") as f:  # one flipped bit
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 4]))
    assert "__0_0.distcp has crc32 " in integrity.verify(path, files, names) and "changed since the save" in (
        integrity.verify(path, files, names))
    os.truncate(data, 64)
    assert integrity.verify(path, files, names) == (
        f"__0_0.distcp has 64 bytes, {files['__0_0.distcp']['bytes']} were written (truncated)")
    os.remove(data)
    assert integrity.verify(path, files, names) == "__0_0.distcp is missing"
    assert integrity.verify(path, files, ["__1_0.distcp"]) is None  # another rank's share


def test_purge_never_counts_corrupt_or_incomplete_checkpoints(tmp_path):
    """keep_latest_k keeps k GOOD checkpoints: newer corrupt or incomplete ones never cost the newest good one."""
    for step in (2, 4, 6, 10):
        make(tmp_path, step)
    make(tmp_path, 8, complete=False)
    corrupt = {fs.step_dir(str(tmp_path), 6)}
    removed = fs.purge(str(tmp_path), keep_latest_k=2, newest_complete=10, corrupt=corrupt)
    assert sorted(os.path.basename(p) for p in removed) == ["step-2", "step-8"]
    assert sorted(os.listdir(tmp_path)) == ["step-10", "step-4", "step-6"]  # the corrupt one stays for inspection


def test_start_plan_skips_corrupt_checkpoints_and_refuses_to_start_over_them(tmp_path, caplog):
    from torchtrain.utils.logging import logger

    folder = tmp_path / "checkpoint"
    for step in (2, 4, 6):
        make(folder, step)
    cfg = ck(tmp_path).checkpoint
    bad = {4: "__1_0.distcp has 10 bytes, 20 were written (truncated)", 6: "__0_0.distcp has crc32 1, 2 was written"}
    verify = lambda c: bad.get(c.step)  # noqa: E731
    logger.addHandler(caplog.handler)
    try:
        plan = plan_start(cfg, str(folder), 8, verify)
        assert (plan.kind, plan.step) == ("resume", 2)
        lines = list(dict.fromkeys(r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()))
        assert len(lines) == 2 and "step-6 is corrupt: __0_0.distcp has crc32" in lines[0], lines
        bad[2] = ".metadata is missing"
        with pytest.raises(ConfigError, match="holds no good checkpoint to resume: every one is corrupt"):
            plan_start(cfg, str(folder), 8, verify)
        cfg.load_step = 4
        with pytest.raises(ConfigError, match=r"\[checkpoint.load_step\] .*step-4 is corrupt: __1_0.distcp has 10"):
            plan_start(cfg, str(folder), 8, verify)
    finally:
        logger.removeHandler(caplog.handler)


def test_a_failed_save_lets_training_go_on_and_the_limit_stops_it(tmp_path):
    """The saver in one process (a one-rank gloo group): a save whose write fails mid-way (no space left) is
    reported, its partial folder removed, the metrics say so, the next save works and older checkpoints stay;
    `max_consecutive_save_failures` failures in a row raise SaveFailed with the reason."""
    import errno
    from dataclasses import dataclass
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from torchtrain.components.checkpoint.saver import CheckpointSaver, SaveFailed
    from torchtrain.utils import extensions

    class FullDisk(FileSystemWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    @dataclass
    class Args:
        dim: int = 4

    class State(dict):
        def state_dict(self, *args):
            return dict(self)

        saved_state_dict = state_dict
        adapter_only = False  # (components/checkpoint/state.py::ModelState's)

    failing = {2, 6, 8}
    writer = lambda path, step, rank: FullDisk(path) if step in failing else None  # noqa: E731
    states = {"model": State(w=torch.ones(3)), "train_state": State(step=torch.tensor(1), tokens_seen=torch.tensor(0))}
    states.update({k: State(x=torch.zeros(1)) for k in ("optimizer", "lr_scheduler", "dataloader", "rng")})
    dims = SimpleNamespace(describe=lambda: "one process", dp=1)
    cfg = ck(tmp_path, "--checkpoint.max_consecutive_save_failures", "2").checkpoint
    folder = str(tmp_path / "checkpoint")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    extensions.register("storage_writer", writer)
    try:
        saver = CheckpointSaver(cfg, folder, states, dims, SimpleNamespace(name="m", flavor="f", args=Args(), tokenizer=None), None,
                                None, None)
        assert saver.save(2) is False and not os.path.exists(fs.step_dir(folder, 2))  # removed, not left half-written
        record = saver.record()
        assert record["checkpoint_failures"] == 1 and record["checkpoint_failures_in_a_row"] == 1
        assert record["checkpoint_failure"].startswith("step-2: rank 0: OSError: [Errno 28] No space left on device")
        assert "checkpoint_failure" not in saver.record()  # the reason is logged once
        assert saver.save(4) is True and saver.failures_in_a_row == 0
        assert fs.scan(folder)[0].meta["files"]  # complete, with its hashes
        assert saver.save(6) is False
        with pytest.raises(SaveFailed, match=r"2 saves in a row failed \(checkpoint.max_consecutive_save_failures = 2\), "
                                             r"the last: step-8: rank 0: OSError: \[Errno 28\].*newest good checkpoint: step-4"):
            saver.save(8)
        assert [(c.step, c.complete) for c in fs.scan(folder)] == [(4, True)]  # nothing older was deleted
    finally:
        extensions.unregister("storage_writer", writer)
        dist.destroy_process_group()


def ck(tmp_path, *extra: str):
    return parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", *extra])


@pytest.mark.parametrize("argv, expected", [
    (["--checkpoint.initial_load_path", "x"], "checkpoint.enable is false"),
    (["--checkpoint.create_seed_checkpoint"], "checkpoint.enable is false"),
    (["--checkpoint.enable", "--checkpoint.last_save_in_hf"], "needs checkpoint.last_save_model_only"),
    (["--checkpoint.enable", "--checkpoint.initial_load_in_hf"], "needs checkpoint.initial_load_path"),
    (["--checkpoint.exclude_from_loading", "optimiser"], "[checkpoint.exclude_from_loading[0]] must be one of"),
    (["--checkpoint.async_mode", "fast"], "[checkpoint.async_mode] must be one of"),
    (["--checkpoint.preemption_signals", "SIGKILL"], "[checkpoint.preemption_signals[0]] must be one of"),
    (["--checkpoint.load_step", "-2"], "[checkpoint.load_step] must be -1"),
])
def test_config_errors(argv, expected):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert expected in str(err.value)


def _preflight(cfg) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checkpoint_preflight(cfg.checkpoint, cfg.job.dump_folder, device, cfg.model.name, has_hf_adapter=True)


def test_preflight_errors(tmp_path):
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="async_with_pinned_mem needs CUDA"):
            _preflight(ck(tmp_path, "--checkpoint.async_mode", "async_with_pinned_mem"))
    with pytest.raises(ConfigError, match="initial_load_path.*does not exist"):
        _preflight(ck(tmp_path, "--checkpoint.initial_load_path", str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="neither a DCP checkpoint"):
        _preflight(ck(tmp_path, "--checkpoint.initial_load_path", str(tmp_path)))
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        _preflight(ck(tmp_path, "--checkpoint.initial_load_path", str(tmp_path),
                                       "--checkpoint.initial_load_in_hf"))
    folder = tmp_path / "checkpoint"
    make(folder, 4)
    make(folder, 6, complete=False)
    make(folder, 8, contents=["model"])
    with pytest.raises(ConfigError, match=r"has no step-5 \(complete checkpoints: 4, 8\)"):
        _preflight(ck(tmp_path, "--checkpoint.load_step", "5"))
    with pytest.raises(ConfigError, match="step-6 .* is incomplete"):
        _preflight(ck(tmp_path, "--checkpoint.load_step", "6"))
    with pytest.raises(ConfigError, match="holds the model weights only"):
        _preflight(ck(tmp_path, "--checkpoint.load_step", "8"))
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        _preflight(ck(tmp_path, "--checkpoint.create_seed_checkpoint"))
    _preflight(ck(tmp_path, "--checkpoint.load_step", "4"))  # fine


def test_metadata_checks_name_step_and_key(tmp_path):
    path = str(tmp_path / "step-3")
    state = {"model": {"w": torch.ones(4, 3), "b": torch.zeros(3)}, "train_state": {"step": 3}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    md = read_metadata(path, "step-3")
    assert check_against_metadata(md, state, path, "step-3") is None
    msg = check_against_metadata(md, {"model": {"w": torch.ones(5, 3)}}, path, "step-3")
    assert "step-3" in msg and "'model.w' has shape (4, 3) in the checkpoint but (5, 3)" in msg
    msg = check_against_metadata(md, {"model": {"v": torch.ones(1)}}, path, "step-3")
    assert "lacks key 'model.v'" in msg and "model.b" in msg
    assert "no 'optimizer' state" in check_against_metadata(md, {"optimizer": {"x": torch.ones(1)}}, path, "step-3")
    data = os.path.join(path, "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) - 10)
    assert "__0_0.distcp is truncated" in check_against_metadata(md, state, path, "step-3")
    os.remove(data)
    assert "__0_0.distcp is missing" in check_against_metadata(md, state, path, "step-3")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=r"step-3 .*\.metadata is unreadable"):
        read_metadata(path, "step-3")
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(CheckpointError, match="no DCP .metadata file"):
        read_metadata(path, "step-3")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_metadata(str(tmp_path / "gone"), "step-9")


def test_preemption_handler_only_sets_a_flag():
    watcher = PreemptionWatcher(["SIGUSR2"])
    try:
        assert not watcher.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)  # a second signal: still just the flag
        assert watcher.requested and watcher.received == ["SIGUSR2", "SIGUSR2"]
    finally:
        watcher.restore()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_no_signal_interrupts_a_save_and_one_that_arrived_is_honoured_after_it():
    """SIGINT (Ctrl-C, or the parent-death signal of a forked worker) during a save only records its arrival;
    it raises KeyboardInterrupt once the save is done. The preemption flag's own handler stays in place."""
    from torchtrain.components.checkpoint.preemption import DeferredSignals

    # Python's own SIGINT handler, as a training process has it (a test process may hold another one, left by
    # code that ran earlier in it: the test states its starting point)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = PreemptionWatcher(["SIGUSR2"])
    finished = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with DeferredSignals("a test save") as deferred:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGUSR2)
                finished.append(list(deferred.arrived))  # the "save" ran to its end
        assert finished == [[signal.SIGINT, signal.SIGINT]] and watcher.received == ["SIGUSR2"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        watcher.restore()
        signal.signal(signal.SIGINT, outer)


def test_several_model_parts_round_trip():
    """Pipeline-style model parts, one optimizer each: merged state dicts restore every part."""
    from torch import nn

    from torchtrain.components.checkpoint.state import ModelState
    from torchtrain.components.optim.optimizer import OptimizersContainer

    def parts():
        torch.manual_seed(0)
        return [nn.ModuleDict({"0": nn.Linear(3, 4)}), nn.ModuleDict({"1": nn.Linear(4, 2)})]

    cfg = parse_args([]).optimizer
    trained = parts()
    opt = OptimizersContainer(trained, cfg, torch.device("cpu"))
    for _ in range(2):
        sum(p.square().sum() for part in trained for p in part.parameters()).backward()
        opt.step()
        opt.zero_grad()
    model_sd, opt_sd = ModelState(trained).state_dict(), opt.state_dict()
    assert sorted(model_sd) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    fresh = parts()
    fresh_opt = OptimizersContainer(fresh, cfg, torch.device("cpu"))
    fresh_opt.state_dict()  # as when loading: the fresh optimizer state is initialised first
    ModelState(fresh).load_state_dict(model_sd)
    fresh_opt.load_state_dict(opt_sd)
    for a, b in zip(trained, fresh):
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    for a, b in zip(opt.optimizers, fresh_opt.optimizers):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])


def test_start_plan_resume_beats_initial_load(tmp_path, caplog):
    from torchtrain.utils.logging import logger

    source, folder = tmp_path / "other", tmp_path / "checkpoint"
    make(source, 3)
    cfg = ck(tmp_path, "--checkpoint.initial_load_path", str(source), "--checkpoint.exclude_from_loading",
             "rng").checkpoint
    logger.addHandler(caplog.handler)  # the torchtrain logger may not propagate (utils/logging.py)
    caplog.set_level("INFO", logger="torchtrain")
    try:
        make(folder, 0, contents=["model"])  # a seed
        plan = plan_start(cfg, str(folder), 8)
        assert (plan.kind, plan.step, plan.keys) == ("resume", 0, ("model",))
        assert f"initial_load_path {source} is NOT loaded: a resume point exists" in caplog.text
        make(folder, 4)
        make(folder, 6, complete=False)
        make(folder, 8, contents=["model"], final=True)  # the finished run's export
        plan = plan_start(cfg, str(folder), 8)
        assert (plan.kind, plan.step) == ("finished", 8)
        assert "step-6 is incomplete" in caplog.text
        plan = plan_start(cfg, str(folder), 10)  # more steps asked: resume from the newest full state
        assert (plan.kind, plan.step) == ("resume", 4) and "rng" not in plan.keys and "optimizer" in plan.keys
        assert "holds the model only (an export), not a resume point" in caplog.text
        cfg.load_step = 0
        assert plan_start(cfg, str(folder), 10).step == 0
    finally:
        logger.removeHandler(caplog.handler)


def test_start_plan_initial_load_and_nothing(tmp_path):
    source = tmp_path / "other"
    make(source, 3)
    cfg = ck(tmp_path, "--checkpoint.initial_load_path", str(source)).checkpoint
    plan = plan_start(cfg, str(tmp_path / "checkpoint"), 8)
    assert (plan.kind, plan.path, plan.keys) == ("initial_dcp", fs.step_dir(str(source), 3), ("model",))
    cfg.initial_load_model_only = False
    assert plan_start(cfg, str(tmp_path / "checkpoint"), 8).keys == tuple(FULL)
    cfg.initial_load_path = None
    assert plan_start(cfg, str(tmp_path / "checkpoint"), 8).kind == "none"


def test_a_dcp_failure_gathered_from_every_rank_becomes_one_clean_loading_error():
    """DCP gathers every rank's read failure into a `CheckpointException`, which is a BaseException: the
    loader must still turn it into the one-line CheckpointError (exit 2) naming the checkpoint and the
    rank, not a traceback."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from torchtrain.components.checkpoint.loading import CheckpointLoader
    from torchtrain.components.checkpoint.safety import CheckpointError, failure_line

    gathered = CheckpointException("read_data", {1: (PermissionError(13, "Permission denied"), None),
                                                 0: (OSError(5, "Input/output error"), None)})
    assert failure_line(gathered, 0) == ("rank 0: OSError: [Errno 5] Input/output error; "
                                         "rank 1: PermissionError: [Errno 13] Permission denied")
    assert failure_line(ValueError("bad\n  shape"), 3) == "rank 3: ValueError: bad shape"

    def load():
        raise gathered

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        loader = CheckpointLoader({}, None, None, None)
        with pytest.raises(CheckpointError, match=r"^\[checkpoint\] loading step-4 \(ck/step-4\) failed: rank 0: "
                                                  r"OSError: \[Errno 5\] Input/output error; rank 1: Permission"):
            loader.collective_try(load, "loading step-4 (ck/step-4) failed")
    finally:
        dist.destroy_process_group()
