"""The launchers check the job once, before torchrun starts (torchtrain/launch_check.py): a bad job is
one `torchtrain: config error: ...` line and exit code 2 -- no torchrun, no traceback per rank, no
wait on other ranks or nodes. Each case runs one Python process (~2 s)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest
from conftest import REPO, TINY_JOB, assert_no_traceback

from torchtrain.config import ConfigError
from torchtrain.launch_check import parse_launch

ENV = {"CUDA_VISIBLE_DEVICES": "", "CONFIG_FILE": "train_configs/debug_model.toml"}


def run_train_sh(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, **{**ENV, **env})
    full.pop("RANK", None)
    return subprocess.run(["./run_train.sh", *args], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_clean_error(out: subprocess.CompletedProcess, message: str) -> None:
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr  # one line
    assert out.stderr.startswith("torchtrain: config error: ") and message in out.stderr, out.stderr
    assert_no_traceback(out.stdout + out.stderr)
    assert "[rank" not in out.stdout + out.stderr  # torchrun never started a worker


def test_run_train_reports_an_unknown_key_once_without_torchrun():
    out = run_train_sh("--training.stepz", "10", NGPU="2")
    assert_one_clean_error(out, "unknown key training.stepz (on the command line); did you mean 'steps'?")


def test_multi_node_job_is_checked_for_the_whole_world_before_the_rendezvous():
    """2 nodes x 2 processes = world size 4 is checked on this node alone: without the check this
    node's torchrun would wait for the other node's rendezvous (here: the 60 s timeout)."""
    out = run_train_sh(*TINY_JOB, "--parallelism.tensor_parallel_degree", "3", NGPU="2", NNODES="2", NODE_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    assert_one_clean_error(out, "world size 4 is not divisible by")


def test_non_utf8_job_file_is_a_config_error_naming_the_file(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('[job]\ndescription = "café"\n'.encode("latin-1"))
    out = run_train_sh(CONFIG_FILE=str(bad))
    assert_one_clean_error(out, f"[job.config_file] {bad} is not UTF-8 text (byte 0xe9 at line 2)")


def test_slurm_script_checks_the_job_before_srun(tmp_path):
    shims = tmp_path / "shims"
    shims.mkdir()
    for name in ("srun", "scontrol", "scancel"):
        (shims / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "{tmp_path}/calls"\n'
                                  + ('[ "$1" = show ] && echo localhost\n' if name == "scontrol" else ""))
        (shims / name).chmod(stat.S_IRWXU)
    env = dict(os.environ, **ENV, PATH=f"{shims}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_NNODES="2",
               SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=REPO, GPUS_PER_NODE="8")
    env.pop("RANK", None)
    out = subprocess.run(["bash", "scripts/multinode_trainer.slurm", *TINY_JOB, "--parallelism.tensor_parallel_degree",
                          "32"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert_one_clean_error(out, "world size 16 is not divisible")  # 2 nodes x GPUS_PER_NODE 8
    assert "srun" not in (tmp_path / "calls").read_text()


def test_launch_check_passes_a_good_job_and_prints_the_processes_per_node():
    out = subprocess.run([sys.executable, "-m", "torchtrain.launch_check", "--nproc-per-node", "4", "--nnodes", "2",
                          "--job.config_file", "train_configs/debug_model.toml", *TINY_JOB], cwd=REPO,
                         env=dict(os.environ, **ENV), capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, "4\n", "")


def test_parse_launch():
    assert parse_launch(["--nproc-per-node", "8", "--nnodes", "4", "--training.steps", "3"]) == (
        8, 4, None, ["--training.steps", "3"])
    assert parse_launch(["--nnodes", "1:4", "--nproc-per-node", "2"]) == (2, None, None, [])  # elastic: no world size
    assert parse_launch(["--nproc-per-node", "1", "--print", "fault.sdc_exclude_file", "--job.config_file", "j.toml"]
                        ) == (1, 1, "fault.sdc_exclude_file", ["--job.config_file", "j.toml"])
    with pytest.raises(ConfigError, match="--nproc-per-node '0'"):
        parse_launch(["--nproc-per-node", "0"])
    with pytest.raises(ConfigError, match="usage"):
        parse_launch(["--training.steps", "3"])


def test_launcher_starts_the_trainer_from_a_forkserver_on_cpu_unless_told_otherwise():
    """Without a GPU the launcher's workers (the trainer's, or a Python file's) start from a forkserver
    that imported the trainer once; an explicit --start-method, another module, --no-python or a static
    rendezvous keeps torchrun's own way."""
    import torch
    from torch.distributed.run import parse_args

    from torchtrain.launcher import choose_start_method, uses_forkserver

    def decide(*argv: str) -> bool:
        args = parse_args(list(argv))
        choose_start_method(args, list(argv))
        return uses_forkserver(args)

    c10d = ("--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0")
    assert decide(*c10d, "-m", "torchtrain.train") == (not torch.cuda.is_available())
    assert decide("--standalone", "--nproc_per_node=2", "-m", "torchtrain.train") == (not torch.cuda.is_available())
    assert decide("--start-method", "forkserver", *c10d, "-m", "torchtrain.train")
    assert not decide("--start-method", "spawn", *c10d, "-m", "torchtrain.train")
    script = "examples/text_classifier/train_distributed.py"
    assert decide(*c10d, script) == (not torch.cuda.is_available())
    assert decide("--start-method", "forkserver", *c10d, script)
    assert not decide("--start-method", "spawn", *c10d, script)
    assert not decide("--start-method", "forkserver", *c10d, "-m", "torchtrain.generate")
    assert not decide("--start-method", "forkserver", *c10d, "--no-python", "echo")
    assert not decide("--start-method", "forkserver", "--nproc_per_node=2", "--master_port=29500",
                      "-m", "torchtrain.train")


