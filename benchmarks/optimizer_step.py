"""The work after backward of a one-rank bf16 step: torch's kernels against the compiled optimizer step.

    python benchmarks/optimizer_step.py [--params-m 200] [--device cpu|cuda] [--steps 5] [--json FILE]

A job training one rank from a bf16 compute copy of float32 parameters (`distributed/compute_copy.py`)
does, between its last backward and its next forward:

* torch's kernels (`compile.components` without "optimizer"): each bf16 gradient upcast to float32 (in
  backward), the global norm, the clip (`_foreach_mul_`), the fused AdamW, and the next step's cast of the
  parameters into the copy (`_foreach_copy_`);
* the compiled step (`components/optim/compiled_adamw.py`, one micro-batch a step): the norm of the bf16
  gradients, then one compiled pass per parameter that clips, updates and writes the copy.

Both step the same parameters (4096 x 4096 float32 tensors plus a 4096 one per matrix, `--params-m`
million in all) from the same bf16 gradients, clipped (max norm 1); the figure is the median over
`--steps` steps after two warm-up steps (the first compiles). The table gives seconds a step, the
parameters per second, what a 1.5B-parameter model's step would spend at that rate, and the largest
difference of the parameters against torch's path after the steps (float32 rounding of the bias
corrections).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from optimizer_cpu import rate_row, write_rows

from torchtrain.components.optim.compiled_adamw import CompiledAdamW
from torchtrain.distributed.utils import clip_factor


def _tensors(params_m: int, device: str, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(seed)  # (made on the device: 1.5B values take the CPU seconds)
    n = max(1, round(params_m * 1e6 / (4096**2 + 4096)))
    shapes = [s for _ in range(n) for s in ((4096, 4096), (4096,))]
    params = [torch.randn(s, generator=gen, device=device) for s in shapes]
    grads = [(torch.randn(s, generator=gen, device=device) * 1e-3).to(torch.bfloat16) for s in shapes]
    return params, grads


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def torch_path(params_m: int, device: str, steps: int) -> tuple[float, list[torch.Tensor]]:
    """Upcast, norm, clip, torch's fused AdamW, the copy's cast: (seconds a step, parameters)."""
    values, grads16 = _tensors(params_m, device)
    params = [torch.nn.Parameter(v) for v in values]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
    times = []
    for i in range(steps + 2):
        _sync(device)
        t = time.perf_counter()
        for p, g in zip(params, grads16):
            p.grad = g.to(torch.float32)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(copies, params)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times), [p.detach() for p in params]


def compiled_path(params_m: int, device: str, steps: int) -> tuple[float, list[torch.Tensor]]:
    """Norm of the bf16 gradients, then the compiled step writing the copy: (seconds a step, parameters)."""
    values, grads16 = _tensors(params_m, device)
    params = [torch.nn.Parameter(v) for v in values]
    copies = [torch.nn.Parameter(torch.empty_like(p, dtype=torch.bfloat16)) for p in params]
    opt = CompiledAdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
    opt.copies = {id(p): c for p, c in zip(params, copies)}
    for c, g in zip(copies, grads16):
        c.grad = g
    times = []
    for i in range(steps + 2):
        _sync(device)
        t = time.perf_counter()
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads16, 2.0, dtype=torch.float32)))
        opt.grad_scale = clip_factor(norm, 1.0)
        opt.step()
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times), [p.detach() for p in params]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=int, default=200, help="million parameters stepped")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {args.device}, {args.params_m}M float32 parameters, bf16 gradients\n")
    print("| path | s a step | M params/s | s a step at 1.5B | max diff vs torch's |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows, reference = [], None
    for name, run in (("torch's kernels", torch_path), ("compiled step", compiled_path)):
        seconds, params = run(args.params_m, args.device, args.steps)
        n = sum(p.numel() for p in params)
        reference = params if reference is None else reference
        diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
        row = rate_row(n, seconds, diff, path=name, device=args.device)
        rows.append(row)
        print(f"| {name} | {seconds:.4f} | {row['mparams_per_s']:,.0f} | {row['step_s_at_1_5b']:.4f} | {diff:.1e} |")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
