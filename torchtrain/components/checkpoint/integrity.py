"""File hashes of a checkpoint: written with it, checked before it is loaded.

Every file of a `step-N` folder (DCP's `.metadata`, each rank's `__R_0.distcp`, an HF export) is hashed
right after the save, and the hashes go into the completion marker (`complete.json`, `"files"`: name ->
bytes and CRC-32). Before a checkpoint is loaded, its files are hashed again and compared: a flipped
byte, a truncated, missing or replaced file is found before DCP reads a wrong value, and the checkpoint
is reported in one line naming the file (`verify` returns it).

Both sides are shared by the ranks: rank r hashes the files `__R_*` with R % world_size == r (its own
files when the world size is the same) and every other file whose position in the sorted list is r
modulo the world size, so the read is spread over all ranks, and the results are all-gathered.

CRC-32 (zlib, standard library): about 5.5 GB/s on one core of the development machine, against
0.9-2.1 GB/s for MD5, SHA-1, SHA-256 and BLAKE2b; it finds every burst error up to 32 bits and other
random corruption with probability 1 - 2^-32. Reading the files back dominates: they were just written
(page cache) on save, and DCP reads them anyway on load. The hash protects against accidental changes
after the save (bit rot, a truncated copy, a flipped byte), not against a deliberate edit.

A checkpoint written before this (no `"files"` in its marker) loads unverified, with a log line.
"""

from __future__ import annotations

import os
import re
import zlib
from typing import Any

HASH = "crc32"
_CHUNK = 8 << 20
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def checkpoint_files(path: str, marker: str) -> list[str]:
    """Every file of the checkpoint folder, relative and sorted, without the marker (and its temporaries)."""
    found = []
    for folder, _, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), path)
            if rel != marker and not rel.startswith(marker + ".tmp"):
                found.append(rel)
    return sorted(found)


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files of `names` (sorted) that `rank` hashes (see the module docstring)."""
    mine = []
    for i, name in enumerate(names):
        match = _RANK_FILE.match(os.path.basename(name))
        owner = int(match.group(1)) if match else i
        if owner % world_size == rank:
            mine.append(name)
    return mine


def file_digest(path: str, buffer: bytearray | None = None) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of one file."""
    buffer = buffer if buffer is not None else bytearray(_CHUNK)
    view = memoryview(buffer)
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, f"{crc:08x}"


def digests(path: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """name -> {"bytes": size, "crc32": hex} for these files of the checkpoint `path`."""
    buffer = bytearray(_CHUNK)
    out = {}
    for name in names:
        size, crc = file_digest(os.path.join(path, name), buffer)
        out[name] = {"bytes": size, HASH: crc}
    return out


def verify(path: str, files: dict[str, dict[str, Any]], names: list[str]) -> str | None:
    """The first of `names` whose file differs from its record in `files`, as one line; None when all
    match."""
    buffer = bytearray(_CHUNK)
    for name in names:
        want = files[name]
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        size = os.path.getsize(full)
        if size != want["bytes"]:
            what = "truncated" if size < want["bytes"] else "longer than written"
            return f"{name} has {size} bytes, {want['bytes']} were written ({what})"
        _, crc = file_digest(full, buffer)
        if crc != want[HASH]:
            return f"{name} has {HASH} {crc}, {want[HASH]} was written (its content changed since the save)"
    return None
