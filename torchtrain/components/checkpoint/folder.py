"""The checkpoint folder on disk: `step-N` sub-folders, the completion marker, discovery and purging.

A checkpoint is the folder `{folder}/step-N`, written by torch.distributed.checkpoint (one
`__R_0.distcp` file per rank plus `.metadata`), and it counts only once it holds `complete.json`,
the marker that rank 0 writes *last*, after every rank's files are written (`dcp.save` returns on
rank 0 only after all ranks' writes and the metadata are done, and the writer fsyncs each file). The
marker is itself written atomically (temporary file, fsync, rename), so a folder without it is an
interrupted save, whatever else it holds.

Deleting is the reverse: a folder is first renamed out of the `step-N` namespace (atomic), then
removed, so a crash in the middle of a deletion never leaves a `step-N` that looks complete but is
missing files. Old checkpoints are deleted only after a newer one is complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

from torchtrain.config.checkpoint import CHECKPOINT_KEYS
from torchtrain.utils.atomic_file import fsync_dir, write_json_atomic

MARKER = "complete.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Keys that make a checkpoint a resume point (a model-only one is an export or a seed).
FULL_STATE = frozenset(CHECKPOINT_KEYS) - {"rng", "reference"}  # (a preference loss's reference: only [dpo] jobs)


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


@dataclass
class CheckpointInfo:
    """One `step-N` folder: complete (marker present and valid) or not, with the marker's content."""

    step: int
    path: str
    complete: bool
    meta: dict[str, Any] = field(default_factory=dict)
    problem: str = ""  # why it is not complete

    @property
    def contents(self) -> set[str]:
        return set(self.meta.get("contents", []))

    @property
    def full_state(self) -> bool:
        return FULL_STATE <= self.contents


def read_marker(path: str) -> tuple[dict[str, Any] | None, str]:
    """(marker content, "") for a complete checkpoint folder, else (None, the reason)."""
    marker = os.path.join(path, MARKER)
    if not os.path.exists(marker):
        return None, f"no {MARKER} (an interrupted save?)"
    try:
        with open(marker) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"unreadable {MARKER}: {e}"
    if not isinstance(meta, dict) or meta.get("complete") is not True:
        return None, f"{MARKER} does not mark the checkpoint complete"
    return meta, ""


def scan(folder: str) -> list[CheckpointInfo]:
    """Every `step-N` folder under `folder`, complete or not, sorted by step (empty if no folder)."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        path = os.path.join(folder, name)
        if not match or not os.path.isdir(path):
            continue
        meta, problem = read_marker(path)
        found.append(CheckpointInfo(int(match.group(1)), path, meta is not None, meta or {}, problem))
    return sorted(found, key=lambda c: c.step)


def write_marker(path: str, meta: dict[str, Any]) -> None:
    write_json_atomic(os.path.join(path, MARKER), {**meta, "complete": True})


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint folder: rename it out of the step-N namespace first (atomic), then remove."""
    if not os.path.exists(path):
        return
    parent, name = os.path.split(path.rstrip(os.sep))
    doomed = os.path.join(parent, f".deleting-{name}-{os.getpid()}")
    os.replace(path, doomed)
    fsync_dir(parent)
    shutil.rmtree(doomed, ignore_errors=True)


def purge(folder: str, keep_latest_k: int, newest_complete: int, corrupt: set[str] | frozenset = frozenset()
          ) -> list[str]:
    """After step `newest_complete` completed: delete good checkpoints beyond the newest k (k = 0 keeps all)
    and interrupted saves older than it. `corrupt` checkpoints (found so by their file hashes) are neither
    counted nor deleted, so bad or incomplete newer checkpoints never cost the newest good one. Returns the
    deleted paths."""
    removed = []
    found = scan(folder)
    good = [c for c in found if c.complete and c.path not in corrupt]
    if keep_latest_k > 0:
        for c in good[:-keep_latest_k]:
            remove_checkpoint(c.path)
            removed.append(c.path)
    for c in found:
        if not c.complete and c.step < newest_complete:
            remove_checkpoint(c.path)
            removed.append(c.path)
    # Leftovers of a deletion interrupted by a crash.
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.startswith(".deleting-"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return removed
