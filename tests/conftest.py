"""Shared test helpers: tiny job settings and subprocess launchers for real torchrun runs."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import zygote

from torchtrain.utils.cpu_threads import usable_cores

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(REPO, "torchtrain")
_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+', re.M)

# One dataset cache for the whole session (every trainer subprocess inherits it): document datasets are
# prepared once per session, in a fresh folder, never in the user's ~/.cache.
# Under pytest-xdist the test processes inherit the first process's folder; only the process that made it
# removes it, at the end of its session.
_OWN_CACHE = "TORCHTRAIN_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["TORCHTRAIN_CACHE"] = tempfile.mkdtemp(prefix="torchtrain-test-cache-")
_CACHE = os.environ["TORCHTRAIN_CACHE"]
# The test plugins (tests/plugins) are importable in every subprocess; a job loads one only when it names it
# in job.custom_imports, e.g. the fault injection of the fault and checkpoint tests (FAULT_INJECTION).
PLUGINS = os.path.join(REPO, "tests", "plugins")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PLUGINS, os.environ.get("PYTHONPATH")) if p)
FAULT_INJECTION = ["--job.custom_imports", "fault_injection"]


def pytest_configure(config):
    """Each test process starts its zygote server (tests/zygote.py) before any test; the controller of a
    pytest-xdist run, which runs none, does not."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        zygote.start()


def pytest_collection_modifyitems(config, items):
    """The modules with long cases (a `dist` or `slow` test) first, the rest after them, each module's tests in their
    own order: the test processes take whole modules in this order (`--dist loadscope`), so the long ones start
    first and the many short ones fill in at the end, instead of one process finishing a long module alone while the
    others wait. The nightly tests (minutes each) run only when asked for: `-m nightly`."""
    long_modules = {item.module.__name__ for item in items if {"dist", "slow"} & set(item.keywords)}
    items.sort(key=lambda item: item.module.__name__ not in long_modules)  # (stable: the order within each part)
    if "nightly" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="nightly: select with -m nightly")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(skip)