def test_rank_logs_go_to_the_run_folder_unless_the_command_line_names_a_place():
    """torchrun's per-rank files (teed output, error records) of a training job are kept in its run folder (a
    replica group's own with replica_ft), by host, instead of a new temporary folder per launch; --log-dir / --logs-specs on
    the command line keeps its own; a Python file's launch (no job to name a folder) gets a temporary folder, which
    the launcher removes after a launch that succeeds."""
    import socket

    from torch.distributed.run import parse_args

    from torchtrain.config import parse_args as parse_job
    from torchtrain.launcher import RANK_LOGS, keep_rank_logs

    def log_dir(*argv: str, temporary: bool = False) -> str | None:
        args = parse_args(list(argv))
        job = parse_job(args.training_script_args) if args.training_script == "torchtrain.train" else None
        made = keep_rank_logs(args, list(argv), job)
        assert (made is not None) == temporary and made == (args.log_dir if temporary else None)
        return args.log_dir

    c10d = ("--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--tee", "3")
    host = socket.gethostname()
    assert log_dir(*c10d, "-m", "torchtrain.train", "--job.dump_folder", "out/a") == os.path.join("out/a", RANK_LOGS, host)
    # torchrun names each launch's folder in it by the rendezvous id: on one node, the launch's date and time
    for given, expected in (((), r"\d{8}-\d{6}"), (("--rdzv-id", "mine"), "mine"), (("--nnodes", "2"), "none")):
        args = parse_args([*c10d, *given, "-m", "torchtrain.train"])
        keep_rank_logs(args, [*c10d, *given], parse_job([]))
        assert re.fullmatch(expected, args.rdzv_id), (given, args.rdzv_id)
    assert log_dir(*c10d, "-m", "torchtrain.train", "--job.dump_folder", "out/a", "--fault.replica_ft",
                   "--parallelism.data_parallel_replicate_degree", "2",
                   "--fault.replica_id", "1") == os.path.join("out/a", "replica_1", RANK_LOGS, host)
    for given in (("--log-dir", "mine"), ("--log_dir=mine",)):
        assert log_dir(*given, *c10d, "-m", "torchtrain.train") == "mine"
    assert log_dir("--logs-specs", "own", *c10d, "-m", "torchtrain.train") is None
    made = log_dir(*c10d, "examples/text_classifier/train_distributed.py", temporary=True)
    assert os.path.isdir(made) and os.path.basename(made).startswith("torchelastic_")
    os.rmdir(made)
    assert log_dir("--log-dir", "mine", *c10d, "examples/text_classifier/train_distributed.py") == "mine"


def test_a_killed_worker_is_named_beside_the_peer_torch_reports():
    """torch names the first failed worker it finds: after `kill -9` of rank 1, rank 0's collective error (exit 1)
    may come first; the launcher names the killed rank too, and not the ranks its own SIGTERM ended."""
    import signal
    import types

    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from torchtrain.utils.worker_failures import describe_failures, signalled_peers

    context = object.__new__(MultiprocessContext)
    context._pc = types.SimpleNamespace(processes=[types.SimpleNamespace(pid=10 + i, exitcode=code) for i, code in
                                                   enumerate([1, -signal.SIGKILL, -signal.SIGTERM, 0])])
    agent = types.SimpleNamespace(_pcontext=context)
    group = types.SimpleNamespace(workers=[types.SimpleNamespace(global_rank=4 + i) for i in range(4)])
    failures = {4: ProcessFailure(0, 10, 1, "")}
    failures.update(signalled_peers(agent, group, failures))
    assert describe_failures(failures) == "rank 4: exit 1, rank 5: signal SIGKILL"
    assert signalled_peers(types.SimpleNamespace(_pcontext=None), group, {}) == {}


