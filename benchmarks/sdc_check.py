"""What the silent data corruption check costs: the digest rate of a replica's state, against a copy.

    python benchmarks/sdc_check.py [--params-m 50] [--device cpu|cuda] [--repeats 5]

A check (components/fault/replica_check.py) digests every tensor a rank holds -- its parameters and, by
default, Adam's two moments: 12 bytes a float32 parameter -- then all-gathers 16 bytes a tensor over the
replicas. This measures the digest over `--params-m` million float32 parameters in 4096 x 4096 tensors
(three copies: the parameter and two moments) and, for scale, one `copy_` of the same bytes (a read and a
write of each). The figure is the median of `--repeats` timings after a warm-up. A check's time for
another size is the state's bytes over the digest rate; per step it is that over `fault.sdc_check_freq`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from torchtrain.components.fault.replica_check import digest


def _timed(fn, device: str, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=float, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    n = max(1, round(args.params_m * 1e6 / 4096**2))
    state = [torch.randn(4096, 4096, device=args.device) for _ in range(3 * n)]
    targets = [torch.empty_like(t) for t in state]
    nbytes = sum(t.numel() * t.element_size() for t in state)

    def run_digest():
        torch.stack([digest(t) for t in state]).cpu()

    def run_copy():
        for t, c in zip(state, targets):
            c.copy_(t)

    digest_s, copy_s = _timed(run_digest, args.device, args.repeats), _timed(run_copy, args.device, args.repeats)
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "threads": torch.get_num_threads(), "params_m": n * 4096**2 / 1e6, "state_gb": nbytes / 1e9,
           "digest_s": digest_s, "digest_gb_per_s": nbytes / 1e9 / digest_s, "copy_s": copy_s,
           "digest_over_copy": digest_s / copy_s}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
