"""The GPU evidence kit: the CUDA figures of torchtrain, from prepared commands that fit a short GPU window.

    python benchmarks/gpu/run_all.py --out DIR [--part c,d,g,h,f] [--budget-s S] [--pytest-s S] [--dry-run]
                                     [--pack FILE.tar.gz]
    python benchmarks/gpu/run_all.py --merge A.tar.gz B.tar.gz ... --out DIR [--rejudge]

Parts (benchmarks/gpu/README.md has the machine's commands, their timing, the output folder and the
summary format), run in the order given:
  a  the suite's single-process test cases on the device (pytest, capped by --pytest-s)
  b  short bf16 runs of the debug model and a ~1B Llama 3 (one rank, its default layout) per feature -- AC
     none/selective/full, fp16 + loss scaling, float8, CPU offload, compile -- each must end with a
     falling loss
  c  tokens/s and MFU of the 1B shape at seq 2048 and local batch 2 and 8, eager and compiled, against
     the device's measured bf16 GEMM peak
  d  torchtitan (a carried wheel) on the same model/sequence at both batches, compiled and eager, and
     the ratios (torchtrain's side reuses (c)'s runs when (c) ran first in the same command)
  e  the planner's peak memory and step time against torch.cuda.max_memory_allocated and the measured
     step, for the (c) and (g) runs of the same command
  f  DCP save/resume exactness (bitwise losses after a resume)
  g  float8 against bf16, compiled: the 1B at batch 8, the 3B at batch 4
  h  one profiled compiled batch-8 step window per side (torchtrain, torchtitan): kernels, GPU busy time and
     kernel seconds by kind (GEMM, attention, optimizer, the rest), operators
  i  Llama 3 8B on one GPU (an H200: the planner picks the local batch that fits), compiled, AC selective,
     side by side with torchtitan's same job
  j  levers on (c)'s compiled batch-8 step, one at a time (AC none, torch's AdamW, a two-pass softmax,
     Inductor's kernel tuning): which one would pay

Every throughput figure follows one protocol on both sides (protocol.py): a window of steady steps after
the warm-up, timed between two device synchronisations, the same logging cadence; each run's device
readings (device_watch.py) and window step times decide whether it is steady (steadiness.py).

`--budget-s S`: before each run starts its duration is estimated (budget.py: a table refined with the
runs already measured) and a run that would not finish within S seconds of the start is skipped;
at S seconds, or on SIGTERM, the run in flight is stopped. Either way DIR/summary.md names the runs
that finished and those skipped, with the reason. Every part writes DIR/<part>/ (logs, metrics) and
DIR/<part>.json; DIR/summary.md is rewritten after each part from all part results in DIR, and so is
`--pack`'s archive (checkpoints left out). `--merge` unpacks several archives into DIR and writes the
combined summary.md; `--rejudge` judges the set in DIR again under the current steadiness rule from the
windows and device readings it kept (rejudge.py). `--dry-run` runs the same code on the CPU at tiny size (CUDA-only variants are
listed as not run): the CI test of the kit (tests/test_gpu_kit.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from budget import Budget  # noqa: E402
from kit import REPO, TITLES, Context, PartResult, environment, gpu_state, log  # noqa: E402

PARTS = "abcdefghij"


def run_part(ctx: Context, part: str) -> PartResult:
    import headline
    import large
    import levers
    import parts
    import titan

    fn = titan.part_d if part == "d" else large.part_i if part == "i" else levers.part_j if part == "j" else \
        getattr(headline if part in "cgh" else parts, f"part_{part}")
    t0 = time.perf_counter()
    if ctx.budget.stopped:
        result = PartResult(part, TITLES[part], [], ok=True)
        result.notes.append(f"not started: {ctx.budget.stopped}")
    else:
        log(f"part {part}: {ctx.budget.left():.0f} s of the budget left" if ctx.budget.left() != math.inf
            else f"part {part}")
        try:
            result = fn(ctx)
        except Exception as e:  # noqa: BLE001 - a broken part still leaves its verdict in the summary
            import traceback

            result = PartResult(part, TITLES[part], ["error"], [[f"{type(e).__name__}: {e}"[:400]]], ok=False)
            result.notes.append(traceback.format_exc()[-1500:])
    result.notes += ctx.notes
    ctx.notes.clear()
    result.runs, result.skipped = ctx.budget.of_part(part)
    result.seconds = round(time.perf_counter() - t0, 1)
    result.save(ctx)
    log(f"part {part}: {verdict(result.__dict__)} in {result.seconds:.0f}s")
    return result


def verdict(r: dict) -> str:
    """OK | PROBLEMS | NOT STARTED, and how many runs were skipped."""
    if not r.get("runs") and any(n.startswith("not started") for n in r["notes"]):
        return "NOT STARTED"
    skipped = len(r.get("skipped", []))
    return ("OK" if r["ok"] else "PROBLEMS") + (f", {skipped} run{'s' * (skipped != 1)} skipped" if skipped else "")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/").replace("\n", " ")


def write_summary(out: str, command: str) -> str:
    """DIR/summary.md from every DIR/<part>.json (and DIR/environment.json)."""
    env_path = os.path.join(out, "environment.json")
    env = json.load(open(env_path)) if os.path.exists(env_path) else {}
    lines = ["# GPU evidence kit: summary", ""]
    if env.get("dry_run"):
        lines += ["**Dry run on a CPU at tiny size: these are not CUDA figures.**", ""]
    lines += [f"- {k}: {v}" for k, v in env.items() if k not in ("dry_run", "commands")]
    lines += [f"- command: `{c}`" for c in env.get("commands", [command])] + [""]
    for part in PARTS:
        path = os.path.join(out, f"{part}.json")
        if not os.path.exists(path):
            lines += [f"## ({part}) not run", ""]
            continue
        r = json.load(open(path))
        lines += [f"## ({part}) {r['title']}: {verdict(r)} ({r['seconds']:.0f} s)", ""]
        if r["rows"]:
            lines += ["| " + " | ".join(r["columns"]) + " |", "|" + "---|" * len(r["columns"])]
            lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in r["rows"]]
            lines.append("")
        lines += [f"- {n}" for n in r["notes"]]
        if r.get("runs"):
            lines.append("- runs finished (estimated s / took s): "
                         + ", ".join(f"{name} ({_cell(est)} / {_cell(took)})" for name, est, took in r["runs"]))
        lines += [f"- skipped: {s}" for s in r.get("skipped", [])] + [""]
    text = "\n".join(lines)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text


GENERATED = ("d/torchtitan/data", "d/torchtitan/assets")
"""What the kit writes for torchtitan's runs and would write again (its data and tokenizer): not evidence."""