_RUNNING: list = [None]
"""The test item being set up or run in this process (read by require_dist)."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _RUNNING[0] = item  # before its fixtures: a module fixture's launch is charged to the test that made it


def require_dist(what: str) -> None:
    """A test that starts a process group of two or more ranks is marked `dist`: the fast tier
    (`-m "not dist and not slow"`) leaves it out, and a one-GPU machine runs none of them."""
    item = _RUNNING[0]
    if item is not None and "dist" not in item.keywords:
        pytest.fail(f"{item.nodeid} {what} but is not marked @pytest.mark.dist", pytrace=False)


RENDEZVOUS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def world_of_one(monkeypatch) -> None:
    """For a trainer built in this process: no rendezvous variables, so that it opens a world of one itself, its
    store on a port the system picks as it binds (`distributed/utils.py::init_distributed`); restored after."""
    for key in RENDEZVOUS_ENV:
        # recorded as it was (unset), so that what the world of one writes is undone with this monkeypatch -- also
        # one of a module fixture, whose runs `_rendezvous_env_restored` (per test) sees as already there
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _rendezvous_env_restored():
    """A world of one opened in a test process (an in-process trainer or Accelerator) writes RANK, MASTER_PORT, ...
    into its environment: put them back after each test, or every later command this process starts would inherit a
    rank and the port this process's own store holds."""
    before = {key: os.environ.get(key) for key in RENDEZVOUS_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _project_logger_restored():
    """A command's main run in a test process (`launch_check.main`, an in-process trainer's logger set-up) sets the
    project logger's level and handlers for the whole process: put them back after each test, or a later test would
    not see the warnings it checks for (whether it does would depend on the order the tests ran in)."""
    from torchtrain.utils.logging import logger

    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): three test processes on two cores, one on one (one and a half per usable
    core, at most three). Two test processes leave cores idle whenever both wait at once: a launch's start-up and
    rendezvous, its store connections, a fault test waiting for a deadline. A third fills those gaps; the cap keeps
    the timing tests' load near what they were written for."""
    return max(1, min(3, usable_cores() * 3 // 2))


# Every process the tests start computes on one thread, as torchrun's workers do: the test processes
# (`-n auto`: up to three) and the ranks they launch already outnumber the cores of a small machine, and torch's
# default (a thread per core it sees -- on a container, the host's cores) would oversubscribe them many
# times over. One-process runs then reduce in the same order as the ranks they are compared with.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Where the environment asks Python not to write bytecode (PYTHONDONTWRITEBYTECODE), every process the suite starts
# would compile the package's modules from source again (~0.4 s for the trainer's own, and each module a forked
# command imports late); the suite lets Python keep them compiled beside the sources (`__pycache__`, ignored by git).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

# Every Python command a test starts (the trainer, launcher, planner, scripts) is forked from one warm interpreter
# per test process instead of importing torch afresh (tests/zygote.py; TORCHTRAIN_TEST_NO_ZYGOTE=1 turns it off).
zygote.install()


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE and os.path.basename(_CACHE).startswith("torchtrain-test-cache-"):
        shutil.rmtree(_CACHE, ignore_errors=True)


PARTITIONER_ONLY = "aot_eager_decomp_partition"
"""The backend of the compiled activation-checkpointing tests: AOTAutograd with Inductor's decompositions and its
min-cut partitioner, which decide what a compiled block saves, without Inductor's C++ code generation (which decides
nothing saved). Measured on torch 2.13: the same saved elements and losses as `backend="inductor"`, in a seventh of
the time on a cold compile cache. Inductor itself still compiles one selectively checkpointed block
(test_checkpoint_stand_ins.py, three projections)."""

# A model small enough that a 10-step multi-process run takes seconds on 2 CPU cores, with GQA
# (n_kv_heads < n_heads) so grouped-query attention is exercised too, and head counts that
# allow tensor parallelism up to 4.
TINY_MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "8", "--model.n_kv_heads", "4",
              "--model.vocab_size", "512"]
TINY_JOB = TINY_MODEL + ["--training.dataset", "synthetic", "--training.seq_len", "64",
                         "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2",
                         "--optimizer.lr", "3e-3", "--job.print_config", "false"]


def train_command(args: list[str], nproc: int | None = None, env: dict | None = None) -> tuple[list[str], dict]:
    """(command, environment) that run the trainer, under torchrun when nproc is given (through
    torchtrain.launcher, as run_train.sh does: torchrun's agent, with the workers started from a
    forkserver on CPU)."""
    if nproc is None:
        cmd = [sys.executable, "-m", "torchtrain.train", *args]
    else:
        if nproc > 1:
            require_dist(f"launches torchrun ({nproc} ranks)")
        cmd = [sys.executable, "-m", "torchtrain.launcher", f"--nproc_per_node={nproc}",
               "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "-m", "torchtrain.train", *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    full_env.pop("RANK", None)
    return cmd, full_env


def run_train(args: list[str], nproc: int | None = None, timeout: float = 600, env: dict | None = None
              ) -> subprocess.CompletedProcess:
    """Run the trainer (under torchrun when nproc is given) and return the finished process."""
    cmd, full_env = train_command(args, nproc, env)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)
    out.stderr = with_fatal_error_last(out.stderr)
    return out


def with_fatal_error_last(stderr: str, limit: int = 1500) -> str:
    """`stderr` with, when a worker died of a fatal signal, the start of Python's report of it (the
    signal and the innermost frames of the thread that raised it) repeated at the end: the report
    runs to many lines of every thread's stack, and tests show the tail of the output on failure."""
    start = stderr.find("Fatal Python error")
    if start < 0:
        return stderr
    current = stderr.find("Current thread", start)
    head = stderr[start:start + 300] if current < 0 else stderr[start:start + 100] + "\n...\n" + stderr[current:]
    return stderr + "\n---- the first fatal error report, from its start ----\n" + head[:limit]


def wait_for_pid_file(proc: subprocess.Popen, pid_file, what: str, timeout: float = 300) -> int:
    """Wait until a parked rank (TORCHTRAIN_TEST_WAIT_FOR_SIGNAL) wrote its pid file; return the pid.
    Fails with the process's output if it exits first, or with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(pid_file):
        assert proc.poll() is None, proc.communicate()[0][-5000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return int(open(pid_file).read())


def package_frames(text: str) -> list[str]:
    """Python traceback frames in `text` that point into torchtrain's own package. Decided by the
    frame's file, not by a substring of the output: the checkout folder (often named `torchtrain`),
    a virtual environment inside it, the user name or the working directory can appear anywhere."""
    package = os.path.realpath(PACKAGE_DIR) + os.sep
    return [f for f in _FRAME.findall(text) if os.path.realpath(f).startswith(package)]


def assert_no_traceback(text: str) -> None:
    """The output holds no Python traceback at all (a launcher that checked the job itself)."""
    assert "Traceback (most recent call last)" not in text and not _FRAME.search(text), text[-3000:]


def assert_no_trainer_traceback(text: str) -> None:
    """The trainer reported its error as a message: no traceback frame of torchtrain's code. (torchrun
    itself still prints its ChildFailedError traceback of the launcher when a worker exits non-zero.)"""
    assert not package_frames(text), text[-3000:]


def read_metrics(dump_folder: str) -> list[dict]:
    """metrics.jsonl's records, parsed as strict JSON (a bare NaN/Infinity token fails the test);
    non-finite values, written as null + "non_finite", come back as floats."""
    from torchtrain.utils.strict_json import read_jsonl

    return read_jsonl(os.path.join(dump_folder, "metrics.jsonl"))


@pytest.fixture
def tiny_job():
    return list(TINY_JOB)


PARITY_RUNS = os.path.join(REPO, "tests", "scripts", "parity_runs.py")


def run_together(argvs: list[list[str]], nproc: int, workdir: str, timeout: float = 1800) -> list[tuple[int, str]]:
    """Train several jobs (trainer arguments, each with its own --job.dump_folder) one after another in ONE
    launch of `nproc` processes (tests/scripts/parity_runs.py: one process group, one interpreter start per
    rank instead of one per job). Returns each job's (exit status, log): a job the launch did not finish
    gets the launch's exit status and the end of its output."""
    from torchtrain.tools.parity import launch_env, launcher_command

    os.makedirs(workdir, exist_ok=True)
    spec_file = tempfile.NamedTemporaryFile("w", suffix=".json", dir=workdir, delete=False)
    with spec_file:
        json.dump(argvs, spec_file)
    if nproc > 1:
        require_dist(f"launches torchrun ({nproc} ranks)")
    cmd = ([sys.executable] if nproc == 1 else launcher_command(nproc)) + [PARITY_RUNS, spec_file.name]
    env = launch_env()  # a script's folder comes first on its path: this checkout's package must win
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    outcomes = []
    for argv in argvs:
        dump = argv[len(argv) - 1 - argv[::-1].index("--job.dump_folder") + 1]
        log_path = os.path.join(dump, "launch.log")
        log = open(log_path).read() if os.path.exists(log_path) else ""
        if f"PARITY-RUN-DONE {dump}" in proc.stdout:
            outcomes.append((0, log))
        else:  # with what the other ranks printed (a native abort's message among it)
            ranks = "".join(f"\n--- {os.path.basename(path)}:\n{open(path).read()[-2000:]}"
                            for path in sorted(glob.glob(f"{dump.rstrip(os.sep)}.rank*.log")) if os.path.getsize(path))
            outcomes.append((proc.returncode or 1, log + proc.stdout[-3000:] + proc.stderr[-5000:] + ranks))
    return outcomes


