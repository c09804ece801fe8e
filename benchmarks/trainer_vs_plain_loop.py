"""Trainer overhead benchmark: the same model and batch through torchtrain and a hand-written loop.

    python benchmarks/trainer_vs_plain_loop.py [--steps 5] [--warmup 2] [--seq-len 2048] [--device auto]

Reference workload (torchtitan's debug model shape): dim 256, 6 layers, 16 heads, vocab 2048, seq 2048,
local batch 8, fp32, no activation checkpointing, one process. Each side runs in a fresh process
(so neither inherits the other's warmed-up allocator) and is timed after warmup steps. Both sides train the same Llama 3 module
with AdamW; the trainer additionally loads real data (the Python stdlib corpus), clips gradients,
schedules the lr and logs metrics, which is exactly the overhead being measured. Target: the trainer's
tokens/s within 3% of the plain loop's.
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

from torchtrain.config import parse_args
from torchtrain.models.llama3 import LLAMA3_FLAVORS, Transformer
from torchtrain.trainer.trainer import Trainer


def plain_loop(args, device: torch.device) -> list[float]:
    """Seconds per step of a minimal PyTorch training loop on the same shape."""
    torch.manual_seed(0)
    margs = LLAMA3_FLAVORS["debugmodel"].replace(max_seq_len=args.seq_len)
    model = Transformer(margs).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1, fused=True)  # the trainer's kernel
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        tokens = torch.randint(0, margs.vocab_size, (args.batch, args.seq_len + 1), device=device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[args.warmup:]


def trainer_loop(args) -> list[float]:
    """Seconds per step reported by the trainer itself (metrics.jsonl, logged every step)."""
    with tempfile.TemporaryDirectory() as dump:
        cfg = parse_args([
            "--model.flavor", "debugmodel", "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch), "--training.steps", str(args.warmup + args.steps),
            "--training.mixed_precision_param", "float32", "--training.device", args.device,
            "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--job.print_config", "false", "--job.dump_folder", dump,
        ])
        trainer = Trainer(cfg)
        finished = False
        try:
            trainer.train()
            finished = True
        finally:
            trainer.close(finished)
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    return [r["step_time_s"] for r in records[args.warmup:]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--only", choices=["plain", "trainer"], help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if args.only:  # one side, in a fresh process, so neither inherits the other's warm allocator
        print(json.dumps(plain_loop(args, device) if args.only == "plain" else trainer_loop(args)))
        return 0
    tokens = args.batch * args.seq_len
    sides = {}
    for side in ("plain", "trainer"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", side], capture_output=True,
                             text=True, check=True)
        sides[side] = json.loads(out.stdout.strip().splitlines()[-1])
    plain, trainer = sides["plain"], sides["trainer"]
    plain_tps = tokens / statistics.median(plain)
    trainer_tps = tokens / statistics.median(trainer)
    print(f"device {device} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
          f"batch {args.batch} x seq {args.seq_len} | {args.steps} timed steps after {args.warmup} warmup")
    print(f"plain loop : {plain_tps:10,.0f} tokens/s  (median step {statistics.median(plain):.3f} s)")
    print(f"torchtrain : {trainer_tps:10,.0f} tokens/s  (median step {statistics.median(trainer):.3f} s)")
    ratio = trainer_tps / plain_tps
    print(f"ratio      : {ratio:.3f}  ({'within' if ratio >= 0.97 else 'OUTSIDE'} the 3% target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
