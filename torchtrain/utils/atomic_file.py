"""Files that readers see either whole or not at all: written to a temporary name beside the target, flushed to
disk, renamed over it, and the folder's entry flushed too (a crash leaves the old file or the new one, never half
of either). Used for what a later run trusts: a checkpoint's completion marker, a prepared dataset's manifest and
shard indexes."""

from __future__ import annotations

import json
import os
from typing import Any


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the file system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, content: Any, indent: int = 2) -> None:
    """`content` as deterministic JSON (sorted keys, a final newline) at `path`, atomically."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(content, f, indent=indent, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")
