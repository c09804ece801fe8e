"""Part (j): where the compiled batch-8 step of the headline could go faster. The 1B job of (c) at local
batch 8, compiled, is run once as (c) runs it and once per lever below, each changing one thing, all under
the kit's protocol, so that a short command says which lever pays before any is made the default.

A step at the GPU's power limit shortens by doing less work (docs/performance.md, "Where a compiled
batch-8 step goes"); each lever takes some away:
  AC none             nothing recomputed in the backward (the norms and the SwiGLU's forward under "op")
  torch's AdamW       the optimizer step as torch's fused kernel instead of the compiled one
  two-pass softmax    the cross-entropy's generated kernel takes the maximum, then the sum, instead of both in
                      one online pass (whose forward reads the logits at a third of the bandwidth)
  Inductor tuning     Inductor's coordinate-descent tuning of its generated kernels (the reductions: norms,
                      the cross-entropy), at the price of a longer compile
A dry run runs the eager levers at the tiny size and lists the compiled one as not run."""

from __future__ import annotations

import contextlib

import steadiness
from kit import TITLES, Context, PartResult, log, train
from parts import batches, compiled, headline_job, slug

LEVERS: list[tuple[str, list[str], dict]] = [
    ("as in (c)", [], {}),
    ("AC none", ["--activation_checkpoint.mode", "none"], {}),
    ("torch's AdamW", ["--compile.components", "model,loss"], {}),
    ("two-pass softmax", [], {"online_softmax": False}),
    ("Inductor tuning", [], {"coordinate_descent_tuning": True}),
]
"""(name, trainer arguments appended to (c)'s, torch._inductor.config settings during the run)."""


def _inductor(settings: dict):
    """torch._inductor.config patched with `settings` for the run (the trainer runs in this process)."""
    if not settings:
        return contextlib.nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch(settings)


def _unknown(settings: dict) -> list[str]:
    """The settings this torch's Inductor does not have (such a lever is listed, not run)."""
    if not settings:
        return []
    import torch._inductor.config

    return [k for k in settings if not hasattr(torch._inductor.config, k)]


def part_j(ctx: Context) -> PartResult:
    res = PartResult("j", TITLES["j"], ["lever", "tokens/s (window)", "/ (c)'s", "MFU vs table peak", "median step s",
                                        "peak GiB", "steady", "error"])
    res.notes.append(ctx.protocol.describe())
    batch, mode = batches(ctx)[1], compiled(ctx)
    res.notes.append(f"(c)'s job at local batch {batch}: " + ("compiled" if mode is not None else "eager (a dry run)")
                     + ", bf16, AC selective unless the lever says; `/ (c)'s`: tokens/s against the first row's")
    base, runs = None, []
    for name, extra, settings in LEVERS:
        if settings and mode is None:
            res.notes.append(f"{name}: not run in a dry run (it changes compiled kernels)")
            continue
        unknown = _unknown(settings)
        if unknown:
            res.notes.append(f"{name}: not run (this torch's Inductor has no {', '.join(unknown)})")
            continue
        as_in_c = not extra and not settings  # (c)'s own run, reused: the row the others are compared with
        log("(j) " + ("(c)'s run" if as_in_c else name))
        with _inductor(settings):
            run = train(ctx, "j", f"b{batch}_{slug(name)}", headline_job(ctx, (mode or []) + extra, batch),
                        reuse=as_in_c, label=name)
        if run.skipped:
            continue
        runs.append(run)
        tps, mfu = run.tokens_per_s(), run.table_mfu_pct()
        base = tps if base is None and as_in_c else base
        res.rows.append([name, None if tps is None else round(tps), None if base is None or tps is None
                         else f"{tps / base:.3f}", None if mfu is None else f"{mfu:.1f}%",
                         None if run.steady("step_time_s") is None else round(run.steady("step_time_s"), 4),
                         run.peak_gib(), run.verdict().steady, run.error])
        res.ok &= run.ok
    res.notes += steadiness.notes({r.folder: r.verdict() for r in runs})
    return res
