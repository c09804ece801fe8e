"""Cost of the pickle scan (components/checkpoint/safety.py) and of the file hashes
(components/checkpoint/integrity.py) on a ~1 GB DCP checkpoint.

    python benchmarks/checkpoint_scan.py [--gb 1.0] [--params 400] [--folder /tmp/torchtrain-bench-scan]

Writes (once; reused afterwards) a one-process DCP checkpoint shaped like a training state: `--params`
float32 weights totalling `--gb` GB with an Adam-like optimizer state (two moments, a step, and the
per-parameter hyper-parameters DCP stores as byte entries), the schedule's counter, and the loader, RNG
and train states as torchtrain writes them. Then it times, best of 5: the scan alone; hashing every
file (what a save adds, in one process: the ranks of a job share it) and checking them against those
hashes (what a load adds); DCP's own metadata read (what any load does first); and one full `dcp.load`
of the checkpoint, for scale. The page cache is warm after the first pass, as on a resume shortly
after the save.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtrain.components.checkpoint import integrity
from torchtrain.components.checkpoint.safety import scan
from torchtrain.components.checkpoint.state import encode_json


def build(folder: str, gb: float, params: int) -> None:
    if os.path.exists(os.path.join(folder, ".metadata")):
        return
    numel = int(gb * 1e9 / 4 / 3 / params)  # weight + two moments per parameter
    model, state, groups = {}, {}, {}
    for i in range(params):
        name = f"layers.{i // 8}.w{i % 8}"
        model[name] = torch.randn(numel)
        state[f"{name}.exp_avg"] = torch.randn(numel)
        state[f"{name}.exp_avg_sq"] = torch.rand(numel)
        state[f"{name}.step"] = torch.tensor(100.0)
        for key, value in (("lr", 3e-4), ("betas", (0.9, 0.95)), ("eps", 1e-8), ("weight_decay", 0.1),
                           ("amsgrad", False), ("foreach", None), ("maximize", False)):
            groups[f"{name}.{key}"] = value
    dcp.save({"model": model, "optimizer": {"state": state, "param_groups": groups},
              "lr_scheduler": {"last_epoch": 100},
              "dataloader": {"dp_rank_0": encode_json({"samples": 1600, "epochs": [0], "fingerprint": {"seed": 0}})},
              "train_state": {"step": torch.tensor(100), "tokens_seen": torch.tensor(10**8)},
              "rng": {"rank_0": encode_json({"python": [3, list(range(625)), None], "torch": "x" * 6700})}},
             checkpoint_id=folder, no_dist=True)


def best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--params", type=int, default=400)
    ap.add_argument("--folder", default="/tmp/torchtrain-bench-scan")
    args = ap.parse_args()
    build(args.folder, args.gb, args.params)
    size = sum(os.path.getsize(os.path.join(args.folder, n)) for n in os.listdir(args.folder))
    report = scan(args.folder)
    t_scan = best(lambda: scan(args.folder))
    t_meta = best(lambda: FileSystemReader(args.folder).read_metadata())
    md = FileSystemReader(args.folder).read_metadata()
    template = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
                for k, v in md.state_dict_metadata.items()}
    names = integrity.checkpoint_files(args.folder, "complete.json")
    files = integrity.digests(args.folder, names)
    t_hash = best(lambda: integrity.digests(args.folder, names))
    t_verify = best(lambda: integrity.verify(args.folder, files, names))
    t_load = best(lambda: dcp.load(template, checkpoint_id=args.folder, no_dist=True), repeat=2)
    print(f"checkpoint: {size / 1e9:.2f} GB, {len(md.state_dict_metadata)} keys, {report.byte_entries} byte entries, "
          f"{os.path.getsize(os.path.join(args.folder, '.metadata')) / 1e6:.2f} MB of metadata")
    print(f"scan: {t_scan * 1000:.0f} ms ({report.pickles} pickles); DCP metadata read: {t_meta * 1000:.0f} ms; "
          f"full dcp.load: {t_load:.2f} s; the scan adds {100 * t_scan / t_load:.1f}% to the load")
    print(f"{integrity.HASH} of {len(names)} files: {t_hash:.2f} s ({size / t_hash / 1e9:.2f} GB/s) when saved; "
          f"checked: {t_verify:.2f} s, {100 * t_verify / t_load:.1f}% of the load")


if __name__ == "__main__":
    main()
