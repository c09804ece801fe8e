"""torch.compile benchmark: eager vs compiled torchtrain (and torchtitan, where installed), side by side.

    python benchmarks/compile.py [--repeats 3] [--steps 6] [--seq-len 2048] [--batch 8] [--flavor debugmodel]
                                 [--torchtitan-dir DIR [--torchtitan-python PY]] [--json OUT]

Workload (torchtitan's debug model): Llama 3 dim 256, 6 layers, 16 heads, vocab 2048, seq 2048, local
batch 8, fp32, no activation checkpointing, one process. Every run is a fresh process; the runs are
interleaved (eager, compiled, [peer eager, peer compiled]) and repeated, so a drifting machine moves
every side alike. A run's throughput is the median tokens/s of its steps 3..N (step 1 compiles, step 2
may still warm up); the report gives each side's median over the repeats with its spread (min-max) and
the ratios, per repeat and overall.

The peer: `--torchtitan-dir` is a folder to run torchtitan 0.2.x's trainer in (holding its job file
`debug_model.toml` and the `tests/assets` it names: tokenizer and c4_test data); `--torchtitan-python`
the interpreter that has torchtitan installed (default: this one). torchtitan has no CPU device path,
so on CPU its device helpers are pointed at the CPU by a small runner (below; the benchmark only); on
CUDA its own `torchtitan.train` runs.
torchtitan is told `training.mixed_precision_param = float32`: on one device it otherwise trains under
bfloat16 autocast, which is not the fp32 workload (and on a CPU with AVX-512 BF16 it is faster for
that reason alone). torchtitan >= 0.3 cannot train on CPU: its Llama 3 uses FlexAttention, which has no
CPU backward.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TITAN_CPU_RUNNER = '''"""Run torchtitan 0.2.x's trainer on the CPU (benchmark use only)."""
import sys, types
import torchtitan.tools.utils as utils
cpu = types.SimpleNamespace(
    set_device=lambda d: None, current_device=lambda: 0, device_count=lambda: 1, synchronize=lambda *a: None,
    empty_cache=lambda: None, reset_peak_memory_stats=lambda *a: None, get_device_name=lambda *a: "cpu",
    memory_stats=lambda *a: {"active_bytes.all.peak": 0, "active_bytes.all.current": 0,
                             "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0},
    get_device_properties=lambda *a: types.SimpleNamespace(total_memory=16 << 30, name="cpu"),
    memory=types.SimpleNamespace(empty_cache=lambda: None))
utils.device_type, utils.device_module = "cpu", cpu
from torchtitan.train import Trainer, main
for name, module in list(sys.modules.items()):
    if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu
main(Trainer)
'''
_TITAN_STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_torchtrain(args, compiled: bool) -> list[float]:
    """tokens/s of each step of one torchtrain run (metrics.jsonl, logged every step)."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torchtrain.train",
               "--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
               "--model.flavor", args.flavor,
               "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
               "--training.steps", str(args.steps), "--training.mixed_precision_param", "float32",
               "--training.device", args.device, "--activation_checkpoint.mode", "none",
               "--compile.enable", str(compiled).lower(), "--metrics.log_freq", "1",
               "--metrics.enable_tensorboard", "false", "--job.print_config", "false", "--job.dump_folder", dump]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"torchtrain run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            return [json.loads(line)["tokens_per_s_per_device"] for line in f]


def run_torchtitan(args, compiled: bool, runner: str | None) -> list[float]:
    """tokens/s of each step of one torchtitan run (its log's `tps:` column)."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [args.torchtitan_python, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv_backend=c10d",
               "--rdzv_endpoint=localhost:0", *([runner] if runner else ["-m", "torchtitan.train"]),
               "--job.config_file", "debug_model.toml",
               "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
               "--training.steps", str(args.steps), "--training.mixed_precision_param", "float32",
               "--activation_checkpoint.mode", "none", "--job.dump_folder", dump,
               "--compile.enable" if compiled else "--compile.no-enable"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=args.torchtitan_dir)
        steps = [(int(s), float(t.replace(",", ""))) for s, t in _TITAN_STEP.findall(_ANSI.sub("", proc.stderr + proc.stdout))]
        if proc.returncode != 0 or len(steps) < args.steps:
            raise SystemExit(f"torchtitan run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        return [tps for _, tps in sorted(steps)]


def steady(tps: list[float]) -> float:
    """A run's throughput: the median of its steps 3..N."""
    return statistics.median(tps[2:])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8,.0f}  (min {min(values):,.0f}, max {max(values):,.0f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="steps per run; throughput is the median of steps 3..N")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--flavor", default="debugmodel", help="torchtrain's Llama 3 flavor (the peer runs its job file)")
    p.add_argument("--torchtitan-dir", help="folder to run torchtitan in (its debug_model.toml and tests/assets)")
    p.add_argument("--torchtitan-python", default=sys.executable, help="interpreter with torchtitan installed")
    p.add_argument("--json", help="also write the measurements to this file")
    args = p.parse_args()
    if args.steps < 3:
        p.error("--steps must be at least 3 (steps 1-2 compile and warm up)")
    sides = ["torchtrain eager", "torchtrain compiled"]
    runner = None
    if args.torchtitan_dir:
        sides += ["torchtitan eager", "torchtitan compiled"]
        import torch

        if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
            runner = os.path.join(tempfile.mkdtemp(), "titan_cpu_runner.py")
            with open(runner, "w") as f:
                f.write(TITAN_CPU_RUNNER)
    results: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(args.repeats):
        for side in sides:
            compiled = side.endswith("compiled")
            tps = run_torchtrain(args, compiled) if side.startswith("torchtrain") else run_torchtitan(args, compiled, runner)
            results[side].append(steady(tps))
            print(f"repeat {r + 1}/{args.repeats}  {side:20s} {results[side][-1]:8,.0f} tokens/s  "
                  f"(steps: {', '.join(f'{t:,.0f}' for t in tps)})", flush=True)
    import torch

    print(f"\ntorch {torch.__version__} | threads {torch.get_num_threads()} | batch {args.batch} x seq {args.seq_len} | "
          f"{args.repeats} repeats, median of steps 3-{args.steps} per run")
    for side in sides:
        print(f"{side:20s} {spread(results[side])} tokens/s")
    ratios = {"torchtrain compiled / eager": ("torchtrain compiled", "torchtrain eager")}
    if args.torchtitan_dir:
        ratios["torchtitan compiled / eager"] = ("torchtitan compiled", "torchtitan eager")
        ratios["compiled: torchtrain / torchtitan"] = ("torchtrain compiled", "torchtitan compiled")
        ratios["eager: torchtrain / torchtitan"] = ("torchtrain eager", "torchtitan eager")
    summary = {}
    for name, (a, b) in ratios.items():
        per_repeat = [x / y for x, y in zip(results[a], results[b])]
        summary[name] = per_repeat
        print(f"{name:34s} {statistics.median(per_repeat):.3f}x  (per repeat: "
              f"{', '.join(f'{x:.3f}' for x in per_repeat)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens_per_s": results, "ratios": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
