"""Optimizer benchmark: how fast the loss falls with Muon vs AdamW on the debug job (one process).

    python benchmarks/optimizers.py [--steps 100] [--runs AdamW:3e-3,AdamW:1e-2,Muon:3e-3,Muon:1e-2]
                                    [--eval-freq 100] [--json OUT] [-- extra trainer overrides]

Each run (optimizer:learning rate) trains `train_configs/debug_model.toml` (Llama 3 debug model on the
Python standard library: dim 256, 6 layers, seq 256, local batch 8, 5 warmup steps and cosine decay
to 10%, weight decay 0.1; the job's own lr is 3e-3) for `--steps` steps with the same seed, data and
initial weights, in a fresh process, with the built-in evaluation tasks scored every `--eval-freq`
steps and at the end. The report gives the training loss (mean of the 10 steps up to each mark, to
smooth batch noise), the final validation loss on held-out standard-library files (20 batches of 8),
and the tasks' accuracy. Muon's learning rate applies to both of its parts (RMS-matched matrices and
AdamW for the rest: docs/optimizers.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from torchtrain.utils.strict_json import read_jsonl  # noqa: E402


def run(name: str, steps: int, eval_freq: int, workdir: str, extra: list[str]) -> list[dict]:
    optimizer, lr = name.split(":")
    dump = os.path.join(workdir, name.replace(":", "_"))
    cmd = [sys.executable, "-m", "torchtrain.train", "--job.config_file", "train_configs/debug_model.toml",
           "--training.steps", str(steps), "--optimizer.name", optimizer, "--optimizer.lr", lr,
           "--job.dump_folder", dump,
           "--metrics.enable_tensorboard", "false", "--job.print_config", "false",
           "--validation.enable", "--validation.freq", str(steps), "--validation.steps", "20",
           "--eval.enable", "--eval.freq", str(eval_freq), "--eval.tasks", "copy,keywords",
           "--eval.local_batch_size", "32", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, LOG_RANK="0"))
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return read_jsonl(os.path.join(dump, "metrics.jsonl"))


def smoothed_loss(records: list[dict], step: int, window: int = 10) -> float:
    losses = [r["loss"] for r in records if step - window < r["step"] <= step]
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs", default="AdamW:3e-3,AdamW:1e-2,Muon:3e-3,Muon:1e-2",
                        help="optimizer:lr, comma-separated")
    parser.add_argument("--eval-freq", type=int, default=100)
    parser.add_argument("--json", help="write the records of every run here")
    args, extra = parser.parse_known_args(argv)
    extra = [e for e in extra if e != "--"]
    names = args.runs.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-opt-") as tmp:
        results = {name: run(name, args.steps, args.eval_freq, tmp, extra) for name in names}
    marks = sorted({m for m in (10, 25, 50, 100, 150, 200, 300, 400, 500, args.steps) if m <= args.steps})
    print(f"debug job, {args.steps} steps; training loss (mean of the 10 steps up to each mark)")
    print(f"{'step':>6} " + " ".join(f"{n:>12}" for n in names))
    for m in marks:
        print(f"{m:>6} " + " ".join(f"{smoothed_loss(results[n], m):>12.4f}" for n in names))
    print(f"{'val':>6} " + " ".join(f"{results[n][-1]['validation_loss']:>12.4f}" for n in names))
    tasks = sorted(k for k in results[names[0]][-1] if k.startswith("eval/"))
    for key in tasks:
        row = []
        for n in names:
            values = [f"{r[key]:.3f}" for r in results[n] if key in r]
            row.append(" -> ".join(values))
        print(f"{key}: " + " | ".join(f"{n} {v}" for n, v in zip(names, row)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