def test_a_failed_worker_is_named_with_the_first_line_of_its_error(tmp_path):
    """The one line of a restart or a failure says why a worker failed, from the error record torchrun's worker
    wrote (a peer node lost: the collective's "Connection reset by peer"), cut to REASON_CHARS; a worker that
    recorded nothing (a signal, an exit status of its own) is named by its exit alone."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from torchtrain.utils.worker_failures import REASON_CHARS, describe_failures

    def recorded(name: str, message: str) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "0", "py_callstack":
                                                                                  "Traceback ..."}}}))
        return str(path)

    gone = recorded("gone.json", "RuntimeError: [/src/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4765: Connection reset by peer.\n"
                                 "Traceback (most recent call last): ...")
    long = recorded("long.json", "ValueError: " + "x" * 400)
    failures = {0: ProcessFailure(0, 10, 1, gone), 1: ProcessFailure(1, 11, -9, ""), 2: ProcessFailure(2, 12, 1, long)}
    line = describe_failures(failures)
    assert line.startswith("rank 0: exit 1 (RuntimeError: Read error [127.0.0.1]:4765: Connection reset by peer.), "
                           "rank 1: signal SIGKILL, rank 2: exit 1 (ValueError: xxx"), line
    assert line.endswith("...)") and len(line.split("rank 2: exit 1 (")[1]) == REASON_CHARS + 1


def test_the_agent_counts_each_start_so_a_worker_killed_before_it_counted_keeps_its_peers_namespace(monkeypatch):
    """Each attempt's default process group lives under the workers' start count in torchrun's store. The launcher's
    agent counts every start of its workers before starting them: a worker killed during start-up (before it read
    its count) still reads its peers' count at the next start, where counting its own would leave it one behind."""
    import torch.distributed as dist

    from torchtrain.distributed.utils import STARTS_COUNTED_BY_AGENT, count_starts, worker_start

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv(STARTS_COUNTED_BY_AGENT, "1")
    for _ in range(3):  # three attempts; rank 1 was killed before it read its count in the first two
        count_starts("127.0.0.1", store.port, [0, 1])
    starts = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        worker_start.cache_clear()
        starts[rank] = worker_start()
    worker_start.cache_clear()
    assert starts == {0: 3, 1: 3}


