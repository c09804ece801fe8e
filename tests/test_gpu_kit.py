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


def _budget_module(name: str = "budget"):
    spec = importlib.util.spec_from_file_location(f"gpu_kit_{name}", os.path.join(REPO, "benchmarks", "gpu", f"{name}.py"))
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


@pytest.mark.slow  # the dry run trains every part's runs (multi-process ones among them): not for the fast tier
def test_dry_run_runs_every_part(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = {p: json.load(open(out / "kit" / f"{p}.json")) for p in "abcdefghij"}
    assert all(r["ok"] for r in results.values()), {p: r["rows"] for p, r in results.items() if not r["ok"]}
    a = results["a"]["rows"][0]
    assert a[1] > 0 and a[2] == 0  # pytest ran tests on the "device" and none failed
    for name in ("junit.xml", "pytest.log"):  # the report names the project's files, not the checkout's location
        assert REPO + os.sep not in (out / "kit" / "a" / name).read_text(), name
    b = {(row[0], row[1]): row for row in results["b"]["rows"]}
    assert b[("debug", "float8")][5] is True and b[("debug", "fp16 + loss scaling")][5] is True  # falling
    assert any("cpu offload: not run in a dry run" in n for n in results["b"]["notes"])
    c = results["c"]["rows"]  # [seq, batch, mode, tokens/s, TFLOP/s, MFU vs measured peak, ...]
    assert [(row[0], row[1], row[2]) for row in c] == [(2048, 2, "eager"), (2048, 4, "eager")]  # two batches
    assert all(row[3] > 0 and row[5] is not None for row in c)  # MFU against the measured peak
    # (d), (e) and (g) reuse (c)'s runs of the same command line instead of training again
    d = results["d"]["rows"]  # [batch, mode, torchtrain tokens/s (window), torchtitan ..., ratio, ..., run, error]
    assert [(row[0], row[1], row[8]) for row in d] == [(2, "eager", "c/b2_eager"), (4, "eager", "c/b4_eager")]
    # one protocol on both sides, stated in the tables: the window, its N, the cadence, how each side is timed
    protocol = "protocol: steps 4-6 (N = 3 after 3 warm-up) timed on each side between two device synchronisations"
    assert all(any(n.startswith(protocol) and "neither side logs inside the window (log_freq 7" in n
                   for n in results[p]["notes"])
               for p in "cdgi")
    for name in ("b2_eager", "b4_eager"):  # the window timed by the protocol, and its tokens/s the table's
        window = json.load(open(out / "kit" / "c" / name / "window.json"))
        assert (window["first"], window["last"], window["steps"]) == (4, 6, 3) and window["seconds"] > 0
    assert c[0][3] == pytest.approx(64 * 2 * 3 / json.load(open(out / "kit" / "c" / "b2_eager" / "window.json"))["seconds"], abs=1)
    job_text = (out / "kit" / "d" / "torchtitan" / "job_eager_b2.toml").read_text()
    assert "log_freq = 7" in job_text and "steps = 6" in job_text  # torchtitan: the same window and cadence
    # torchtitan's own train step ran on the CPU inside the same window, with the same host work inside it
    assert d[0][3] > 0 and d[0][9] is None and d[1][3] is None, d  # once in a dry run: batch 2
    for batch in (2,):
        theirs = json.load(open(out / "kit" / "d" / "torchtitan" / f"out_eager_b{batch}" / "window.json"))
        ours = json.load(open(out / "kit" / "c" / f"b{batch}_eager" / "window.json"))
        assert (theirs["first"], theirs["last"]) == (4, 6) and len(theirs["step_times"]) == 3
        assert theirs["host_syncs"] == ours["host_syncs"] == 0
        assert f"batch {batch} eager: host syncs inside the window: torchtrain 0, torchtitan 0" in results["d"]["notes"]
    # the 8B row on one H200: the planner picked its batch, the dry run lists it
    i = results["i"]
    assert [(row[0], row[1]) for row in i["rows"]] == [("8B", "h200")] and i["rows"][0][2] in (1, 2, 4)
    assert any(n.startswith("planner, 8B batch") and "fits" in n for n in i["notes"])
    titan8 = tomllib.load(open(out / "kit" / "d" / "torchtitan" / f"job_8B_compiled_b{i['rows'][0][2]}.toml", "rb"))
    assert titan8["model"]["flavor"] == "debugmodel" and titan8["compile"]["enable"]
    e = results["e"]["rows"]
    assert len(e) == 2 and all(row[1] and row[2] and row[4] and row[7] for row in e)  # planned and measured
    assert [row[9] for row in e] == ["c/b2_eager", "c/b4_eager"] and all(row[6] for row in e)  # host time planned
    assert not os.path.exists(out / "kit" / "e" / "b2_eager")
    g = results["g"]["rows"]  # [model, batch, bf16 tokens/s, float8 tokens/s, float8 / bf16, ...]
    assert [(row[0], row[1]) for row in g] == [("1B", 4)] and float(g[0][4].split()[0]) > 0
    assert [run[0] for run in results["g"]["runs"]] == ["g/1B_b4_float8_emulated"]
    h = results["h"]["rows"]  # profiled windows (bf16, float8): the traces' per-step figures (a CPU has no kernels)
    assert [row[1] for row in h] == ["h/torchtrain_eager", "h/torchtrain_eager_float8"]
    assert all(row[0] == "torchtrain" and row[6] == 0 and row[7] > row[8] > 0 for row in h)
    assert all(row[9:13] == [0.0, 0.0, 0.0, 0.0] for row in h)  # kernel seconds by kind: none on a CPU
    assert h[1][8] > h[0][8]  # float8's casts and scales: more operators a step
    assert all((out / "kit" / "h" / f"{n}_trace.json.gz").exists() for n in ("torchtrain_eager", "torchtrain_eager_float8"))
    # the levers: (c)'s batch-4 run reused as the first row, each lever its own run, the compiled one listed
    j = results["j"]["rows"]  # [lever, tokens/s (window), / (c)'s, MFU, median step s, peak GiB, steady, error]
    assert [row[0] for row in j] == ["as in (c)", "AC none", "torch's AdamW"] and j[0][1] == c[1][3] and j[0][2] == "1.000"
    assert all(row[1] > 0 and float(row[2]) > 0 for row in j)
    assert [run[0] for run in results["j"]["runs"]] == ["j/AC none", "j/torch's AdamW"]
    assert all(any(n.startswith(f"{lever}: not run in a dry run") for n in results["j"]["notes"])
               for lever in ("two-pass softmax", "Inductor tuning"))
    # without a budget nothing is skipped, and every run's estimate and duration are recorded
    assert all(not r["skipped"] for r in results.values())
    assert [run[0] for run in results["f"]["runs"]] == ["f/straight", "f/resumed (steps 1-4, saved)",
                                                        "f/resumed (steps 5-8)"]
    assert all(run[1] > 0 and run[2] > 0 for r in results.values() for run in r["runs"])
    f = results["f"]["rows"]
    assert f[1][2] == 0.0  # resumed losses bitwise equal
    job = tomllib.load(open(out / "kit" / "d" / "torchtitan" / "job_eager_b2.toml", "rb"))
    assert job["experimental"]["custom_import"] == "titan_flavor" and job["training"]["dataset"] == "c4_test"
    assert job["training"]["local_batch_size"] == 2
    profile = tomllib.load(open(out / "kit" / "d" / "torchtitan" / "job_compiled_b4_profile.toml", "rb"))
    assert profile["profiling"]["enable_profiling"] and profile["training"]["steps"] == 6
    assert profile["compile"]["enable"] and profile["training"]["local_batch_size"] == 4
    summary = (out / "kit" / "summary.md").read_text()
    assert "Dry run on a CPU at tiny size: these are not CUDA figures" in summary
    assert all(f"## ({p})" in summary for p in "abcdefghij")
    assert "- protocol: steps 4-6 (N = 3 after 3 warm-up)" in summary
    assert "runs finished (estimated s / took s): f/straight" in summary
    with tarfile.open(out / "kit.tar.gz") as tar:  # the archive leaves the checkpoints out
        names = tar.getnames()
    assert "kit/f/resumed/metrics.jsonl" in names and not any("/checkpoint" in n for n in names)


@pytest.mark.slow
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
    overhead, step, first = budget.OVERHEAD_S, budget.STEP_S, budget.FIRST_RUN_S
    now = [0.0]
    b = budget.Budget(200.0, clock=lambda: now[0])
    job = ["--model.flavor", "1B", "--training.seq_len", "2048", "--training.local_batch_size", "2",
           "--training.steps", "15"]
    eager = budget.spec_of(job, dry=False)
    compiled = budget.spec_of(job + ["--compile.enable", "true"], dry=False)
    compiled8 = budget.spec_of(job[:-3] + ["8", "--training.steps", "15", "--compile.enable", "true"], dry=False)
    float8 = budget.spec_of(job + ["--compile.enable", "true", "--model.converters", "float8"], dry=False)
    titan = budget.RunSpec("torchtitan", "1B", "compile", 15, 4096)
    assert (eager.engine, eager.model, eager.mode, eager.tokens, eager.steps) == ("torchtrain", "1B", "eager", 4096, 15)
    assert (compiled8.mode, compiled8.tokens, float8.mode) == ("compile", 16384, "compile+float8")
    assert budget.spec_of(job + ["--profiling.enable_profiling", "true"], dry=False).mode == "profile"
    assert budget.spec_of(job + ["--profiling.enable_profiling", "true", "--compile.enable", "true"],
                          dry=False).mode == "compile+profile"
    assert budget.spec_of(job + ["--profiling.enable_profiling", "true", "--compile.enable", "true",
                                 "--model.converters", "float8"], dry=False).mode == "compile+float8+profile"
    assert budget.spec_of(job + ["--training.enable_cpu_offload", "true"], dry=False).mode == "offload"
    # the table: the larger of the host's and the GPU's step (x tokens / 4,096); the first run adds imports
    host, gpu = step[("torchtrain", "1B", "compile")]
    assert b.estimate(compiled) == pytest.approx(first + overhead[("torchtrain", "1B", "compile")] + 15 * host)
    assert b.estimate(compiled8) == pytest.approx(first + overhead[("torchtrain", "1B", "compile")] + 15 * 4 * gpu)
    o_eager, s_eager = overhead[("torchtrain", "1B", "eager")], step[("torchtrain", "1B", "eager")][0]
    assert b.estimate(eager) == pytest.approx(first + o_eager + 15 * s_eager)
    b.done(b.admit("c", "c/eager", b.estimate(eager)), 20.0, eager, step_s=1.2 * s_eager)
    assert b.estimate(eager) == pytest.approx(20.0 - first)  # its own overhead and step: the run less the imports
    # other modes scale their steps by the measured/table ratio; the first run's overhead is no drift
    assert b.estimate(compiled) == pytest.approx(overhead[("torchtrain", "1B", "compile")] + 15 * 1.2 * host)
    b.done(b.admit("c", "c/compile", b.estimate(compiled)), 60.0, compiled, step_s=0.9 * host)
    drift = min((60.0 - 15 * 0.9 * host) / overhead[("torchtrain", "1B", "compile")], 2.0)
    # the same mode at 4x the tokens: its own measurement, scaled by the table's form (GPU-bound there)
    assert b.estimate(compiled8) == pytest.approx(60.0 - 15 * 0.9 * host + 15 * 4 * gpu * 0.9)
    # compiled modes not measured take the compiled runs' overhead drift, torchtitan's too
    ratio = (1.2 + 0.9) / 2  # median of the model's measured/table step ratios
    f_host = step[("torchtrain", "1B", "compile+float8")][0]
    assert b.estimate(float8) == pytest.approx(overhead[("torchtrain", "1B", "compile+float8")] * drift
                                               + 15 * f_host * ratio)
    assert b.estimate(titan) == pytest.approx(overhead[("torchtitan", "1B", "compile")] * drift
                                              + 15 * step[("torchtitan", "1B", "compile")][0] * ratio)
    now[0] = 190.0  # 10 s left: the compiled float8 run is skipped, a cheaper one still starts
    assert b.admit("c", "c/compile_float8", b.estimate(float8)) is None
    assert b.admit("f", "f/straight", 5.0) is not None
    finished, skipped = b.of_part("c")
    assert [run[0] for run in finished] == ["c/eager", "c/compile"] and [run[2] for run in finished] == [20.0, 60.0]
    assert skipped == [f"c/compile_float8: needs ~{b.estimate(float8):.0f} s (estimated), 10 s of the budget left"]
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
    assert [s.split(":")[0] for s in results["c"]["skipped"]] == ["c/b2_eager", "c/b4_eager"]
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
    assert d["ok"] and d["rows"][0][2] > 0
    assert [run[0] for run in d["runs"]] == ["d/torchtrain_b2_eager", "d/torchtitan_b2_eager", "d/torchtrain_b4_eager"]
    assert b["notes"] == ["not started: SIGTERM"] or b["skipped"] and all("SIGTERM" in s for s in b["skipped"])
    assert c["notes"] == ["not started: SIGTERM"] and not c["runs"]
    with tarfile.open(tmp_path / "kit.tar.gz") as tar:  # the archive is rewritten after the stop
        summary = tar.extractfile("kit/summary.md").read().decode()
    assert "## (c) 1B throughput and MFU, local batch 2 and 8: NOT STARTED" in summary
    assert "## (d) torchtrain vs torchtitan" in summary


def _kit_module():
    gpu = os.path.join(REPO, "benchmarks", "gpu")
    sys.path.insert(0, gpu)
    try:
        spec = importlib.util.spec_from_file_location("gpu_kit_kit", os.path.join(gpu, "kit.py"))
        kit = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = kit  # (its dataclasses look their module up)
        spec.loader.exec_module(kit)
    finally:
        sys.path.remove(gpu)
    return kit


def test_steadiness_is_judged_from_the_device_and_the_window():
    """The committed runs, judged without device readings (their sets predate the sampler): the healthy
    H100's compiled batch-8 run is steady; the same job on a throttling H100 (steps 0.27-0.54 s) is not, by
    its window's spread; the newest set's eager batch-8 run, whose only odd step is the last record (timed
    by the host before its work ended), is steady with that outlier named. Ratios taken with an unsteady
    run are marked. And the GPU's state (nvidia-smi's clock, temperature and power) reads into one line."""
    gpu = os.path.join(REPO, "benchmarks", "gpu")
    kit = _kit_module()

    def run(results: str, folder: str):
        with open(os.path.join(gpu, "results", results, folder, "metrics.jsonl")) as f:
            return kit.Run(folder, [json.loads(line) for line in f], None, 1.0, folder=folder)

    healthy = run("2026-11-27-h100-f2ccc36", "c/b8_compile")
    throttled = run("2026-11-27-h100-throttled", "g/1B_b8_compile")
    late_last = run("2026-11-27-h100-ae5a46e", "c/b8_eager")
    assert healthy.verdict().steady and not healthy.verdict().device_moved
    verdict = throttled.verdict()
    assert not verdict.steady and not verdict.device_moved and "step times spread" in verdict.cause
    assert "device not read" in verdict.cause
    assert late_last.verdict().steady and "one outlier step" in late_last.verdict().cause
    steadiness = sys.modules["steadiness"]
    notes = steadiness.notes({r.folder: r.verdict() for r in (healthy, throttled)})
    assert len(notes) == 1 and notes[0].startswith("UNSTEADY g/1B_b8_compile:") and "not evidence" in notes[0]
    assert steadiness.ratio(60.0, 50.0, [healthy.verdict()]) == "1.20"
    assert steadiness.ratio(60.0, 50.0, [healthy.verdict(), verdict]) == "1.20 (unsteady)"
    assert steadiness.ratio(None, 50.0, [healthy.verdict()]) is None
    # environment.json records the GPU's clock and temperature at the start and after each part
    assert kit.parse_gpu_state("345 MHz, 1980 MHz, 68, 91.62 W\n") == "SM 345 of 1980 MHz, 68 C, 92 W"
    assert kit.parse_gpu_state("") is None and kit.parse_gpu_state("[N/A], 1980 MHz") is None


def test_trace_kernels_go_to_the_optimizer_that_launched_them_else_by_name(tmp_path):
    """A kernel launched inside `Optimizer.step#...` on the host thread that ran it is the optimizer's
    whatever its name (a compiled step's Triton kernels); Inductor's other kernels go by their prefix; a
    GEMM's time goes to the shape of the operator that launched it; a kernel launched outside the
    recorded steps is not theirs."""
    stats = _budget_module("trace_stats")
    host = {"pid": 1, "tid": 1}
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 1000, **host},
              {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#CompiledAdamW.step", "ts": 500,
               "dur": 300, **host}]
    launches = [("cudaLaunchKernel", "cuda_runtime", 100, 1), ("cuLaunchKernel", "cuda_driver", 200, 2),
                ("cuLaunchKernelEx", "cuda_driver", 600, 3), ("cudaLaunchKernel", "cuda_runtime", 700, 4),
                ("cuLaunchKernel", "cuda_driver", 900, 5)]
    kernels = [("triton_tem_fused_mm_0", 1, 40_000), ("triton_red_fused_sum_1", 2, 5_000),  # us
               ("triton_poi_fused_add_2", 3, 7_000), ("void at::native::elementwise_kernel<...>", 4, 3_000),
               ("triton_poi_fused_mul_3", 5, 2_000)]
    for name, cat, ts, corr in launches:
        events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 2, "args": {"correlation": corr}, **host})
    start = 1000
    for name, corr, dur in kernels:
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, "pid": 0, "tid": 7,
                       "args": {"correlation": corr}})
        start += 100_000
    # two cuBLAS GEMMs, linked to the operators that launched them (and their shapes) by External id
    for name, ext, dims, dur in (("aten::mm", 11, [[16384, 2048], [2048, 512]], 1_000),
                                 ("aten::addmm", 12, [[2048], [16384, 2048], [2048, 2048]], 4_000)):
        events.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": 10 + ext, "dur": 1, **host,
                       "args": {"External id": ext, "Input Dims": dims, "Input type": ["c10::BFloat16"] * len(dims)}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10 + ext, "dur": 2,
                       "args": {"correlation": ext}, **host})
        events.append({"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_64x4", "ts": start, "dur": dur,
                       "pid": 0, "tid": 7, "args": {"External id": ext, "correlation": ext}})
        start += 100_000
    # a kernel the GPU ran while the profiler recorded but launched after the step (the host queues ahead)
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1500, "dur": 2,
                   "args": {"correlation": 99}, **host})
    events.append({"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_9", "ts": start, "dur": 50_000,
                   "pid": 0, "tid": 7, "args": {"correlation": 99}})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = stats.summarize(str(path))
    assert s["kernel_s_per_step_by_kind"] == {"gemm": 0.045, "optimizer": 0.01, "reduction": 0.005,
                                              "element-wise": 0.002}
    assert s["kernels_per_step"] == 7 and s["launches_per_step"] == 7
    assert s["gemm_by_shape"] == [  # the larger time first; 2 M K N / seconds
        {"shape": "16384x2048x2048", "dtype": "BFloat16", "calls_per_step": 1, "ms_per_step": 4.0, "tflops": 34},
        {"shape": "16384x2048x512", "dtype": "BFloat16", "calls_per_step": 1, "ms_per_step": 1.0, "tflops": 34}]


