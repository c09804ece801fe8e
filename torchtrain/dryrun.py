"""The fake-backend dry run's entry point: `python -m torchtrain.dryrun --world-size N --job.config_file F`
(tools/dryrun.py, docs/dry_run.md)."""

from torchtrain.tools.dryrun import main

if __name__ == "__main__":
    raise SystemExit(main())
