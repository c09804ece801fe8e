"""The gated delta rule, forward + backward: this engine's chunked kernel against transformers' torch fallback.

    python benchmarks/delta_rule.py [--seq-lens 2048,8192] [--heads-k 4] [--heads-v 8] [--head-dim 128]
        [--batch 1] [--chunk-size 64] [--device cpu|cuda] [--threads 2] [--repeats 3]
        [--max-recurrent-len 2048] [--json FILE]

Qwen3.5 / Qwen3-Next linear-attention layers mix tokens with the gated delta rule
(`torchtrain/models/common/delta_rule.py`). Each case runs one kernel at one sequence length:

- `chunked`: `chunked_gated_delta_rule` (this engine's chunked WY/UT form; plain autograd),
- `transformers`: transformers' `torch_chunk_gated_delta_rule` (its torch fallback when flash-linear-attention is
  not installed; the label names the implementation transformers resolved), `use_qk_l2norm_in_kernel=False`,
- `recurrent`: `recurrent_gated_delta_rule` (the token-by-token reference), only up to `--max-recurrent-len`
  tokens ("skipped" beyond: it is slow and keeps every step's state for the backward),
- `fla`: flash-linear-attention's kernel, on CUDA where it is installed.

All get the same float32 inputs: q and k L2-normalised over the head dimension, g = -softplus(randn), beta =
sigmoid(randn), a zero initial state; transformers scales q by Dk^-0.5 itself, the engine's kernels get q
already scaled (their contract). A step is a forward, then a backward of o.sum() + final_state.sum() to q, k, v,
g and beta; the figure is the median over `--repeats` steps after one warm-up step, as tokens (batch x length)
a second. `max |o - chunked|` is the largest difference of the outputs from the chunked kernel's.

Peak memory: every case runs in a fresh subprocess (`--worker`). On the CPU it is the growth of the process's
peak resident set size (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) over the steps, above the RSS after the
inputs were made and torch loaded -- what the kernel's activations, saved tensors and gradients took at their
peak, allocator caching and fragmentation included (tracemalloc does not see torch's allocations). On CUDA it
is `torch.cuda.max_memory_allocated()` over the steps minus the memory allocated before them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

KERNELS = ("chunked", "transformers", "recurrent", "fla")


def make_inputs(batch: int, seq: int, heads_k: int, heads_v: int, dim: int, device: str, seed: int = 0) -> list:
    """[q (L2-normalised, unscaled), k (L2-normalised), v, g, beta], float32 on `device`."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, seq, heads_k, dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(batch, seq, heads_k, dim, generator=gen), dim=-1)
    v = torch.randn(batch, seq, heads_v, dim, generator=gen)
    g = -F.softplus(torch.randn(batch, seq, heads_v, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, seq, heads_v, generator=gen))
    return [x.to(device) for x in (q, k, v, g, beta)]


def kernel_fn(kernel: str, chunk_size: int):
    """(a function of the unscaled inputs returning (o, final state), its label)."""
    from torchtrain.models.common import delta_rule

    def ours(fn):
        return lambda q, k, v, g, beta: fn(q * q.shape[-1] ** -0.5, k, v, g, beta)

    if kernel == "chunked":
        return ours(lambda *a: delta_rule.chunked_gated_delta_rule(*a, chunk_size=chunk_size)), "chunked (ours)"
    if kernel == "recurrent":
        return ours(delta_rule.recurrent_gated_delta_rule), "recurrent (ours)"
    if kernel == "fla":
        return ours(lambda *a: delta_rule.gated_delta_rule(*a, kernel="fla")), "fla"
    from transformers.models.qwen3_5 import modeling_qwen3_5

    impl = modeling_qwen3_5.torch_chunk_gated_delta_rule
    module = getattr(impl, "__module__", None) or "?"
    label = ("transformers (torch fallback)" if module == modeling_qwen3_5.__name__
             else f"transformers (resolved to {module}.{getattr(impl, '__name__', '?')})")

    def hf(q, k, v, g, beta):
        return impl(q, k, v, g, beta, chunk_size=chunk_size, initial_state=None, output_final_state=True,
                    use_qk_l2norm_in_kernel=False)

    return hf, label


