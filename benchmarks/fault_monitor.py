"""What the [fault] monitoring costs a clean run: hang monitor + straggler clock on vs off.

    python benchmarks/fault_monitor.py [--nproc 2] [--steps 40] [--warmup 5] [--repeats 3]

1. The training thread's cost per phase boundary (what `FaultRuntime.phase` adds to every boundary:
   the heartbeat's in-memory record and the CPU clock read), timed over 200k boundaries in this process.
2. Whole runs under torchrun (the launcher, gloo, CPU): the same job with the monitor on
   (hang_timeout_s 60, straggler_freq 10: a store write and read per rank every 7.5 s, a straggler
   exchange every 10 steps) and off (hang_timeout_s none, straggler_freq 0), interleaved `--repeats`
   times (the machine drifts between minutes), each side's median step time over the steps after
   `--warmup` (metrics.jsonl's step_time_s, logged every step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--model.dim", "256", "--model.n_layers", "4", "--model.n_heads", "8", "--model.vocab_size", "2048",
         "--training.dataset", "synthetic", "--training.seq_len", "256", "--training.local_batch_size", "4",
         "--lr_scheduler.warmup_steps", "2", "--job.print_config", "false", "--metrics.log_freq", "1",
         "--metrics.enable_tensorboard", "false"]
ON = ["--fault.hang_timeout_s", "60", "--fault.straggler_freq", "10"]
OFF = ["--fault.hang_timeout_s", "none", "--fault.straggler_freq", "0"]


def boundary_cost(n: int = 200_000) -> float:
    """Nanoseconds the training thread spends per phase boundary in the [fault] listener, with the hang
    monitor (its thread publishing to a store in this process) and the straggler clock on."""
    import torch
    import torch.distributed as dist

    from torchtrain.components.fault import FaultRuntime
    from torchtrain.config import parse_args
    from torchtrain.distributed.utils import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    cfg = parse_args(ON)
    state = SimpleNamespace(step=1)
    with tempfile.TemporaryDirectory() as dump:
        runtime = FaultRuntime(cfg.fault, cfg.debug, dump, state, torch.device("cpu"), rank=0, world_size=2,
                               user_profiler=False)
        phases = ["forward_backward", "optimizer", None]
        t0 = time.perf_counter()
        for i in range(n):
            runtime.phase(phases[i % 3])
        elapsed = time.perf_counter() - t0
        runtime.close()
    return elapsed / n * 1e9


def run(nproc: int, steps: int, extra: list[str]) -> list[float]:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torchtrain.launcher", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
               "--rdzv_endpoint=localhost:0", "-m", "torchtrain.train", *MODEL, "--training.steps", str(steps),
               "--job.dump_folder", dump, *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", LOG_RANK="0")
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            return [json.loads(line)["step_time_s"] for line in f]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"training thread per phase boundary: {boundary_cost():.0f} ns")
    sides: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.repeats):
        for name, extra in (("off", OFF), ("on", ON)) if r % 2 else (("on", ON), ("off", OFF)):
            median = statistics.median(run(args.nproc, args.steps, extra)[args.warmup:])
            sides[name].append(median)
            print(f"repeat {r + 1}: monitor {name:3s} median step {median * 1e3:.1f} ms", flush=True)
    on, off = statistics.median(sides["on"]), statistics.median(sides["off"])
    spread = max(max(v) / min(v) - 1 for v in sides.values())
    print(f"{args.nproc} processes, {args.steps - args.warmup} timed steps x {args.repeats} runs per side: "
          f"on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms per step ({100 * (on / off - 1):+.1f}%; "
          f"run-to-run spread within a side up to {100 * spread:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
