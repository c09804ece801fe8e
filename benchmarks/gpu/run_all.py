"""The GPU evidence kit: every figure the first lent GPU should produce, from one prepared command.

    python benchmarks/gpu/run_all.py --out DIR [--part a,b,c,d,e,f] [--dry-run] [--pack FILE.tar.gz]
    python benchmarks/gpu/run_all.py --merge A.tar.gz B.tar.gz ... --out DIR

Parts (benchmarks/gpu/README.md has the device commands, the output folder and the summary format):
  a  the suite's single-process test cases on the device
  b  short bf16 runs of the debug model and a ~1B Llama 3 (FSDP on a 1-rank mesh) per feature -- AC
     none/selective/full, compile, fp16 + loss scaling, CPU offload, float8 -- each must end with a
     falling loss
  c  tokens/s and MFU of the 1B shape at seq 2048 and 8192: eager, compile, compile + float8, against
     the device's measured bf16 GEMM peak
  d  torchtitan (a carried wheel) on the same model/batch/sequence, back to back, and the ratio
  e  the planner's memory and step time against torch.cuda.max_memory_allocated and the measured
     step, for four jobs
  f  DCP save/resume exactness (bitwise losses after a resume)

Every part writes DIR/<part>/ (logs, metrics) and DIR/<part>.json; then DIR/summary.md is (re)written
from all part results in DIR. `--pack` writes DIR as one tar.gz (what a device call copies to $OUT);
`--merge` unpacks several such archives into DIR and writes the combined summary.md. `--dry-run` runs
the same code on the CPU at tiny size (CUDA-only variants are listed as not run): the CI test of the
kit (tests/test_gpu_kit.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kit import REPO, Context, PartResult, environment, log  # noqa: E402

PARTS = "abcdef"


def run_part(ctx: Context, part: str) -> PartResult:
    import parts
    import titan

    fn = titan.part_d if part == "d" else getattr(parts, f"part_{part}")
    t0 = time.perf_counter()
    try:
        result = fn(ctx)
    except Exception as e:  # noqa: BLE001 - a broken part still leaves its verdict in the summary
        import traceback

        result = PartResult(part, f"part {part}", ["error"], [[f"{type(e).__name__}: {e}"[:400]]], ok=False)
        result.notes.append(traceback.format_exc()[-1500:])
    result.seconds = round(time.perf_counter() - t0, 1)
    result.save(ctx)
    log(f"part {part}: {'OK' if result.ok else 'PROBLEMS'} in {result.seconds:.0f}s")
    return result


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
        lines += [f"## ({part}) {r['title']}: {'OK' if r['ok'] else 'PROBLEMS'} ({r['seconds']:.0f} s)", ""]
        if r["rows"]:
            lines += ["| " + " | ".join(r["columns"]) + " |", "|" + "---|" * len(r["columns"])]
            lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in r["rows"]]
            lines.append("")
        lines += [f"- {n}" for n in r["notes"]] + [""]
    text = "\n".join(lines)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text


def pack(out: str, archive: str) -> None:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname="kit")


def merge(archives: list[str], out: str) -> None:
    """Unpack device calls' archives into `out` (later parts win); their commands are kept."""
    commands = []
    for archive in archives:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith("kit/") and ".." not in m.name
                       and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len("kit/"):]
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--part", default=",".join(PARTS), help="comma-separated parts to run (default: all)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (CI)")
    p.add_argument("--pack", help="write the output folder as this .tar.gz at the end")
    p.add_argument("--merge", nargs="+", help="archives written by --pack to combine into --out")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/gpu/run_all.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.merge:
        merge(args.merge, args.out)
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
    os.chdir(REPO)
    ctx = Context(os.path.abspath(args.out), args.dry_run)
    env = {**environment(), "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M"), "commands": [command]}
    env_path = os.path.join(ctx.out, "environment.json")
    if os.path.exists(env_path):
        env["commands"] = list(dict.fromkeys(json.load(open(env_path)).get("commands", []) + [command]))
    json.dump(env, open(env_path, "w"), indent=1)
    results = [run_part(ctx, part) for part in parts]
    print(write_summary(ctx.out, command))
    if args.pack:
        pack(ctx.out, args.pack)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
