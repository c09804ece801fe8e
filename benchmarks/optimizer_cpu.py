"""AdamW on the CPU: parameters per second of torch's three implementations (for-loop, foreach, fused).

    python benchmarks/optimizer_cpu.py [--params-m 100] [--threads 1,2] [--steps 3] [--json FILE]

Where the optimizer state lives in host memory -- CPU training, and a GPU job's CPU offload
(`training.enable_cpu_offload`, `[offload] optimizer = "cpu"`) -- every step waits for AdamW to pass over
every parameter on the CPU: an offloaded 1.5B-parameter model spends seconds a step there. torch's fused
AdamW does it in one vectorized pass per tensor, where foreach runs a dozen element-wise passes over
the whole list (each reading and writing every element), so `optimizer.implementation = "auto"` picks
the fused kernel on the CPU as on CUDA.

Each implementation steps the same float32 parameters (4096 x 4096 tensors, `--params-m` million in
all, random gradients) after one warm-up step; the figure is the median over `--steps` steps. The table
also gives the seconds a step of a 1.5B-parameter model would take at that rate, and the largest
difference of the parameters after the steps against the for-loop implementation (the formula is the
same; the vectorized kernels may round differently in the last bit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

IMPLEMENTATIONS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def measure(impl: str, params_m: int, steps: int, seed: int = 0) -> tuple[float, list[torch.Tensor]]:
    """(seconds per step, the parameters after the steps)."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, round(params_m * 1e6 / 4096**2))
    params = [torch.nn.Parameter(torch.randn(4096, 4096, generator=gen)) for _ in range(n)]
    grads = [torch.randn(4096, 4096, generator=gen) for _ in range(n)]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **IMPLEMENTATIONS[impl])
    opt.step()  # warm-up: the state is allocated
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times), [p.detach() for p in params]


def rate_row(n_params: int, seconds: float, max_diff: float, **labels) -> dict:
    """A table row: seconds a step, parameters a second, a 1.5B-parameter model's step at that rate."""
    return dict(**labels, step_s=seconds, mparams_per_s=n_params / seconds / 1e6, step_s_at_1_5b=1.5e9 * seconds / n_params,
                max_diff=max_diff)


def write_rows(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=int, default=100, help="million parameters stepped")
    ap.add_argument("--threads", default="1,2", help="torch.set_num_threads values, comma-separated")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print(f"torch {torch.__version__}, {args.params_m}M float32 parameters\n")
    print("| threads | implementation | s a step | M params/s | s a step at 1.5B | max diff vs for-loop |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        reference = None
        for impl in IMPLEMENTATIONS:
            seconds, params = measure(impl, args.params_m, args.steps)
            n = sum(p.numel() for p in params)
            reference = params if reference is None else reference
            diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
            row = rate_row(n, seconds, diff, threads=threads, implementation=impl)
            rows.append(row)
            print(f"| {threads} | {impl} | {seconds:.3f} | {row['mparams_per_s']:,.0f} | {row['step_s_at_1_5b']:.2f} | "
                  f"{diff:.1e} |")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
