"""Under torchrun (or alone for one process): several trainer runs, one after another, in one process group.

    python -m torchtrain.launcher --nproc_per_node=N tests/scripts/parity_runs.py RUNS.json

RUNS.json is a list of trainer argument lists (each with its own --job.dump_folder). Every run is a fresh
Trainer on the same ranks; the process group stays up between runs (Trainer.close would tear it down, so
it is kept until the last run), Dynamo's caches are reset so a compiled run compiles (and reports) its
own graphs, and rank 0's stdout/stderr of a run go to DUMP/launch.log so every run has its own log (another
rank's to DUMP.rankN.log). A failing run stops the script with its error, like a separate launch would.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from torchtrain.config import parse_args
from torchtrain.trainer.trainer import Trainer
from torchtrain.utils.logging import init_logger
from torchtrain.utils.process_exit import exit_process


def dump_folder(argv: list[str]) -> str:
    return argv[len(argv) - 1 - argv[::-1].index("--job.dump_folder") + 1]


def rank_log(folder: str, rank: int) -> str:
    """Where rank `rank` (> 0) of the run dumping into `folder` writes its output."""
    return f"{folder.rstrip(os.sep)}.rank{rank}.log"


def run(argv: list[str]) -> None:
    torch._dynamo.reset()
    trainer = Trainer(parse_args(argv))
    try:
        trainer.train()
    finally:
        trainer.close(finished=False)


def main() -> int:
    runs = json.load(open(sys.argv[1]))
    rank = int(os.environ.get("RANK", "0"))
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # kept for the next run
    init_logger()
    saved = os.dup(1), os.dup(2)
    try:
        for argv in runs:
            folder = dump_folder(argv)
            os.makedirs(folder, exist_ok=True)
            sys.stdout.flush(), sys.stderr.flush()
            # rank 0's output is the run's log; another rank's (quiet unless it fails: a native abort's message
            # too) goes beside the dump folder, where run_together shows it when the launch fails
            log = os.open(os.path.join(folder, "launch.log") if rank == 0 else rank_log(folder, rank),
                          os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1), os.dup2(log, 2)
            os.close(log)
            try:
                run(argv)
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            if dist.is_initialized():
                dist.barrier()
            print(f"PARITY-RUN-DONE {folder}", flush=True)
    finally:
        dist.destroy_process_group = destroy
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
