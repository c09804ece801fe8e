"""The planner: will a job fit, on how many GPUs, how fast, at what cost -- before renting a GPU.

    python -m torchtrain.plan --config JOB.toml [--world-size N] [--gpu h100] [--search] [--json] \\
        [--tp 8 --pp 16 --ac full ...] [--section.key value ...]

Runs on a laptop CPU in one process for any world size. See docs/planner.md and
`torchtrain/tools/planner/` (analytic.py: closed-form memory; trace.py: one real step on fake tensors;
step_time.py: speed and cost from compute_time.py and comm_time.py; search.py: layout search; report.py: tables and JSON).
"""

import sys

from torchtrain.tools.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
