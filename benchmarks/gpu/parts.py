"""The GPU evidence kit's parts (a)-(f) but (d) (titan.py); each returns a PartResult
(benchmarks/gpu/README.md says what each measures and how summary.md shows it)."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import xml.etree.ElementTree as ET

from kit import REPO, TITLES, Context, PartResult, admit_process, log, run_process, train

# A dry run's stand-in for every model: the suite's tiny Llama (tests/conftest.py TINY_MODEL).
TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "8", "--model.n_kv_heads", "4",
        "--model.vocab_size", "512"]
COMMON = ["--training.dataset", "synthetic", "--lr_scheduler.warmup_steps", "3", "--optimizer.lr", "1e-3"]
FLOAT8 = ["--model.converters", "float8"]
DRY_TRAINING = ["--training.steps", "30", "--optimizer.lr", "1e-2"]
"""Part (b) in a dry run: the tiny model learns the synthetic phrases visibly only at a higher learning
rate and over more steps (at 1e-3 over a few steps, whether its loss falls depends on the draw)."""
HEADLINE_SEQ, HEADLINE_STEPS = 2048, 15
BATCHES = (2, 8)
"""The headline's local batches (seq 2048 each): 2, where one step is launch-bound, and 8, where the GPU
is busy; a dry run uses 2 and 4."""


def model(ctx: Context, name: str) -> list[str]:
    """The debug model, the ~1B Llama 3 shape (untied output, as torchtitan's llama3 builds it) or the
    3B (Llama 3.2's shape, tied: the largest Llama 3 that trains on one 80 GB GPU with AdamW)."""
    if ctx.dry:  # a CPU run on any machine (a GPU machine's `auto` device would be CUDA)
        return TINY + ["--training.device", "cpu"]
    if name == "debug":
        return ["--model.flavor", "debugmodel"]
    if name in ("3B", "8B"):
        return ["--model.flavor", name]
    return ["--model.flavor", "1B", "--model.tie_word_embeddings", "false"]


def batches(ctx: Context) -> tuple[int, ...]:
    return (2, 4) if ctx.dry else BATCHES


def shape(ctx: Context, seq: int, batch: int, dry_batch: int = 2) -> list[str]:
    """seq x batch; a dry run: seq 64 x `dry_batch`."""
    return ["--training.seq_len", str(64 if ctx.dry else seq), "--training.local_batch_size",
            str(dry_batch if ctx.dry else batch)]


def bf16(ctx: Context) -> list[str]:
    return [] if ctx.dry else ["--training.mixed_precision_param", "bfloat16"]


def float8(ctx: Context) -> list[str]:
    return FLOAT8 + (["--quantize.linear.float8.emulate", "true"] if ctx.dry else [])


def compiled(ctx: Context) -> list[str] | None:
    """None in a dry run: compiling costs ~20 s a run on a CPU, and the kit's CI run must stay short."""
    return None if ctx.dry else ["--compile.enable", "true"]


def headline_job(ctx: Context, extra: list[str], batch: int = 2, name: str = "1B", steps: int | None = None) -> list[str]:
    """The one command line of a headline run (bf16, selective AC): (d), (e), (g) and (h) reuse (c)'s
    and (g)'s runs of the same line."""
    steps = steps if steps is not None else ctx.protocol.steps
    return (model(ctx, name) + COMMON + shape(ctx, HEADLINE_SEQ, batch, dry_batch=batch) + bf16(ctx)
            + ["--activation_checkpoint.mode", "selective", "--training.steps", str(steps)] + extra)


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text.replace(" + ", "_")).strip("_").replace("__", "_")


# ----------------------------------------------------------------------------- (a)
def relative_paths(path: str, root: str = REPO) -> None:
    """The file with the checkout's absolute path made relative (`tests/...`): a result set records the
    project's files, not where a machine kept its copy."""
    with open(path, errors="replace") as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace(root.rstrip(os.sep) + os.sep, ""))