def worker(args: argparse.Namespace) -> dict:
    """One case in this process: the median step time, the peak memory growth, the outputs' difference."""
    import torch

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    fn, label = kernel_fn(args.worker, args.chunk_size)
    inputs = make_inputs(args.batch, args.seq, args.heads_k, args.heads_v, args.head_dim, args.device)

    def step() -> float:
        leaves = [x.clone().requires_grad_() for x in inputs]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        o, state = fn(*leaves)
        (o.sum() + state.sum()).backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = [step() for _ in range(args.repeats + 1)][1:]
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    diff = 0.0
    if args.worker != "chunked":
        from torchtrain.models.common.delta_rule import chunked_gated_delta_rule

        with torch.no_grad():
            q, k, v, g, beta = inputs
            ref, _ = chunked_gated_delta_rule(q * q.shape[-1] ** -0.5, k, v, g, beta, chunk_size=args.chunk_size)
            diff = (fn(*inputs)[0].float() - ref).abs().max().item()
    seconds = statistics.median(times)
    return dict(kernel=args.worker, label=label, seq=args.seq, step_s=seconds,
                tokens_per_s=args.batch * args.seq / seconds, peak_mib=peak / 2**20, max_diff=diff)


def run_case(args: argparse.Namespace, kernel: str, seq: int) -> dict:
    """`kernel` at `seq` tokens in a fresh subprocess; its row (or a row saying why there is none)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kernel, "--seq", str(seq)]
    for flag in ("batch", "heads_k", "heads_v", "head_dim", "chunk_size", "device", "threads", "repeats"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(kernel=kernel, label=kernel, seq=seq, skipped=f"failed: {tail}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", default="2048,8192", help="sequence lengths, comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads-k", type=int, default=4, help="query/key heads (Qwen3.5: 16)")
    ap.add_argument("--heads-v", type=int, default=8, help="value heads, a multiple of --heads-k (Qwen3.5: 32)")
    ap.add_argument("--head-dim", type=int, default=128, help="Dk = Dv")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up; the median is reported")
    ap.add_argument("--max-recurrent-len", type=int, default=2048, help="longest sequence the recurrence runs")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--worker", choices=KERNELS, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    import torch

    from torchtrain.models.common.delta_rule import fla_available

    kernels = ["chunked", "transformers", "recurrent"] + (["fla"] if args.device == "cuda" and fla_available() else [])
    try:
        import transformers  # noqa: F401
    except ImportError:
        kernels.remove("transformers")
        print("transformers is not installed: its fallback is not measured\n")
    print(f"torch {torch.__version__}, {args.device}, {args.threads} threads; batch {args.batch}, heads k/v "
          f"{args.heads_k}/{args.heads_v}, head dim {args.head_dim}, chunk {args.chunk_size}; forward + backward, "
          f"median of {args.repeats}\n")
    print("| seq | kernel | s a step | tokens/s | peak memory (MiB) | max \\|o - chunked\\| |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    rows = []
    for seq in (int(s) for s in args.seq_lens.split(",")):
        for kernel in kernels:
            if kernel == "recurrent" and seq > args.max_recurrent_len:
                row = dict(kernel=kernel, label="recurrent (ours)", seq=seq,
                           skipped=f"skipped (> --max-recurrent-len {args.max_recurrent_len})")
            else:
                row = run_case(args, kernel, seq)
            rows.append(row)
            if "skipped" in row:
                print(f"| {seq} | {row['label']} | {row['skipped']} | | | |")
            else:
                print(f"| {seq} | {row['label']} | {row['step_s']:.3f} | {row['tokens_per_s']:,.0f} | "
                      f"{row['peak_mib']:,.0f} | {row['max_diff']:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
