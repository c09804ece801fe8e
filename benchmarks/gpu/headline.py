"""The headline parts of the GPU evidence kit: (c) torchtrain's throughput at local batch 2 and 8, eager and
compiled; (g) float8 against bf16, compiled, at the 1B (batch 8) and at the 3B; (h) a short profiler
window of the compiled batch-8 step on each side, torchtrain's and torchtitan's (benchmarks/gpu/README.md).
Each returns a PartResult; (d) (titan.py) and (e) (parts.py) reuse the runs made here."""

from __future__ import annotations

import glob
import gzip
import os
import shutil
import statistics

import steadiness
from kit import TITLES, Context, PartResult, gemm_peak_tflops, log, train
from parts import HEADLINE_SEQ, batches, compiled, float8, headline_job, slug

PROFILE = ["--profiling.enable_profiling", "true", "--profiling.profile_freq", "5", "--profiling.profiler_warmup",
           "1", "--profiling.profiler_active", "2"]
"""A profiler window of steps 4-5 (step 3 warms it up) in a run of 6 steps; steps 2 and 6 run unprofiled."""
PROFILE_STEPS, UNPROFILED = 6, (2, 6)


def measured_peak(ctx: Context) -> tuple[float, str]:
    """The device's measured GEMM peak, measured once per command."""
    if ctx.peak is None:
        ctx.peak = gemm_peak_tflops(ctx.dry)
    return ctx.peak


def c_runs(ctx: Context) -> list[tuple[int, str, list[str] | None]]:
    """(batch, mode, extra) of (c), in order: what the goals read first (batch 2, then batch 8 compiled)."""
    small, large = batches(ctx)
    return [(small, "eager", []), (small, "compile", compiled(ctx)), (large, "compile", compiled(ctx)),
            (large, "eager", [])]


def g_runs(ctx: Context) -> list[tuple[str, int]]:
    """(model, batch) of (g): the 1B at batch 8 and the 3B at batch 4 (its largest on 80 GB; a dry run has
    one model)."""
    large = batches(ctx)[1]
    return [("1B", large)] if ctx.dry else [("1B", large), ("3B", 4)]


def _bf16_and_float8(ctx: Context) -> tuple[list[str] | None, list[str]]:
    """The compared pair: compiled bf16 and compiled float8 (a dry run: eager and emulated float8)."""
    if ctx.dry:
        return [], float8(ctx)
    return compiled(ctx), compiled(ctx) + float8(ctx)


def c_job(ctx: Context, batch: int, extra: list[str]) -> list[str]:
    return headline_job(ctx, extra, batch)


def g_job(ctx: Context, name: str, batch: int, extra: list[str]) -> list[str]:
    return headline_job(ctx, extra, batch, name)


# ----------------------------------------------------------------------------- (c)
def part_c(ctx: Context) -> PartResult:
    """Tokens/s and MFU of the 1B at local batch 2 and 8, eager and compiled, against the measured peak."""
    peak, how = measured_peak(ctx)
    res = PartResult("c", TITLES["c"], ["seq", "batch", "mode", "tokens/s (window)", "TFLOP/s", "MFU vs measured peak",
                                        "MFU vs table peak", "median step s", "peak GiB", "steady", "error"])
    res.notes.append(ctx.protocol.describe())
    res.notes.append(f"measured peak: {peak:.1f} TFLOP/s ({how})")
    runs = []
    for batch, mode, extra in c_runs(ctx):
        if extra is None:
            res.notes.append(f"batch {batch} {mode}: not run in a dry run (compiling is ~20 s a run on a CPU)")
            continue
        log(f"(c) batch {batch} {mode}")
        run = train(ctx, "c", f"b{batch}_{slug(mode)}", c_job(ctx, batch, extra), reuse=True)
        if run.skipped:
            continue
        runs.append(run)
        tflops, mfu = run.tflops(), run.table_mfu_pct()
        res.rows.append([HEADLINE_SEQ, batch, mode, _round(run.tokens_per_s()), _round(tflops, 1),
                         None if tflops is None else f"{100 * tflops / peak:.1f}%",
                         None if mfu is None else f"{mfu:.1f}%", _round(run.steady("step_time_s"), 4),
                         run.peak_gib(), run.verdict().steady, run.error])
        res.ok &= run.ok
    res.notes += steadiness.notes({r.folder: r.verdict() for r in runs})
    return res


