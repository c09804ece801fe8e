"""Check a job once, before a launcher starts any training process.

    python -m torchtrain.launch_check --nproc-per-node 8 --nnodes 2 --job.config_file JOB.toml [--section.key value ...]

`run_train.sh` and `scripts/multinode_trainer.slurm` run this before `torchrun`. In this one process,
without a process group, it parses the job and runs the trainer's own start-up checks
(`preflight.check_job`) for world size = processes per node x nodes on this machine's device type. A
bad job prints `torchtrain: config error: ...` once and exits 2 -- instead of once per rank, after
torchrun's wait on the other ranks, under torchrun's own traceback. A good job exits 0 and prints
only the number of processes per node (`--nproc-per-node auto`: every visible GPU, or 1 without
one; run_train.sh reads it, saving a second Python start). The trainer repeats the checks on every
rank, so a direct `torchrun` launch is checked too.

The data are checked too, cheaply (`preflight.check_data`: manifests and shard sizes, no tokens read):
a missing, unprepared or truncated token folder, or a bad mixture, ends here as well. So does a `python` without
the project's dependencies (an environment not activated): one line naming the missing module, exit 2.

`--nnodes MIN:MAX` (an elastic range) leaves the world size open: then the job file, the overrides
and the data are checked here, the layout by the trainer once the world is known.

`--print SECTION.KEY` prints that key's value in the resolved job instead of the number of processes (an empty
line for an unset key): a batch script reads the job's own setting rather than repeating it
(`scripts/multinode_trainer.slurm` reads `fault.sdc_exclude_file` so that a requeue leaves out the hosts it lists).
"""

from __future__ import annotations

import logging
import sys
import warnings

from torchtrain.config import ConfigError
from torchtrain.utils.environment import missing_module_line

USAGE = ("usage: python -m torchtrain.launch_check --nproc-per-node N|auto [--nnodes M] [--print SECTION.KEY] "
         "[trainer arguments ...]")


def _positive(flag: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{flag} {value!r}: expected a positive number of processes / nodes")
    return n


def local_devices() -> int:
    """Processes per node for `auto`: the visible GPUs, or 1 without a GPU."""
    import torch

    return max(1, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def parse_launch(argv: list[str]) -> tuple[int, int | None, str | None, list[str]]:
    """(processes per node, nodes or None for an elastic range, the key to print or None, the trainer's arguments)."""
    nproc, nnodes, key, i = None, "1", None, 0
    while i < len(argv) and argv[i] in ("--nproc-per-node", "--nnodes", "--print"):
        if i + 1 >= len(argv):
            raise ConfigError(f"{argv[i]} needs a value; {USAGE}")
        if argv[i] == "--nproc-per-node":
            value = argv[i + 1]
            nproc = local_devices() if value == "auto" else _positive("--nproc-per-node", value)
        elif argv[i] == "--print":
            key = argv[i + 1]
        else:
            nnodes = argv[i + 1]
        i += 2
    if nproc is None:
        raise ConfigError(USAGE)
    nodes = None if ":" in nnodes else _positive("--nnodes", nnodes)
    return nproc, nodes, key, argv[i:]


def key_value(cfg, key: str) -> str:
    """`SECTION.KEY`'s value in the resolved job, as printed by `--print` (empty for None)."""
    from torchtrain.config import job_value

    try:
        value = job_value(cfg, key)
    except ConfigError as e:
        raise ConfigError(f"--print {e}") from None
    return "" if value is None else str(value)


def check(argv: list[str]) -> int | str:
    """The processes per node (or, with `--print`, the key's value); ConfigError when the job cannot start."""
    from torchtrain.config import parse_args
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.distributed.utils import resolve_device_type
    from torchtrain.trainer.preflight import check_data, check_job

    nproc, nodes, key, job_argv = parse_launch(argv)
    if "-h" in job_argv or "--help" in job_argv:
        return nproc  # the trainer prints the help
    cfg = parse_args(job_argv)
    if nodes is not None:
        check_job(cfg, nproc * nodes, resolve_device_type(cfg.training.device))
    else:
        check_data(cfg, build_tokenizer(cfg.model.hf_assets_path))
    return key_value(cfg, key) if key else nproc


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("torchtrain").setLevel(logging.ERROR)  # the trainer logs; this only gates the launch
    warnings.simplefilter("ignore")
    try:
        print(check(sys.argv[1:] if argv is None else argv))  # the ranks per node the launch starts
    except ConfigError as e:
        print(f"torchtrain: config error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # this Python lacks the project's dependencies: another environment's `python`
        print(missing_module_line((e.name or "?").split(".")[0]), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from torchtrain.utils.process_exit import exit_process

    exit_process(main())