def test_a_compiled_step_that_fails_to_compile_costs_one_rerun_not_the_evidence(tmp_path, monkeypatch):
    """The kit runs a compiled job whose optimizer step fails to compile again with the model and loss
    compiled only, and every later compiled run that way from the start; eager runs are untouched, and the
    part's summary says so."""
    kit = _kit_module()
    calls = []

    def fake_train(dump, argv, name, budget, **_):
        calls.append(list(argv))
        compiled = "--compile.enable" in argv
        failed = compiled and kit.WITHOUT_COMPILED_STEP[0] not in argv
        error = f"ConfigError: {kit.COMPILED_STEP_FAILED} (InductorError: no compiler)" if failed else None
        return kit.Run(name, [{"step": i, "step_time_s": 0.1} for i in range(1, 6)], error, 1.0)

    monkeypatch.setattr(kit, "_train", fake_train)
    ctx = kit.Context(str(tmp_path), dry=False)
    job = ["--model.flavor", "1B", "--training.steps", "5"]
    first = kit.train(ctx, "c", "b2_compile", job + ["--compile.enable", "true"], reuse=True)
    assert first.ok and calls == [job + ["--compile.enable", "true"],
                                  job + ["--compile.enable", "true"] + kit.WITHOUT_COMPILED_STEP]
    assert len(ctx.notes) == 1 and "c/b2_compile failed to compile the optimizer step" in ctx.notes[0]
    kit.train(ctx, "c", "b8_compile", job + ["--compile.enable", "true"])  # later compiled runs: one run each
    kit.train(ctx, "c", "b2_eager", job)
    assert calls[2:] == [job + ["--compile.enable", "true"] + kit.WITHOUT_COMPILED_STEP, job]
    assert [e.name for e in ctx.budget.entries] == ["c/b2_compile", "c/b2_compile", "c/b8_compile", "c/b2_eager"]