# ----------------------------------------------------------------------------- (g)
def part_g(ctx: Context) -> PartResult:
    """Float8 against bf16, both compiled, on the same job: the ratio of steady tokens/s."""
    peak, _ = measured_peak(ctx)
    res = PartResult("g", TITLES["g"], ["model", "batch", "bf16 tokens/s", "float8 tokens/s", "float8 / bf16",
                                        "bf16 MFU vs measured peak", "float8 MFU vs measured peak",
                                        "bf16 peak GiB", "float8 peak GiB", "error"])
    res.notes.append(ctx.protocol.describe())
    res.notes.append("both compiled, AC selective, seq 2048; MFU counts the same model FLOPs against the bf16 peak")
    if ctx.dry:
        res.notes.append("dry run: eager bf16 against emulated float8 (compiling is ~20 s a run on a CPU), the "
                         "tiny model only (no 3B)")
    plain, fp8 = _bf16_and_float8(ctx)
    runs = []
    for name, batch in g_runs(ctx):
        log(f"(g) {name} batch {batch}: bf16, float8")
        pair = [train(ctx, "g", f"{name}_b{batch}_{slug(label)}", g_job(ctx, name, batch, extra), reuse=True)
                for label, extra in (("compile" if not ctx.dry else "eager", plain),
                                     ("compile + float8" if not ctx.dry else "float8 emulated", fp8))]
        if any(r.skipped for r in pair):
            continue
        runs += pair
        tps = [r.tokens_per_s() for r in pair]
        mfu = [r.tflops() for r in pair]
        res.rows.append([name, batch, _round(tps[0]), _round(tps[1]),
                         steadiness.ratio(tps[1], tps[0], [r.verdict() for r in pair]),
                         *[None if m is None else f"{100 * m / peak:.1f}%" for m in mfu],
                         pair[0].peak_gib(), pair[1].peak_gib(), pair[0].error or pair[1].error])
        res.ok &= all(r.ok for r in pair)
    res.notes += steadiness.notes({r.folder: r.verdict() for r in runs})
    return res


# ----------------------------------------------------------------------------- (h)
KINDS = ("gemm", "attention", "optimizer")
"""The kernel kinds (trace_stats.kind) given a column of their own in (h); the rest add up in one."""