def part_a(ctx: Context) -> PartResult:
    """The suite's single-process cases (not `dist`, not `slow`) on this machine's device, stopped (SIGINT:
    pytest still writes its report) at the cap or the budget's deadline."""
    res = PartResult("a", TITLES["a"], ["selection", "passed", "failed", "skipped", "errors", "seconds"])
    junit = os.path.join(ctx.folder("a"), "junit.xml")
    # on the GPU machine's 16 cores, 8 test processes (the suite's default is 2, for a 2-core machine)
    # (a dry run: one small file in this process, -n 0: no test processes, each with its own interpreters, to start)
    select = ["tests/test_lr_scheduler.py", "-n", "0"] if ctx.dry else ["tests", "-m", "not dist and not slow", "-n", "8"]
    cmd = [sys.executable, "-m", "pytest", *select, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    if ctx.dry:  # that file starts no command: no warm interpreter to fork them from (tests/zygote.py)
        env["TORCHTRAIN_TEST_NO_ZYGOTE"] = "1"
    entry, allowed = admit_process(ctx, "a", "pytest", 5.0 if ctx.dry else 60.0, ctx.pytest_s)
    if entry is None:
        return res
    entry.estimate_s = entry.estimate_s if allowed == math.inf else round(allowed, 1)
    log(f"(a) pytest, at most {allowed:.0f} s" if allowed != math.inf else "(a) pytest")
    t0 = ctx.budget.clock()
    _, cut = run_process(ctx.budget, cmd, os.path.join(ctx.out, "a", "pytest.log"), allowed, REPO, env, signal.SIGINT)
    ctx.budget.done(entry, ctx.budget.clock() - t0)
    if cut:
        res.notes.append(f"pytest {cut}: the counts cover the tests that finished")
    if not os.path.exists(junit):
        res.ok = False
        res.notes.append("pytest wrote no report; see a/pytest.log")
        return res
    for path in (junit, os.path.join(ctx.out, "a", "pytest.log")):
        relative_paths(path)
    suite = ET.parse(junit).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    res.rows.append([" ".join(select), passed, counts["failures"], counts["skipped"], counts["errors"],
                     round(float(suite.get("time", 0)), 1)])
    failed = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    res.notes += [f"failed: {name}" for name in failed[:30]]
    res.ok = not failed
    return res


# ----------------------------------------------------------------------------- (b)
def part_b(ctx: Context) -> PartResult:
    """Short bf16 runs on one rank (its default layout), each feature on its own: does the loss fall? The cheap runs
    first: under a budget, the costly ones (1B CPU offload, 1B compile) are the ones skipped."""
    res = PartResult("b", TITLES["b"], ["model", "variant", "steps", "first loss", "last loss", "falling",
                                        "peak GiB", "error"])
    variants = [("ac none", ["--activation_checkpoint.mode", "none"]),
                ("ac selective", ["--activation_checkpoint.mode", "selective"]),
                ("ac full", ["--activation_checkpoint.mode", "full"]),
                ("fp16 + loss scaling", ["--training.mixed_precision_param", "float16"]),
                ("float8", float8(ctx)),
                ("cpu offload", None if ctx.dry else ["--training.enable_cpu_offload", "true"]),
                ("compile", compiled(ctx))]
    models = [("debug", 20, 256, 8)] + ([] if ctx.dry else [("1B", 10, 2048, 2)])
    for name, steps, seq, batch in models:
        for variant, extra in variants:
            if extra is None:
                res.notes.append(f"{name} {variant}: not run in a dry run (CUDA only, or too slow on a CPU)")
                continue
            log(f"(b) {name} {variant}")
            run = train(ctx, "b", f"{name}_{slug(variant)}", every_step=True, argv=model(ctx, name) + COMMON
                        + shape(ctx, seq, batch)
                        + bf16(ctx) + extra + (DRY_TRAINING if ctx.dry else ["--training.steps", str(steps)]))
            if run.skipped:
                continue
            loss = run.losses()
            res.rows.append([name, variant, len(loss), round(loss[0], 4) if loss else None,
                             round(loss[-1], 4) if loss else None, run.falling(), run.peak_gib(), run.error])
            res.ok &= run.ok and run.falling()
    return res


def _round(value, digits: int = 0):
    return None if value is None else round(value, digits)


# ----------------------------------------------------------------------------- (e)
PLAN_STEP_KEYS = ("step_s", "step_time_s", "step_seconds")
"""The planner's predicted step time: the JSON report's `throughput.step_s` (the first of these names
present, so that a renamed field still reads)."""


def planner_prediction(argv: list[str], gpu: str) -> tuple[float | None, dict, str | None]:
    """(peak GiB, {"step_s", "gpu_s", "host_s"}, error) from the planner's entry point (`python -m
    torchtrain.plan ... --json`, called in this process), reading only the report's top-level
    `memory.worst_peak_bytes` and `throughput` fields."""
    import contextlib
    import io

    from torchtrain.plan import main as plan_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan_main(["--world-size", "1", "--gpu", gpu, "--json", *argv])
    if code != 0:
        return None, {}, (err.getvalue().strip().splitlines() or ["planner failed"])[-1][:300]
    report = json.loads(out.getvalue())
    peak = (report.get("memory") or {}).get("worst_peak_bytes")
    throughput = report.get("throughput") or {}
    step = next((throughput[k] for k in PLAN_STEP_KEYS if throughput.get(k) is not None), None)
    return (None if peak is None else peak / 2**30), {"step_s": step, "gpu_s": throughput.get("gpu_s"),
                                                       "host_s": throughput.get("host_s")}, None


PLAN_S = 4.0
"""Budget estimate of one plan (a traced 1B step on fake tensors, on the GPU machine's CPU)."""


def part_e(ctx: Context) -> PartResult:
    """The planner's memory and step time against torch.cuda.max_memory_allocated and the measured step,
    for every headline run this command made ((c) and (g), reused, not run again); when none was made
    (the part alone), for (c)'s first run, made here."""
    import torch

    gpu = "h100"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        gpu = "h200" if "h200" in name else "h100" if "h100" in name else gpu
    res = PartResult("e", f"{TITLES['e']} ({gpu})", ["job", "planned GiB", "measured GiB", "ratio",
                                                     "planned step s", "GPU s", "host s", "measured step s",
                                                     "ratio", "measured by", "error"])
    if ctx.dry:
        res.notes.append("dry run: measured on a CPU (process RSS, CPU step time) against a plan for a GPU; the "
                         "ratios mean nothing, the mechanism is what runs")
    made = [(argv, run) for argv, run in ctx.runs.items() if run.folder.startswith(("c/", "g/")) and run.ok]
    if not made:
        argv = headline_job(ctx, [])
        made = [(tuple(argv), train(ctx, "e", "b2_eager", argv, reuse=True))]
    for argv, run in made:
        if run.skipped:
            continue
        entry = ctx.budget.admit("e", f"e/{run.folder}", PLAN_S)
        if entry is None:
            continue
        log(f"(e) plan of {run.folder}")
        t0 = ctx.budget.clock()
        planned_gib, planned, error = planner_prediction(list(argv), gpu)
        ctx.budget.done(entry, ctx.budget.clock() - t0)
        measured_step, measured_gib = run.steady("step_time_s"), run.peak_gib()
        step = planned.get("step_s")
        res.rows.append([run.folder, planned_gib, measured_gib, _ratio(planned_gib, measured_gib), step,
                         planned.get("gpu_s"), planned.get("host_s"), measured_step, _ratio(step, measured_step),
                         run.folder, error or run.error])
        res.ok &= run.ok and error is None
    return res


def _ratio(a, b) -> str | None:
    return None if not a or not b else f"{a / b:.2f}"


# ----------------------------------------------------------------------------- (f)
def part_f(ctx: Context) -> PartResult:
    """DCP save and resume: 8 steps straight vs 4 steps, a checkpoint, a resume to 8; losses bitwise."""
    res = PartResult("f", TITLES["f"], ["run", "steps 5-8 loss", "max |diff|", "error"])
    # A constant LR after warmup (decay_ratio 0): the schedule must not depend on training.steps, which
    # differs between the 4-step and the 8-step run.
    argv = model(ctx, "debug") + COMMON + shape(ctx, 256, 8) + ["--debug.deterministic", "true",
                                                                "--lr_scheduler.decay_ratio", "0"] + bf16(ctx)
    log("(f) straight, saved at 4, resumed")
    straight = train(ctx, "f", "straight", argv + ["--training.steps", "8"], every_step=True)
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
    first = train(ctx, "f", "resumed", argv + ckpt + ["--training.steps", "4"], label="resumed (steps 1-4, saved)",
                  every_step=True)
    second = train(ctx, "f", "resumed", argv + ckpt + ["--training.steps", "8"], label="resumed (steps 5-8)",
                   every_step=True) if not first.skipped else first
    if straight.skipped or second.skipped:
        res.notes.append("resume not checked: a run was skipped")
        return res
    a = [r["loss"] for r in straight.records if r["step"] > 4]
    b = [r["loss"] for r in second.records if r["step"] > 4][-4:]
    diff = max((abs(x - y) for x, y in zip(a, b)), default=None) if len(a) == len(b) == 4 else None
    res.rows.append(["straight", [round(x, 6) for x in a], None, straight.error])
    res.rows.append(["saved at 4, resumed", [round(x, 6) for x in b], diff, first.error or second.error])
    res.ok = diff == 0.0
    res.notes.append("deterministic algorithms on (debug.deterministic); a resume must repeat the losses bitwise")
    return res