def evidence(name: str) -> bool:
    """Whether a path inside the output folder belongs in an archive: not checkpoints (the evidence is the
    metrics), not what the kit generates as input (GENERATED)."""
    return "checkpoint" not in name.split("/") and not any(name == g or name.startswith(g + "/") for g in GENERATED)


def pack(out: str, archive: str) -> None:
    """DIR as one tar.gz under the top folder `kit/`, with `evidence` only."""
    tmp = archive + ".partial"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(out, arcname="kit", filter=lambda m: m if evidence(m.name.partition("/")[2]) else None)
    os.replace(tmp, archive)


def merge(archives: list[str], out: str) -> None:
    """Unpack the GPU commands' archives into `out` (later parts win); their commands are kept."""
    commands = []
    for archive in archives:
        with tarfile.open(archive) as tar:
            members = []
            for m in tar.getmembers():  # "kit/..." as --pack writes it, "./kit/..." when repacked with tar -C
                name = m.name[2:] if m.name.startswith("./") else m.name
                if name.startswith("kit/") and ".." not in name.split("/") and (m.isfile() or m.isdir()) \
                        and evidence(name[len("kit/"):]):
                    m.name = name[len("kit/"):]
                    members.append(m)
            env_member = next((m for m in members if m.name == "environment.json"), None)
            if env_member is not None:
                commands += json.load(tar.extractfile(env_member)).get("commands", [])
            tar.extractall(out, members=[m for m in members if m.name])
    env_path = os.path.join(out, "environment.json")
    if os.path.exists(env_path):
        env = json.load(open(env_path))
        env["commands"] = list(dict.fromkeys(commands))
        json.dump(env, open(env_path, "w"), indent=1)


