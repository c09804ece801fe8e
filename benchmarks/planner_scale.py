"""How long the planner takes, and how much memory it needs, on the largest shipped plans (docs/planner.md:
"It runs on a laptop CPU in one process for any world size"). Target: each plan under a minute of CPU
and 4 GiB.

    python benchmarks/planner_scale.py [--json OUT] [-- PLANNER ARGS ...]

Without planner arguments it runs the documented plans of the largest job files (405B on 16,384 H100s,
DeepSeek-V3 671B on 2,048 H800s) and Qwen3-MoE 235B-A22B on 256 H100s. Each plan is its own
`python -m torchtrain.plan ... --json` process; its CPU time (user + system, from `os.wait4`: other work
on the machine does not add to it, a slower or shared core does) and peak RSS are printed as a table.
The tests check that these plans are valid, fit and stay under 4 GiB (tests/test_planner_scale.py), not
how long they take: that depends on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_CPU_S, TARGET_GIB = 60.0, 4.0


def documented(job_file: str) -> list[str]:
    """The planner arguments of a job file's `plan:` header line."""
    line = next(line for line in open(os.path.join(REPO, job_file)) if "python -m torchtrain.plan " in line)
    return shlex.split(line.split("python -m torchtrain.plan ", 1)[1])


def plans() -> list[tuple[str, list[str]]]:
    return [("llama3 405B, 16,384 x H100 (its job file)", documented("train_configs/llama3_405b.toml")),
            ("DeepSeek-V3 671B, 2,048 x H800 (its job file)", documented("train_configs/deepseek_v3_671b.toml")),
            ("Qwen3-MoE 235B-A22B, 256 x H100, pp 2 tp 2 ep 8",
             ["--world-size", "256", "--gpu", "h100", "--model.name", "qwen3_moe", "--model.flavor", "235B-A22B",
              "--training.seq_len", "4096", "--training.local_batch_size", "4", "--pp", "2", "--tp", "2", "--ep", "8",
              "--ac", "full"])]


def measure(args: list[str]) -> dict:
    """One planner process: its CPU seconds, peak RSS and verdicts."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "torchtrain.plan", *args, "--json"], cwd=REPO, stdout=out,
                                stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0), err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"planner failed: {' '.join(args)}\n{err.read()[-2000:]}")
        data = json.load(out)
    return {"cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "rss_gib": round(usage.ru_maxrss / 2**20, 2),
            "valid": data.get("valid"), "fits": data.get("memory", {}).get("fits")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("planner_args", nargs="*", help="one plan's arguments instead of the built-in ones (after --)")
    ns = parser.parse_args()
    cases = [("given", ns.planner_args)] if ns.planner_args else plans()
    rows = []
    print(f"{'plan':50s} {'CPU s':>7s} {'RSS GiB':>8s}  verdict")
    for name, args in cases:
        row = {"plan": name, "args": args, **measure(args)}
        row["within_target"] = row["cpu_s"] < TARGET_CPU_S and row["rss_gib"] < TARGET_GIB
        rows.append(row)
        print(f"{name:50s} {row['cpu_s']:7.1f} {row['rss_gib']:8.2f}  valid={row['valid']} fits={row['fits']} "
              f"{'within' if row['within_target'] else 'OVER'} the target ({TARGET_CPU_S:.0f} s, {TARGET_GIB:.0f} GiB)")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