def part_h(ctx: Context) -> PartResult:
    """One profiled window of the compiled batch-8 step on each side (torchtrain in bf16 and in float8,
    torchtitan in bf16): what the GPU's time a step goes to -- GEMMs (the MFU), attention, the
    optimizer, the rest (element-wise, reductions, copies: float8's casts) -- and what the host does
    (benchmarks/gpu/trace_stats.py). A dry run profiles torchtrain eager and emulated float8 (compiling
    is not run there)."""
    import titan

    res = PartResult("h", TITLES["h"], ["side", "job", "profiled step s", "unprofiled step s", "GPU busy s a step",
                                        "GPU busy share", "kernels a step", "profiler ops a step",
                                        "dispatched ops a step", "GEMM s", "attention s", "optimizer s",
                                        "other kernels s", "trace", "error"])
    large = batches(ctx)[1]
    extra = compiled(ctx)
    mode = "eager" if extra is None else "compiled"
    res.notes.append(f"{mode}, 1B, seq 2048 x {large}, AC selective; profiler window steps 4-5 (step 3 warms it "
                     "up); the unprofiled step is (c)'s / (d)'s steady one when they ran in this command, else "
                     "the median of steps 2 and 6 of the profiled run; dispatched ops: what a dispatch-level "
                     "observer sees; kernel seconds a step by kind: trace_stats.py (optimizer: the kernels "
                     "launched inside the optimizer's step)")
    fp8 = _bf16_and_float8(ctx)[1]
    for label, flags, unprofiled_job in ((mode, extra or [], c_job(ctx, large, extra or [])),
                                         (f"{mode} float8", fp8, g_job(ctx, "1B", large, fp8))):
        log(f"(h) torchtrain {label} batch {large}, profiled")
        name = f"torchtrain_{slug(label)}"
        run = train(ctx, "h", name, headline_job(ctx, flags + PROFILE, large, steps=PROFILE_STEPS), every_step=True)
        if run.skipped:
            continue
        same = ctx.runs.get(tuple(unprofiled_job))
        unprofiled = same.steady("step_time_s") if same is not None and same.ok else _median_of(run, UNPROFILED)
        trace = keep_trace(os.path.join(ctx.out, "h", name), os.path.join(ctx.out, "h"), name)
        res.rows.append(profile_row("torchtrain", f"h/{name}", trace, unprofiled, run.error, res.notes))
        res.ok &= run.ok and trace is not None
    if ctx.dry:
        res.notes.append("dry run: torchtitan's profile needs the GPU (its job file is written, not run)")
        titan.titan_job(ctx, True, large, profile=True)
        return res
    log(f"(h) torchtitan {mode} batch {large}, profiled")
    row, skipped = titan.profile(ctx, large, compiled=True, notes=res.notes)
    if not skipped:
        res.rows.append(row)
        res.ok &= row[-1] is None
    return res


def keep_trace(folder: str, dest: str, name: str) -> str | None:
    """The newest chrome trace under `folder`, gzipped to dest/<name>_trace.json.gz (the raw one removed)."""
    found = sorted(glob.glob(os.path.join(folder, "**", "*trace*.json"), recursive=True), key=os.path.getmtime)
    if not found:
        return None
    out = os.path.join(dest, f"{name}_trace.json.gz")
    with open(found[-1], "rb") as src, gzip.open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(found[-1])
    return out


def profile_row(side: str, job: str, trace: str | None, unprofiled: float | None, error: str | None,
                notes: list[str] | None = None) -> list:
    """(h)'s row of one profiled run; `notes` receives the run's GEMM time by shape (top 8)."""
    if trace is None:
        return [side, job, None, unprofiled] + [None] * 10 + [error or "no trace written"]
    from trace_stats import summarize

    s = summarize(trace)
    profiled = statistics.mean(s["step_s"]) if s["step_s"] else None
    busy = s["gpu_busy_s_per_step"]
    by_kind = s["kernel_s_per_step_by_kind"]
    if notes is not None and s["gemm_by_shape"]:
        notes.append(f"{job} GEMMs by M x K x N (calls, ms a step, TFLOP/s): " + "; ".join(
            f"{g['shape']} {g['dtype']} ({g['calls_per_step']:g}, {g['ms_per_step']:.2f}, {g['tflops']})"
            for g in s["gemm_by_shape"][:8]))
    return [side, job, profiled, unprofiled, busy, None if not unprofiled else f"{busy / unprofiled:.0%}",
            s["kernels_per_step"], s["profiler_ops_per_step"], s["dispatched_ops_per_step"],
            *[by_kind.get(k, 0.0) for k in KINDS],
            round(sum(v for k, v in by_kind.items() if k not in KINDS), 4), os.path.basename(trace), error]


def _median_of(run, steps: tuple[int, ...]) -> float | None:
    values = [r["step_time_s"] for r in run.records if r["step"] in steps and r.get("step_time_s")]
    return statistics.median(values) if values else None


def _round(value, digits: int = 0):
    return None if value is None else round(value, digits)