def main(argv: list[str] | None = None) -> int:
    budget = Budget()  # the clock starts here: the budget counts this process's imports too
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--part", default=",".join(PARTS), help="comma-separated parts, run in this order (default: all)")
    p.add_argument("--budget-s", type=float, help="skip every run that would not finish within this many seconds of "
                                                  "the start, stop the one in flight then (default: no limit)")
    p.add_argument("--pytest-s", type=float, default=480.0, help="cap on part (a)'s pytest run (default 480)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (CI)")
    p.add_argument("--pack", help="write the output folder as this .tar.gz after every part")
    p.add_argument("--merge", nargs="+", help="archives written by --pack to combine into --out")
    p.add_argument("--rejudge", action="store_true", help="judge the set in --out again under the current steadiness "
                                                          "rule (after --merge when both are given): rejudge.py")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/gpu/run_all.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.merge or args.rejudge:
        if args.merge:
            merge(args.merge, args.out)
        if args.rejudge:
            from rejudge import rejudge
            log(f"re-judged parts {', '.join(rejudge(args.out)) or 'none'} of {args.out}")
        print(write_summary(args.out, command))
        return 0
    parts = [x.strip() for x in args.part.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"unknown part(s) {bad}; parts are {', '.join(PARTS)}")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device here: the kit measures a GPU (use --dry-run to exercise it on a CPU)")
    budget.seconds = math.inf if args.budget_s is None else args.budget_s
    budget.arm()
    os.chdir(REPO)
    ctx = Context(os.path.abspath(args.out), args.dry_run, budget, args.pytest_s)
    results = []
    try:  # outside a run, a stop (SIGTERM, the deadline) only keeps the next runs and parts from starting
        cuda_s = None
        if not args.dry_run:  # the first CUDA context, timed apart so that no run's overhead carries it
            import torch

            t0 = time.perf_counter()
            torch.ones(1, device="cuda").sum().item()
            cuda_s = round(time.perf_counter() - t0, 1)
        env = {**environment(), "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M"),
               "first_cuda_context_s": cuda_s,
               "start_up_s": round(budget.clock() - budget.start, 1)}  # to the first part: imports, CUDA
        env["protocol"] = ctx.protocol.describe().removeprefix("protocol: ")
        state = gpu_state()
        if state is not None:  # the GPU's clock and temperature, here and after each part (throttling shows)
            env["gpu_at_start"] = state
        env["commands"] = [command]
        env_path = os.path.join(ctx.out, "environment.json")
        if os.path.exists(env_path):
            env["commands"] = list(dict.fromkeys(json.load(open(env_path)).get("commands", []) + [command]))
        json.dump(env, open(env_path, "w"), indent=1)
        for part in parts:
            results.append(run_part(ctx, part))
            if state is not None:
                env["gpu_at_end"] = f"{gpu_state()} (after part {part})"
                json.dump(env, open(env_path, "w"), indent=1)
            write_summary(ctx.out, command)
            if args.pack:
                pack(ctx.out, args.pack)
    finally:
        budget.disarm()
    print(write_summary(ctx.out, command))
    if budget.stopped:
        log(f"stopped: {budget.stopped}")
    return 1 if not all(r.ok for r in results) else 2 if budget.stopped else 0


if __name__ == "__main__":
    sys.exit(main())
