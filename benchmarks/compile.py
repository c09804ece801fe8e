"""torch.compile benchmark: eager vs compiled torchtrain (and torchtitan, where installed), side by side.

    python benchmarks/compile.py [--repeats 3] [--steps 6] [--seq-len 2048] [--batch 8] [--flavor debugmodel]
                                 [--torchtitan-dir DIR [--torchtitan-python PY]] [--json OUT]

Workload (torchtitan's debug model): Llama 3 dim 256, 6 layers, 16 heads, vocab 2048, seq 2048, local
batch 8, fp32, no activation checkpointing, one process. Every run is a fresh process; the runs are
interleaved (eager, compiled, [peer eager, peer compiled]) and repeated, so a drifting machine moves
every side alike. A run's throughput is the median tokens/s of its steps 3..N (step 1 compiles, step 2
may still warm up); the report gives each side's median over the repeats with its spread (min-max) and
the ratios, per repeat and overall.

The peer: `--torchtitan-dir` is a folder to run torchtitan's trainer in (holding the `tests/assets` its
debug model names: tokenizer and c4_test data; for 0.2.x also its job file `debug_model.toml`); `--torchtitan-python`
the interpreter that has torchtitan installed (default: this one). torchtitan has no CPU device path,
so on CPU its device helpers are pointed at the CPU by a small runner (below; the benchmark only); on
CUDA its own `torchtitan.train` runs.
torchtitan is told `training.mixed_precision_param = float32`: on one device it otherwise trains under
bfloat16 autocast, which is not the fp32 workload (and on a CPU with AVX-512 BF16 it is faster for
that reason alone).

torchtitan 0.3 (on the CPU only here; on CUDA the GPU kit compares): its language models accept only
FlexAttention (no CPU backward) and varlen attention (CUDA kernels), so as shipped it cannot train on a
CPU. The runner builds its `llama3_debugmodel` config with its own `ScaledDotProductAttention` (causal, the
kernel torchtrain runs) and activation checkpointing off, and skips the process-group timeout call that
needs a newer torch; the data loader, loss (its chunked cross-entropy), optimizer and step are its own.
It needs triton importable (`pip install triton`: torchtitan imports it at start-up, the CPU never runs it).
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

_CPU_DEVICE = '''import sys, types
import torchtitan.tools.utils as utils
cpu = types.SimpleNamespace(
    set_device=lambda d: None, current_device=lambda: 0, device_count=lambda: 1, synchronize=lambda *a: None,
    empty_cache=lambda: None, reset_peak_memory_stats=lambda *a: None, get_device_name=lambda *a: "cpu",
    memory_stats=lambda *a: {"active_bytes.all.peak": 0, "active_bytes.all.current": 0,
                             "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0},
    get_device_properties=lambda *a: types.SimpleNamespace(total_memory=16 << 30, name="cpu"),
    memory=types.SimpleNamespace(empty_cache=lambda: None))
utils.device_type, utils.device_module = "cpu", cpu
'''
_TO_CPU = '''
for name, module in list(sys.modules.items()):
    if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu
'''
TITAN_CPU_RUNNER = '"""Run torchtitan 0.2.x\'s trainer on the CPU (benchmark use only)."""\n' + _CPU_DEVICE + '''
from torchtitan.train import Trainer, main
''' + _TO_CPU + "main(Trainer)\n"
TITAN3_CPU_RUNNER = '"""Run torchtitan 0.3.x\'s trainer on the CPU (benchmark use only; the module doc says how)."""\n' + \
    _CPU_DEVICE + '''
import torchtitan.models.common.config_utils as config_utils
from torchtitan.models.common.attention import ScaledDotProductAttention
import torchtitan.models.llama3 as llama3
import torchtitan.models.llama3.config_registry as registry
import torchtitan.distributed.utils as dist_utils
import torchtitan.train as train


def llama3_cpu_debugmodel():
    config = registry.llama3_debugmodel()
    config.model_spec = llama3.model_registry("debugmodel", attn_backend="sdpa")
    config.activation_checkpoint = None
    return config


_attention = config_utils.get_attention_config
llama3.get_attention_config = lambda backend: (ScaledDotProductAttention.Config() if backend == "sdpa"
                                               else _attention(backend))
registry.llama3_cpu_debugmodel = llama3_cpu_debugmodel
dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
''' + _TO_CPU + "train.main()\n"
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


def titan_version(python: str) -> tuple[int, int]:
    """(major, minor) of the torchtitan that `python` imports."""
    out = subprocess.run([python, "-c", "import torchtitan; print(torchtitan.__version__)"], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"--torchtitan-python {python}: cannot import torchtitan:\n{out.stderr[-2000:]}")
    major, minor = (int(part) for part in out.stdout.strip().split(".")[:2])
    return major, minor


def run_torchtitan(args, compiled: bool, runner: str | None, version: tuple[int, int]) -> list[float]:
    """tokens/s of each step of one torchtitan run (its log's `tps:` column)."""
    with tempfile.TemporaryDirectory() as dump:
        job = ["--module", "llama3", "--config", "llama3_cpu_debugmodel", "--dump_folder", dump] \
            if version >= (0, 3) else ["--job.config_file", "debug_model.toml", "--activation_checkpoint.mode", "none",
                                       "--job.dump_folder", dump]
        cmd = [args.torchtitan_python, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv_backend=c10d",
               "--rdzv_endpoint=localhost:0", *([runner] if runner else ["-m", "torchtitan.train"]), *job,
               "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
               "--training.steps", str(args.steps), "--training.mixed_precision_param", "float32",
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
    runner, version = None, (0, 0)
    if args.torchtitan_dir:
        sides += ["torchtitan eager", "torchtitan compiled"]
        import torch

        version = titan_version(args.torchtitan_python)
        if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
            runner = os.path.join(tempfile.mkdtemp(), "titan_cpu_runner.py")
            with open(runner, "w") as f:
                f.write(TITAN3_CPU_RUNNER if version >= (0, 3) else TITAN_CPU_RUNNER)
        elif version >= (0, 3):
            p.error("torchtitan >= 0.3 runs here on the CPU only (on CUDA: benchmarks/gpu)")
    results: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(args.repeats):
        for side in sides:
            compiled = side.endswith("compiled")
            tps = run_torchtrain(args, compiled) if side.startswith("torchtrain") else run_torchtitan(args, compiled, runner, version)
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
