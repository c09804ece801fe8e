"""A GRPO run's timeline (`posttrain/timeline.py`): when the trainer waited for rollouts, synced, trained, and when
they were sampled.

    python -m torchtrain.tools.rollout_timeline RUN_FOLDER [--iterations K] [--first N] [--width W]

RUN_FOLDER is the job's dump folder (it holds rollout_timeline.jsonl); the run's last K iterations are drawn, or K
from the N-th.
"""

from __future__ import annotations

import argparse
import os
import sys

from torchtrain.posttrain.timeline import FILE, read, render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtrain.tools.rollout_timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the GRPO job's dump folder (or its rollout_timeline.jsonl)")
    parser.add_argument("--first", type=int, default=None, help="the first iteration drawn (default: the run's "
                                                                "last iterations)")
    parser.add_argument("--iterations", type=int, default=4, help="how many iterations to draw")
    parser.add_argument("--width", type=int, default=96, help="columns of the picture")
    args = parser.parse_args(argv)
    path = os.path.join(args.run, FILE) if os.path.isdir(args.run) else args.run
    if not os.path.exists(path):
        print(f"rollout_timeline: {path} does not exist (a GRPO run writes it into its dump folder)", file=sys.stderr)
        return 2
    its = read(path)  # K iterations, and the next one's start: where the K-th's training ends
    its = its[-args.iterations - 1:] if args.first is None else \
        [it for it in its if it.iteration >= args.first][:args.iterations + 1]
    if len(its) < 2:
        print(f"rollout_timeline: {path} has fewer than 2 iterations" + (f" from {args.first}" if args.first else ""),
              file=sys.stderr)
        return 2
    print(render(its, args.width))
    return 0


if __name__ == "__main__":
    sys.exit(main())