def test_a_python_without_torch_is_told_so_in_one_line():
    """run_train.sh under a `python` that lacks the dependencies (the environment not activated): the launch check
    names the missing module and the interpreter in one line, exit 2, no traceback, no torchrun."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['launch_check', '--nproc-per-node', '1']; "
            "runpy.run_module('torchtrain.launch_check', run_name='__main__', alter_sys=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.startswith("torchtrain: the module 'torch' is not installed for ") and out.stderr.count("\n") == 1
    assert_no_traceback(out.stderr)


def test_an_elastic_range_gives_each_rendezvous_round_a_store_of_its_own(monkeypatch):
    """`--nnodes MIN:MAX` (MIN < MAX) switches torchrun from the agents' shared store to a store per round, which a
    node joining a running job needs (tests/test_elastic.py runs it); a fixed number of nodes keeps the shared one,
    and a value the environment sets is kept."""
    from types import SimpleNamespace

    from torchtrain.distributed.agent_stores import ROUND_STORES, store_per_round

    for nnodes, expected in (("2", None), ("1:1", None), ("1:2", "1"), ("2:8", "1")):
        monkeypatch.delenv(ROUND_STORES, raising=False)
        store_per_round(SimpleNamespace(nnodes=nnodes))
        assert os.environ.get(ROUND_STORES) == expected, nnodes
    monkeypatch.setenv(ROUND_STORES, "0")
    store_per_round(SimpleNamespace(nnodes="1:2"))
    assert os.environ[ROUND_STORES] == "0"


def test_every_command_under_a_python_without_the_dependencies_says_so_in_one_line():
    """`python -m torchtrain.<command>` under an interpreter that cannot find the dependencies (here `-S`: no
    site-packages, the checkout found as the working directory) ends before its first import of torch: one line
    naming the module and the interpreter, exit 2, no traceback (torchtrain/__init__.py)."""
    for command in ("train", "generate", "score", "plan", "data.prepare", "launcher"):
        out = subprocess.run([sys.executable, "-S", "-m", f"torchtrain.{command}", "--help"], capture_output=True,
                             text=True, cwd=REPO, timeout=60)
        assert out.returncode == 2 and out.stdout == "", (command, out.stdout, out.stderr)
        assert out.stderr.startswith("torchtrain: the module 'torch' is not installed for "), (command, out.stderr)
        assert out.stderr.count("\n") == 1, (command, out.stderr)


def test_a_rank_holds_two_connections_to_the_agents_store(monkeypatch, tmp_path):
    """A rank connects to torchrun's store once for its start count and its default process group, and once for the
    hang monitor and the straggler windows (both on here) -- not once each: the agent's server keeps every socket, and
    torch looks up the peer's name at both ends of each (a resolver that answers slowly stalls the whole start)."""
    import time
    import types

    import torch
    import torch.distributed as dist

    from torchtrain.components.fault.runtime import FaultRuntime
    from torchtrain.config.fault import Fault
    from torchtrain.config.job import Debug
    from torchtrain.config.parallelism import Comm
    from torchtrain.distributed.utils import STARTS_COUNTED_BY_AGENT, init_distributed, worker_start

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port), RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", TORCHELASTIC_USE_AGENT_STORE="True").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(STARTS_COUNTED_BY_AGENT, "1")
    clients, store_class = [], dist.TCPStore

    def counted(*args, **kwargs):
        clients.append(store_class(*args, **kwargs))
        return clients[-1]

    monkeypatch.setattr(dist, "TCPStore", counted)
    worker_start.cache_clear()
    try:
        init_distributed(Comm(), torch.device("cpu"))
        fault = Fault(hang_timeout_s=60.0, straggler_freq=10)
        runtime = FaultRuntime(fault, Debug(), str(tmp_path), types.SimpleNamespace(step=0), torch.device("cpu"),
                               0, 2, user_profiler=False)
        deadline = time.monotonic() + 30
        while runtime.monitor.store is None and time.monotonic() < deadline:  # the monitor's thread connects
            time.sleep(0.01)
        assert runtime.monitor.store is runtime.store is not None
        runtime.monitor.finish()  # (the end of training, published through that client)
        runtime.monitor.stop()
        assert len(clients) == 2, clients
    finally:
        worker_start.cache_clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_host_a_replica_check_named_refuses_to_start_the_job(tmp_path):
    """fault.sdc_exclude_file lists the hosts whose devices a replica check named: the launcher does not start the
    job on one of them (exit 6, one line with the way out), before any worker starts; other hosts start."""
    import socket

    listed = tmp_path / "exclude.txt"
    listed.write_text(f"other-node\n{socket.gethostname()}\n")
    launch = [sys.executable, "-m", "torchtrain.launcher", "--nproc_per_node=2", "-m", "torchtrain.train", *TINY_JOB,
              "--training.steps", "1", "--job.dump_folder", str(tmp_path / "run")]
    proc = subprocess.run([*launch, "--fault.sdc_exclude_file", str(listed)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 6, proc.stderr[-3000:]
    assert proc.stderr.strip().startswith(f"torchtrain: sdc: this host ({socket.gethostname()}) is listed in "
                                          f"fault.sdc_exclude_file ({listed})"), proc.stderr[-3000:]
    assert "--exclude=" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert_no_traceback(proc.stderr)
    assert not (tmp_path / "run").exists()

    from torchtrain.components.fault.replica_check import excluded_here

    listed.write_text("other-node\n")
    assert excluded_here(str(listed)) is None and excluded_here(str(tmp_path / "missing.txt")) is None


def test_rendezvous_events_are_named_as_torch_names_them():
    """`utils/elastic_events.py`: the recording method's caller, as torch's `inspect.stack()` lookup finds it."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from torchtrain.utils import elastic_events

    def record(name_of):  # as the rendezvous's `_record`: the name asked for is its caller's
        return name_of()

    def next_rendezvous(name_of):
        return record(name_of)

    assert next_rendezvous(elastic_events.method_name) == next_rendezvous(lambda: inspect.stack()[2].function)
    assert next_rendezvous(elastic_events.method_name) == "next_rendezvous"
    assert elastic_events.method_name(10_000) == "no_method_name"
    elastic_events.install()
    assert dynamic_rendezvous.get_method_name is elastic_events.method_name
