"""The planner's step time against a measured step, on this CPU (docs/planner.md, "Checked on one device").

    python benchmarks/planner_cpu.py [--steps 10] [--seq-len 2048] [--batch 8] [--threads N] [--json OUT]

1. Measures this machine's rates the way the device table states a GPU's: the fp32 GEMM rate at the
   debug model's own matmul shapes (the planner's `fp32_tflops`, applied as achieved), the share of it
   that SDPA's causal forward and backward reach at the job's sequence length (its attention
   efficiencies), and the bandwidth of element-wise kernels (`hbm_tbps`).
2. Trains the debug model (Llama 3 dim 256, 6 layers, vocab 2048, fp32, one process) for `--steps`
   steps and takes the median step time of steps 3..N from metrics.jsonl.
3. Plans the same job with `python -m torchtrain.plan --gpu cpu --device FIELD=VALUE ...` (the measured
   rates, nothing else) and prints predicted against measured step time. Target: within 25%.
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

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_rates(tokens: int, seq_len: int, dim: int, hidden: int, heads: int) -> dict[str, float]:
    """Achieved fp32 GEMM TFLOP/s at the model's shapes, SDPA's share of it, element-wise bytes/s."""
    torch.manual_seed(0)
    shapes = [(tokens, dim, dim), (tokens, dim, hidden), (tokens, hidden, dim)]
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds += _timed(lambda: a @ b)
        flops += 2 * m * k * n
    gemm = flops / seconds
    head_dim = dim // heads
    q, kk, v = (torch.randn(tokens // seq_len, heads, seq_len, head_dim, requires_grad=True) for _ in range(3))
    att_flops = 2 * seq_len * seq_len * 2 * head_dim * 0.5 * heads * (tokens // seq_len)
    fwd = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True))
    out = torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True)
    grad = torch.randn_like(out)

    def backward():
        o = torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True)
        torch.autograd.grad(o, (q, kk, v), grad)

    bwd = max(_timed(backward) - fwd, 1e-9)
    x, y = torch.randn(tokens * dim * 4), torch.randn(tokens * dim * 4)
    elementwise = 3 * x.numel() * 4 / _timed(lambda: x + y)
    return {"fp32_tflops": gemm / 1e12, "attention_fwd_efficiency": att_flops / fwd / gemm,
            "attention_bwd_efficiency": 2.5 * att_flops / bwd / gemm, "hbm_tbps": elementwise / 1e12}


def measured_step(job: list[str], steps: int, env: dict) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torchtrain.train", *job, "--training.steps", str(steps),
               "--metrics.log_freq", "1", "--job.dump_folder", out]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    return statistics.median(r["step_time_s"] for r in records if r["step"] >= 3)


def predicted_step(job: list[str], rates: dict[str, float], env: dict) -> dict:
    device = [f"--device={k}={v:.6g}" for k, v in rates.items()]
    cmd = [sys.executable, "-m", "torchtrain.plan", *job, "--world-size", "1", "--gpu", "cpu", "--no-trace",
           "--json", *device]
    out = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["throughput"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", help="write the figures here too")
    ns = ap.parse_args(argv)
    torch.set_num_threads(ns.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(ns.threads), PYTHONUNBUFFERED="1")
    job = ["--job.config_file", "train_configs/debug_model.toml", "--training.dataset", "synthetic",
           "--training.seq_len", str(ns.seq_len), "--training.local_batch_size", str(ns.batch),
           "--training.mixed_precision_param", "float32", "--job.print_config", "false"]
    from torchtrain.models.registry import build_model_args, get_model_spec

    args = build_model_args(get_model_spec("llama3"), "debugmodel", {}, {})
    rates = measure_rates(ns.batch * ns.seq_len, ns.seq_len, args.dim, args.ffn_hidden_dim, args.n_heads)
    measured = measured_step(job, ns.steps, env)
    plan = predicted_step(job, rates, env)
    error = plan["step_s"] / measured - 1
    print(f"rates measured on this CPU ({ns.threads} threads): " + ", ".join(f"{k} {v:.4g}" for k, v in rates.items()))
    print(f"debug model, {ns.batch} x {ns.seq_len} tokens, fp32, 1 process:")
    print(f"  measured step  {measured:.3f} s (median of steps 3..{ns.steps})")
    print(f"  predicted step {plan['step_s']:.3f} s  ({error:+.1%}); "
          + ", ".join(f"{k} {v:.3f}" for k, v in plan["compute_breakdown_s"].items()))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"rates": rates, "measured_step_s": measured, "predicted": plan, "error": error}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
