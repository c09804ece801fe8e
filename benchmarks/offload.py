"""Optimizer-state offload on this machine's CPU and disk: RssAnon, seconds per step, bytes moved and
the bandwidth the streamed step achieves against a plain sequential write + read of the same size.

    python benchmarks/offload.py --params-m 64 --steps 5 --folder /path/on/nvme
    python benchmarks/offload.py --mode nvme --json     # one mode, one JSON line (what the tests read)

Each mode runs in a fresh process (so one mode's freed memory is not the next one's), trains an MLP of
`--params-m` million fp32 parameters with AdamW (forward, backward, optimizer step) on random data,
and reports the process's RssAnon (anonymous memory from /proc/self/status: not the page cache that
file I/O fills) after the last step. The losses of every mode are compared bitwise with no offload.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from torchtrain.components.offload.optimizer import StreamedOptimizer  # noqa: E402
from torchtrain.components.offload.store import FileStore, HostStore  # noqa: E402

WIDTH = 1024


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def run_mode(mode: str, params_m: int, steps: int, folder: str, bucket_mb: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH)))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    pool = ThreadPoolExecutor(2)
    store = {"none": None, "cpu": HostStore(), "nvme": FileStore(os.path.join(folder, "state"), keep_bytes=2 * bucket_mb * 2**20)}[mode]
    step_fn = opt.step if store is None else StreamedOptimizer(opt, store, "opt", torch.device("cpu"),
                                                                bucket_mb * 2**20, pool).step
    x = torch.randn(32, WIDTH)
    losses, step_s, opt_s = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        t1 = time.perf_counter()
        step_fn()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        losses.append(loss.item())
        step_s.append(t2 - t0)
        opt_s.append(t2 - t1)
    timed = slice(1, None) if steps > 1 else slice(None)  # the first step allocates the state
    out = {"mode": mode, "params": sum(p.numel() for p in model.parameters()), "rss_anon": rss_anon_bytes(),
           "s_per_step": sum(step_s[timed]) / len(step_s[timed]), "opt_s": sum(opt_s[timed]) / len(opt_s[timed]),
           "losses": losses, "read": getattr(store, "bytes_read", 0), "written": getattr(store, "bytes_written", 0),
           "io_read_s": getattr(store, "read_seconds", 0.0), "io_write_s": getattr(store, "write_seconds", 0.0)}
    if store is not None:
        store.close()
    return out


def disk_baseline(folder: str, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes/s of one plain sequential file of `nbytes`, in 8 MiB chunks."""
    path, chunk = os.path.join(folder, "baseline.bin"), os.urandom(8 * 2**20)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(max(1, nbytes // len(chunk))):
            f.write(chunk)
    t1 = time.perf_counter()
    buf = bytearray(len(chunk))
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    t2 = time.perf_counter()
    size = max(1, nbytes // len(chunk)) * len(chunk)
    os.remove(path)
    return size / (t1 - t0), size / (t2 - t1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=int, default=64, help="million parameters of the MLP")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--folder", default="", help="scratch folder (default: a temporary folder)")
    ap.add_argument("--mode", choices=["none", "cpu", "nvme"], help="run this one mode and print one JSON line")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    folder = a.folder or tempfile.mkdtemp(prefix="offload-bench-")
    if a.mode:
        print(json.dumps(run_mode(a.mode, a.params_m, a.steps, folder, a.bucket_mb)))
        return 0
    runs = {}
    for mode in ("none", "cpu", "nvme"):
        cmd = [sys.executable, __file__, "--mode", mode, "--params-m", str(a.params_m), "--steps", str(a.steps),
               "--bucket-mb", str(a.bucket_mb), "--folder", folder]
        runs[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    base, nv = runs["none"], runs["nvme"]
    state = 8 * base["params"]
    disk_w, disk_r = disk_baseline(folder, state)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}")
    print(f"command: python benchmarks/offload.py --params-m {a.params_m} --steps {a.steps} --bucket-mb {a.bucket_mb}")
    print(f"model: {base['params'] / 1e6:.1f}M fp32 parameters, AdamW state {state / 2**20:.0f} MiB\n")
    print("| optimizer state | RssAnon MiB | s/step | optimizer s/step | read MiB/step | written MiB/step | losses |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in runs.items():
        same = "bitwise equal" if r["losses"] == base["losses"] else "DIFFER"
        print(f"| {mode} | {r['rss_anon'] / 2**20:.0f} | {r['s_per_step']:.3f} | {r['opt_s']:.3f} | "
              f"{r['read'] / a.steps / 2**20:.0f} | {r['written'] / a.steps / 2**20:.0f} | {same} |")
    print(f"\nRssAnon drop with state on nvme: {(base['rss_anon'] - nv['rss_anon']) / 2**20:.0f} MiB "
          f"(state {state / 2**20:.0f} MiB); optimizer step x{nv['opt_s'] / base['opt_s']:.2f}, "
          f"whole step x{nv['s_per_step'] / base['s_per_step']:.2f}")
    rd = nv["read"] / nv["io_read_s"] / 2**20 if nv["io_read_s"] else float("nan")
    wr = nv["written"] / nv["io_write_s"] / 2**20 if nv["io_write_s"] else float("nan")
    print(f"bandwidth of the streamed step's I/O: read {rd:.0f} MiB/s, write {wr:.0f} MiB/s; plain sequential "
          f"file of {state / 2**20:.0f} MiB: read {disk_r / 2**20:.0f} MiB/s, write {disk_w / 2**20:.0f} MiB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
