"""Logging: the ranks named in LOG_RANK (default 0) log at INFO, every other rank only warnings.

`run_train.sh` also passes LOG_RANK to torchrun's `--local-ranks-filter`, so stray prints of other
ranks are hidden as well (every rank's output is kept in the run folder's `rank_logs/`, launcher.py); set
LOG_RANK=0,1 (or "all") to see more ranks.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("torchtrain")


def log_ranks() -> set[int] | None:
    """Ranks that log at INFO (None = all)."""
    spec = os.environ.get("LOG_RANK", "0").strip()
    if spec.lower() == "all":
        return None
    return {int(r) for r in spec.split(",") if r.strip()}


def is_log_rank(rank: int | None = None) -> bool:
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    ranks = log_ranks()
    return ranks is None or rank in ranks


def init_logger() -> None:
    rank = int(os.environ.get("RANK", 0))
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if is_log_rank(rank) else logging.WARNING)
    logger.propagate = False
