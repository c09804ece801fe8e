"""The GPU evidence kit (benchmarks/gpu/) runs end to end on the CPU in its --dry-run mode, so it is known
to work before it meets a GPU: every part writes its result, summary.md says it is a dry run, the archive
a GPU command brings back merges into the same summary, and a time budget (--budget-s, SIGTERM) skips or
stops runs while still writing the summary of what finished."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conftest import REPO

KIT = os.path.join(REPO, "benchmarks", "gpu", "run_all.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _budget_module():
    spec = importlib.util.spec_from_file_location("gpu_kit_budget", os.path.join(REPO, "benchmarks", "gpu", "budget.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit")
    proc = subprocess.run([sys.executable, KIT, "--dry-run", "--out", str(out / "kit"), "--pack",
                           str(out / "kit.tar.gz")], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=600)
    return out, proc


def test_dry_run_runs_every_part(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = {p: json.load(open(out / "kit" / f"{p}.json")) for p in "abcdef"}
    assert all(r["ok"] for r in results.values()), {p: r["rows"] for p, r in results.items() if not r["ok"]}
    a = results["a"]["rows"][0]
    assert a[1] > 0 and a[2] == 0  # pytest ran tests on the "device" and none failed
    b = {(row[0], row[1]): row for row in results["b"]["rows"]}
    assert b[("debug", "float8")][5] is True and b[("debug", "fp16 + loss scaling")][5] is True  # falling
    assert any("cpu offload: not run in a dry run" in n for n in results["b"]["notes"])
    assert {row[1] for row in results["c"]["rows"]} == {"eager", "float8 (emulated)"}
    assert {row[0] for row in results["c"]["rows"]} == {2048}  # the headline's one sequence length
    assert all(row[4] is not None for row in results["c"]["rows"])  # MFU against the measured peak
    # (d) and (e) reuse (c)'s runs of the same command line instead of training again
    assert results["d"]["rows"][0][4] == "c/seq2048_eager"
    e = results["e"]["rows"]
    assert len(e) == 2 and all(row[1] and row[2] and row[4] and row[5] for row in e)  # planned and measured
    assert [row[7] for row in e] == ["c/seq2048_eager", "c/seq2048_float8_emulated"]
    assert not os.path.exists(out / "kit" / "e" / "seq2048_eager")
    # without a budget nothing is skipped, and every run's estimate and duration are recorded
    assert all(not r["skipped"] for r in results.values())
    assert [run[0] for run in results["f"]["runs"]] == ["f/straight", "f/resumed (steps 1-4, saved)",
                                                        "f/resumed (steps 5-8)"]
    assert all(run[1] > 0 and run[2] > 0 for r in results.values() for run in r["runs"])
    f = results["f"]["rows"]
    assert f[1][2] == 0.0  # resumed losses bitwise equal
    job = tomllib.load(open(out / "kit" / "d" / "torchtitan" / "job_eager.toml", "rb"))
    assert job["experimental"]["custom_import"] == "titan_flavor" and job["training"]["dataset"] == "c4_test"
    summary = (out / "kit" / "summary.md").read_text()
    assert "Dry run on a CPU at tiny size: these are not CUDA figures" in summary
    assert all(f"## ({p})" in summary for p in "abcdef")
    assert "runs finished (estimated s / took s): f/straight" in summary
    with tarfile.open(out / "kit.tar.gz") as tar:  # the archive leaves the checkpoints out
        names = tar.getnames()
    assert "kit/f/resumed/metrics.jsonl" in names and not any("/checkpoint" in n for n in names)


def test_archives_merge_into_one_summary(dry_run, tmp_path):
    out, proc = dry_run
    assert proc.returncode == 0
    merged = tmp_path / "merged"
    done = subprocess.run([sys.executable, KIT, "--merge", str(out / "kit.tar.gz"), "--out", str(merged)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (merged / "summary.md").read_text() == (out / "kit" / "summary.md").read_text()


def test_budget_estimates_from_the_table_then_from_what_ran():
    budget = _budget_module()
    now = [0.0]
    b = budget.Budget(200.0, clock=lambda: now[0])
    job = ["--model.flavor", "1B", "--training.seq_len", "2048", "--training.local_batch_size", "2",
           "--training.steps", "15"]
    eager = budget.spec_of(job, dry=False)
    float8 = budget.spec_of(job + ["--model.converters", "float8"], dry=False)
    compiled = budget.spec_of(job + ["--compile.enable", "true", "--model.converters", "float8"], dry=False)
    plain_compiled = budget.spec_of(job + ["--compile.enable", "true"], dry=False)
    assert (eager.model, eager.mode, eager.tokens, eager.steps) == ("1B", "eager", 4096, 15)
    assert (float8.mode, compiled.mode) == ("float8", "compile+float8")
    assert b.estimate(eager) == pytest.approx(12.0 + 15 * 0.15)  # the table
    b.done(b.admit("c", "c/eager", b.estimate(eager)), 20.0, eager, step_s=0.2)  # 17 s of overhead
    assert b.estimate(eager) == pytest.approx(17.0 + 15 * 0.2)  # its own measurement
    # the process's first run also pays one-time imports: it refines step times, not other modes' overheads
    assert b.estimate(compiled) == pytest.approx(75.0 + 15 * 0.09 * (0.2 / 0.15))
    b.done(b.admit("c", "c/float8", b.estimate(float8)), 30.0, float8, step_s=0.3)  # 25.5 s of overhead
    step_ratio = (0.2 / 0.15 + 0.3 / 0.17) / 2
    assert b.estimate(compiled) == pytest.approx(75.0 + 15 * 0.09 * step_ratio)  # no compiled run measured yet
    b.done(b.admit("c", "c/compile", b.estimate(plain_compiled)), 105.0, plain_compiled, step_s=0.11)  # 1.5 x
    # compiled modes now scale by the compiled run's drift; steps by the median measured/table ratio
    drift, step_ratio = (105.0 - 15 * 0.11) / 60.0, 0.2 / 0.15  # median of 1.33, 1.76 and 1.0
    assert b.estimate(compiled) == pytest.approx(75.0 * drift + 15 * 0.09 * step_ratio)
    assert b.estimate(float8) == pytest.approx(25.5 + 15 * 0.3)  # eager-side modes keep their own
    now[0] = 150.0  # 50 s left: the ~131 s compiled float8 run is skipped, a cheaper one still starts
    assert b.admit("c", "c/compile_float8", b.estimate(compiled)) is None
    assert b.admit("f", "f/straight", 5.0) is not None
    finished, skipped = b.of_part("c")
    assert finished == [["c/eager", 14.2, 20.0], ["c/float8", 18.4, 30.0], ["c/compile", 62.6, 105.0]]
    assert skipped == ["c/compile_float8: needs ~131 s (estimated), 50 s of the budget left"]
    assert budget.Budget().left() == math.inf


def test_budget_deadline_stops_the_run_in_flight_only():
    budget = _budget_module()
    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGALRM)
    b = budget.Budget(0.3)
    try:
        b.arm()
        with pytest.raises(budget.Stop, match="budget's 0 s ran out"):
            with b.interruptible():  # a run in flight: stopped at the deadline
                time.sleep(5)
        assert b.stopped and b.admit("b", "b/next", 1.0) is None  # nothing starts after it
        assert b.entries[-1].reason == "not started: the budget's 0 s ran out"
        os.kill(os.getpid(), signal.SIGTERM)  # outside a run a signal only marks the budget
        with pytest.raises(budget.Stop):
            with b.interruptible():
                pass
    finally:
        b.disarm()
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGALRM, saved[1])


def test_spent_budget_skips_every_run_and_names_it(tmp_path):
    proc = subprocess.run([sys.executable, KIT, "--dry-run", "--part", "f,c,a", "--budget-s", "0", "--out",
                           str(tmp_path / "kit")], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {p: json.load(open(tmp_path / "kit" / f"{p}.json")) for p in "acf"}
    assert all(r["runs"] == [] and r["rows"] == [] for r in results.values())
    assert [s.split(":")[0] for s in results["c"]["skipped"]] == ["c/seq2048_eager", "c/seq2048_float8_emulated"]
    assert results["a"]["skipped"][0].startswith("a/pytest: needs ~5 s (estimated), 0 s of the budget left")
    summary = (tmp_path / "kit" / "summary.md").read_text()
    assert "## (f) Checkpoint save/resume exactness: OK, 2 runs skipped" in summary
    assert "- skipped: f/straight: needs ~" in summary and "## (b) not run" in summary


def test_sigterm_stops_the_kit_and_keeps_what_finished(tmp_path):
    out = tmp_path / "kit"
    proc = subprocess.Popen([sys.executable, KIT, "--dry-run", "--part", "d,b,c", "--out", str(out), "--pack",
                             str(tmp_path / "kit.tar.gz")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, env=ENV)
    for line in proc.stdout:  # SIGTERM as soon as (d) is done: (b) is then about to start, or running
        if "part d: " in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2, rest[-3000:]
    d, b, c = (json.load(open(out / f"{p}.json")) for p in "dbc")
    assert d["ok"] and d["rows"][0][1] > 0 and [run[0] for run in d["runs"]] == ["d/torchtrain_eager"]
    assert b["notes"] == ["not started: SIGTERM"] or b["skipped"] and all("SIGTERM" in s for s in b["skipped"])
    assert c["notes"] == ["not started: SIGTERM"] and not c["runs"]
    with tarfile.open(tmp_path / "kit.tar.gz") as tar:  # the archive is rewritten after the stop
        summary = tar.extractfile("kit/summary.md").read().decode()
    assert "## (c) 1B throughput and MFU: NOT STARTED" in summary and "## (d) torchtrain vs torchtitan" in summary
