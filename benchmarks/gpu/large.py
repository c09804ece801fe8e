"""Part (i): Llama 3 8B on one GPU, compiled, selective activation checkpointing, the trainer's default
single-GPU layout, at the largest local batch the planner says fits the device, side by side with
torchtitan's same job under the kit's protocol. The GPU is recognised by its name
(`components/hardware.py`: an H200 141 GB, 989 TFLOP/s bf16 dense, 4.8 TB/s); on a GPU where no batch
fits (an 80 GB H100) the part says so, with the planner's figures, and runs nothing. A dry run plans for
an H200 and trains the tiny stand-in model eagerly at the planned batch."""

from __future__ import annotations

import contextlib
import io
import json

from kit import TITLES, Context, PartResult, log, train
from parts import COMMON, HEADLINE_SEQ, bf16, model, shape
from titan import COMPARE_COLUMNS, compare, titan_available, titan_job

MODEL = "8B"
AC = "selective"
CANDIDATE_BATCHES = (4, 2, 1)
"""Local batches tried, largest first; the first the planner says fits is the row's."""
DRY_GPU = "h200"
"""The GPU a dry run plans for: the one the 8B row is meant for."""


def gpu_key(ctx: Context) -> str:
    """The planner's name for this machine's GPU (`components/hardware.py`); a dry run: DRY_GPU."""
    if ctx.dry:
        return DRY_GPU
    import torch

    from torchtrain.components.hardware import gpu_spec_for_name

    spec = gpu_spec_for_name(torch.cuda.get_device_name())
    if spec is None:
        raise ValueError(f"unknown GPU {torch.cuda.get_device_name()!r}: not in components/hardware.py KNOWN_GPUS")
    return spec.key


def job(batch: int) -> list[str]:
    """The 8B job's command line (bf16, compiled, AC selective, seq 2048): what is planned on any machine."""
    return (["--model.flavor", MODEL] + COMMON + ["--training.seq_len", str(HEADLINE_SEQ),
                                                  "--training.local_batch_size", str(batch),
                                                  "--training.mixed_precision_param", "bfloat16",
                                                  "--activation_checkpoint.mode", AC, "--compile.enable", "true"])


def plan_memory(argv: list[str], gpu: str) -> tuple[float | None, float | None, str | None]:
    """(planned peak GiB, the device's usable GiB, error) of one rank's plan (`python -m torchtrain.plan
    --json`, in this process)."""
    from torchtrain.plan import main as plan_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan_main(["--world-size", "1", "--gpu", gpu, "--json", *argv])
    if code != 0:
        return None, None, (err.getvalue().strip().splitlines() or ["planner failed"])[-1][:300]
    memory = json.loads(out.getvalue()).get("memory") or {}
    peak, usable = memory.get("worst_peak_bytes"), memory.get("usable_bytes")
    return (None if peak is None else peak / 2**30), (None if usable is None else usable / 2**30), None


def planned_batch(gpu: str, notes: list[str]) -> int | None:
    """The largest CANDIDATE_BATCHES the planner says fits `gpu` (None: none does); each plan in `notes`."""
    for batch in CANDIDATE_BATCHES:
        peak, usable, error = plan_memory(job(batch), gpu)
        if error:
            notes.append(f"planner, batch {batch} on {gpu}: {error}")
            return None
        fits = peak is not None and usable is not None and peak <= usable
        notes.append(f"planner, {MODEL} batch {batch} on {gpu}: peak {peak:.1f} of {usable:.1f} usable GiB: "
                     f"{'fits' if fits else 'does not fit'}")
        if fits:
            return batch
    return None


def part_i(ctx: Context) -> PartResult:
    res = PartResult("i", TITLES["i"], ["model", "gpu", "batch"] + COMPARE_COLUMNS)
    res.notes.append(ctx.protocol.describe())
    gpu = gpu_key(ctx)
    log(f"(i) planning {MODEL} on {gpu}")
    batch = planned_batch(gpu, res.notes)
    if batch is None:
        res.notes.append(f"not run: no local batch of {CANDIDATE_BATCHES} fits {MODEL} on one {gpu} by the plan")
        return res
    available = titan_available(ctx, res)
    theirs_job = titan_job(ctx, compiled=True, batch=batch, model=MODEL, ac=AC)
    if ctx.dry:
        res.notes.append(f"dry run: the tiny stand-in model, eager, at the planned batch {batch}; torchtitan's "
                         "compiled job is written, not run (compiling on a CPU)")
    argv = (model(ctx, MODEL) + COMMON + shape(ctx, HEADLINE_SEQ, batch, dry_batch=batch) + bf16(ctx)
            + ["--activation_checkpoint.mode", AC, "--training.steps", str(ctx.protocol.steps)]
            + ([] if ctx.dry else ["--compile.enable", "true"]))
    log(f"(i) torchtrain {MODEL} batch {batch}")
    ours = train(ctx, "i", f"{MODEL}_b{batch}_{'eager' if ctx.dry else 'compile'}", argv)
    if ours.skipped:
        return res
    res.rows.append([MODEL, gpu, batch] + compare(ctx, res, ours, theirs_job, "compiled", batch, MODEL,
                                                  run_theirs=available and not ctx.dry))
    return res
