"""The fake-backend dry run: `python -m torchtrain.dryrun --world-size N --job.config_file F` (docs/dry_run.md).

Every rank of the world runs in this one process on fake collectives (simulation/dry_run.py)."""

from __future__ import annotations

import sys

from torchtrain.simulation.collective_log import CollectiveMismatch
from torchtrain.simulation.dry_run import DisagreeingRanks, dry_run

USAGE = ("usage: python -m torchtrain.dryrun --world-size N [--ranks R,R,...] [--steps S] [--device cuda|cpu] "
         "[--job.config_file F] [--section.key value ...]")


def _parse(argv: list[str]) -> tuple[int, list[int] | None, int, str, list[str]]:
    from torchtrain.config import ConfigError

    opts = {"--world-size": None, "--ranks": None, "--steps": "2", "--device": "cuda"}
    rest, i = [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in opts:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{flag} needs a value; {USAGE}")
                value, i = argv[i + 1], i + 1
            opts[flag] = value
        else:
            rest.append(argv[i])
        i += 1
    try:
        world = int(opts["--world-size"] or "")
        ranks = None if opts["--ranks"] is None else [int(r) for r in opts["--ranks"].split(",") if r.strip()]
        steps = int(opts["--steps"])
    except ValueError:
        raise ConfigError(USAGE) from None
    if world < 1 or steps < 1 or opts["--device"] not in ("cuda", "cpu"):
        raise ConfigError(USAGE)
    return world, ranks, steps, opts["--device"], rest


def main(argv: list[str] | None = None) -> int:
    import logging
    import warnings

    from torchtrain.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__.split("\n\n")[0] + "\n\n" + USAGE)
        return 0
    logging.getLogger("torchtrain").setLevel(logging.WARNING)  # the trainer's per-rank logs: not here
    warnings.simplefilter("ignore")
    try:
        world, ranks, steps, device, job_argv = _parse(argv)
        result = dry_run(job_argv, world, ranks, device, steps)
    except ConfigError as e:
        print(f"torchtrain: config error: {e}", file=sys.stderr)
        return 2
    except (DisagreeingRanks, CollectiveMismatch) as e:
        print(f"dry run: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"dry run: {result.description}")
    for note in result.notes:
        print(f"  note: {note}")
    for run in result.ranks:
        print("  " + run.summary())
    for line in result.agreement:
        print("  " + line)
    print("dry run: OK (the layout builds, every collective's shapes are consistent, the steps ran)")
    return 0


if __name__ == "__main__":
    from torchtrain.utils.process_exit import exit_process

    exit_process(main())
