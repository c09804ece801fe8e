"""How much of a slow expert all-to-all the overlap chunks hide: step time with overlap off and on.

    python benchmarks/moe_overlap.py [--nproc 2] [--delay-ms 40] [--chunks 4] [--steps 8]

A small Qwen3-MoE job (wide experts, so the experts' computation is what the communication can hide
behind) under expert parallelism on `--nproc` gloo ranks, with `debug.expert_comm_delay_ms` making
every MoE layer's dispatch and combine all-to-all `--delay-ms` late (`distributed/expert_comm.py`).
Four runs: no delay without / with chunks (the compute alone, and the chunking's own cost), the delay
without chunks (all of it exposed) and with `--chunks` chunks. The hidden share is

    hidden = (step_off - step_on) / (step_off - step_no_delay)

the part of the exposed delay that the overlap took off the step. Step time: the median of the steps
after the second (metrics.jsonl's step_time_s). The planner's prediction for each run (`python -m
torchtrain.plan --gpu cpu --json` with the same overrides) is reported where its JSON has a step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ_LEN, BATCH, DIM, HEADS, EXPERT_HIDDEN = 512, 2, 256, 4, 1024
JOB = ["--model.name", "qwen3_moe", "--model.dim", "256", "--model.n_layers", "2", "--model.n_heads", "4",
       "--model.n_kv_heads", "2", "--model.head_dim", "64", "--model.vocab_size", "512", "--model.num_experts", "4",
       "--model.num_experts_per_tok", "2", "--model.moe_intermediate_size", "1024", "--training.dataset", "synthetic",
       "--training.seq_len", "512", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2"]


def overrides(ep: int, delay_ms: float, chunks: int) -> list[str]:
    return [*JOB, "--parallelism.expert_parallel_degree", str(ep), "--debug.expert_comm_delay_ms", str(delay_ms),
            "--parallelism.expert_parallel_overlap_chunks", str(chunks)]


def train(nproc: int, args: list[str], steps: int, dump: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "-m", "torchtrain.train", *args, "--training.steps", str(steps),
           "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--job.print_config", "false",
           "--job.dump_folder", dump]
    env = dict(os.environ, PYTHONUNBUFFERED="1", LOG_RANK="0")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if out.returncode:
        sys.exit(f"training failed:\n{(out.stdout + out.stderr)[-3000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        times = [json.loads(line)["step_time_s"] for line in f if line.strip()]
    return statistics.median(times[2:])


def _find_step_time(node) -> float | None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("step_time_s", "step_s", "predicted_step_time_s") and isinstance(value, (int, float)):
                return float(value)
        for value in node.values():
            found = _find_step_time(value)
            if found is not None:
                return found
    if isinstance(node, list):
        for value in node:
            found = _find_step_time(value)
            if found is not None:
                return found
    return None


def measured_rates() -> dict[str, float]:
    """This CPU's rates for one worker's thread (torchrun gives each of its workers one), measured at the
    job's own matmul shapes as benchmarks/planner_cpu.py measures them: what the planner is told."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from planner_cpu import measure_rates

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_rates(SEQ_LEN * BATCH, SEQ_LEN, DIM, EXPERT_HIDDEN, HEADS)
    finally:
        torch.set_num_threads(threads)


def planned(nproc: int, args: list[str], rates: dict[str, float]) -> float | None:
    """The planner's step time for the run (`--gpu cpu` with the measured rates), or None where it gives none."""
    device = [f"--device={k}={v:.6g}" for k, v in rates.items()]
    cmd = [sys.executable, "-m", "torchtrain.plan", "--config", os.path.join(REPO, "train_configs",
           "qwen3_moe_debug.toml"), "--gpu", "cpu", "--world-size", str(nproc), "--json", "--no-trace", *device, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    try:
        return _find_step_time(json.loads(out.stdout)) if out.returncode == 0 else None
    except json.JSONDecodeError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--delay-ms", type=float, default=40.0)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    rates = measured_rates()
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for name, delay, chunks in (("no delay, off", 0.0, 1), ("no delay, on", 0.0, a.chunks),
                                    ("delay, off", a.delay_ms, 1), ("delay, on", a.delay_ms, a.chunks)):
            args = overrides(a.nproc, delay, chunks)
            rows[name] = (train(a.nproc, args, a.steps, os.path.join(work, name.replace(", ", "_").replace(" ", ""))),
                          planned(a.nproc, args, rates))
    base, off, on = rows["no delay, off"][0], rows["delay, off"][0], rows["delay, on"][0]
    hidden = (off - on) / (off - base) if off > base else float("nan")
    fmt = lambda t: "n/a" if t is None else f"{t:.3f}"  # noqa: E731
    print("rates measured on this CPU (1 thread): " + ", ".join(f"{k} {v:.4g}" for k, v in rates.items()))
    print(f"{a.nproc} gloo ranks, EP {a.nproc}, delay {a.delay_ms} ms per dispatch/combine, {a.chunks} chunks")
    print("| run | step (s) | planner (s) |\n|---|---|---|")
    for name, (t, plan) in rows.items():
        print(f"| {name} | {t:.3f} | {fmt(plan)} |")
    print("\n| delay (ms) | step off (s) | step on (s) | hidden share | planner off / on (s) |\n|---|---|---|---|---|")
    print(f"| {a.delay_ms:g} | {off:.3f} | {on:.3f} | {hidden:.0%} | {fmt(rows['delay, off'][1])} / "
          f"{fmt(rows['delay, on'][1])} |")


if __name__ == "__main__":
    main()