class ParitySuite:
    """One baseline run (one process) shared by a test module; candidates are compared against it.

    `layouts` (specs, or (spec, extra overrides) pairs) are run up front together with the baseline: one
    launch per process count (tests/scripts/parity_runs.py trains them one after another in one process
    group), instead of one launch per layout; `check` then uses their results. A variant of the job (another
    flavor, say) shares those launches by listing ("single", extra) with its layouts: `check(..., extra=extra)`
    compares them against that one-process run."""

    def __init__(self, workdir: str, overrides: list[str], steps: int = 6, layouts=()):
        self.workdir, self.overrides, self.steps = workdir, overrides, steps
        self.results = {}
        self._run_together([("single", ())] + [(s, ()) if isinstance(s, str) else (s[0], tuple(s[1])) for s in layouts])
        self.baseline = self.results["single", ()]
        assert self.baseline.returncode == 0, self.baseline.log[-3000:]

    def _run_together(self, keys):
        from torchtrain.tools.parity import layout_arguments, layout_dump_folder, parse_layout, read_result

        groups = {}
        for spec, extra in keys:
            layout = parse_layout(spec)
            groups.setdefault(layout.nproc, []).append((spec, extra, layout))
        for nproc, group in groups.items():
            dumps = [layout_dump_folder(layout, self.variant_folder(extra)) for _, extra, layout in group]
            argvs = [layout_arguments(layout, None, self.steps, self.overrides + list(extra), dump)
                     for (_, extra, layout), dump in zip(group, dumps)]
            outcomes = run_together(argvs, nproc, self.workdir)
            for (spec, extra, layout), dump, (rc, log) in zip(group, dumps, outcomes):
                self.results[spec, extra] = read_result(layout, dump, rc, log)

    def variant_folder(self, extra=()) -> str:
        """Where the runs with `extra` overrides keep their dump folders (the job's own: the suite's folder)."""
        if not extra:
            return self.workdir
        return os.path.join(self.workdir, "variant-" + hashlib.sha1(" ".join(extra).encode()).hexdigest()[:10])

    def resume(self, spec: str, step: int, extra=()):
        """Run `spec` (with `extra`) again, in a fresh folder holding only the step-`step` checkpoint of its
        run in this suite: it resumes from there and runs to the suite's last step. Returns the run."""
        from torchtrain.tools.parity import layout_dump_folder, parse_layout, run_layout

        layout, resume_dir = parse_layout(spec), os.path.join(self.variant_folder(extra), "resume")
        saved = os.path.join("checkpoint", f"step-{step}")
        shutil.copytree(os.path.join(layout_dump_folder(layout, self.variant_folder(extra)), saved),
                        os.path.join(layout_dump_folder(layout, resume_dir), saved))
        run = run_layout(layout, None, self.steps, self.overrides + list(extra), resume_dir)
        assert run.returncode == 0, run.log[-3000:]
        return run

    def check_resumes_bitwise(self, spec: str, step: int, extra=(), rtol: float = 1e-4, atol: float = 0.0):
        """`spec` (with `extra`, which must save a checkpoint at `step`) matches the baseline, and a rerun from its
        step-`step` checkpoint continues to the last step with bitwise-equal losses. Returns (straight, resumed)."""
        first, = self.check([spec], rtol=rtol, extra=extra, atol=atol)
        resumed = self.resume(spec, step, extra)
        ref = {r["step"]: r["loss"] for r in first.records}
        got = {r["step"]: r["loss"] for r in resumed.records}
        assert "resumed from" in resumed.log
        assert sorted(got) == list(range(step + 1, self.steps + 1)) and all(got[s] == ref[s] for s in got), (ref, got)
        return first, resumed

    def check(self, layouts: list[str], rtol: float = 1e-4, extra=(), atol: float = 0.0):
        """Run each layout (unless it ran up front), print the per-step table, assert every layout matches (within
        `rtol` relative or `atol` absolute: `parity.compare`); return the runs."""
        from torchtrain.tools.parity import compare, format_table, parse_layout, run_layout

        def launch(spec: str):
            layout = parse_layout(spec)
            if layout.nproc > 1:
                require_dist(f"launches torchrun ({layout.nproc} ranks)")
            return run_layout(layout, None, self.steps, self.overrides + list(extra), self.variant_folder(extra))

        runs = [self.results.get((s, tuple(extra))) or launch(s) for s in layouts]
        baseline = self.results.get(("single", tuple(extra)), self.baseline)  # a variant's own, when it ran one
        assert baseline.returncode == 0, baseline.log[-3000:]
        comps = [compare(baseline, r, self.steps, rtol, atol) for r in runs]
        table = format_table(baseline, comps, rtol)
        print(table)
        assert all(c.ok for c in comps), table
        return runs
