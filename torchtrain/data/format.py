"""The prepared token format: flat token shards, document offsets, a JSON manifest (docs/data.md).

A prepared dataset is a folder::

    manifest.json          what the folder holds (written last: without it the folder is not a dataset)
    shard-00000.bin        tokens, little-endian uint16 (vocabulary <= 65,536) or uint32, no header
    shard-00000.idx        document start offsets into the shard, little-endian uint64: one per
                           document, then the shard's token count (documents + 1 values)
    shard-00000.json       the shard's record (written after its .bin and .idx: a shard without it is
                           incomplete and is prepared again)
    problems.jsonl         bad input found while preparing (file, line, reason), one JSON object a line

Chat data (`prepare --chat`, `data/chat/token_store.py`) is the same format, one document per conversation,
plus `shard-00000.mask` (uint8 per token: 1 where the loss trains on it) and a `chat` entry in the
manifest.

Each document is stored as the tokenizer's output with BOS (when the tokenizer has one) and EOS, so the
concatenation of every shard in manifest order is the token stream the trainer cuts into windows.
Everything is plain numpy-readable (`np.memmap(path, dtype="<u2")`), so other tools can write it.

This module writes one shard (`ShardWriter`, atomically) and reads a whole dataset (`TokenCorpus`,
by memory map, without holding an index of the corpus in Python objects). It imports neither torch
nor the rest of torchtrain's heavy modules, so preparation workers start fast.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from typing import Any

import numpy as np

from torchtrain.utils.atomic_file import write_json_atomic

FORMAT = "torchtrain.tokens"
VERSION = 1
MANIFEST = "manifest.json"
PROBLEMS = "problems.jsonl"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_OFFSETS = np.dtype("<u8")
MASK_DTYPE = np.dtype("u1")
# A page fault on a file mapping maps the pages around it too (Linux "fault-around", 64 KiB): release
# whole aligned 64 KiB blocks so those neighbours leave the resident set as well.
_RELEASE = max(mmap.PAGESIZE, 64 << 10)


def token_dtype(vocab_size: int) -> str:
    """uint16 when every token id fits (vocab_size <= 65,536), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def read_json(path: str) -> Any | None:
    """The JSON at `path`, or None when it is missing or unreadable (an interrupted write)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class ShardWriter:
    """Writes one shard: documents are appended, `close()` makes it complete.

    The .bin and .idx are written under temporary names and renamed, then the shard's record (.json)
    is written atomically: a run killed at any point leaves no shard that reads as complete."""

    def __init__(self, folder: str, index: int, dtype: str):
        self.base = os.path.join(folder, shard_name(index))
        self.dtype = _DTYPES[dtype]
        self._tmp = f".tmp-{os.getpid()}"  # unique: processes preparing the same folder never share a file
        self._bin = open(f"{self.base}.bin{self._tmp}", "wb")
        self._hash = hashlib.sha256()
        self.offsets = [0]
        self.tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        """Append one document (its tokens, BOS/EOS included)."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._bin.write(data)
        self._hash.update(data)
        self.tokens += len(tokens)
        self.offsets.append(self.tokens)

    @property
    def documents(self) -> int:
        return len(self.offsets) - 1

    def mark(self) -> tuple:
        """The writer's position, for `rollback`."""
        return self._bin.tell(), len(self.offsets), self.tokens, self._hash.copy()

    def rollback(self, mark: tuple) -> None:
        """Drop every document added since `mark` (an input that broke off partway)."""
        position, offsets, self.tokens, self._hash = mark
        self._bin.seek(position)
        self._bin.truncate()
        del self.offsets[offsets:]

    def close(self, record: dict[str, Any]) -> dict[str, Any]:
        """Finish the shard; `record` (its provenance) is stored with its counts and checksum."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        idx = np.asarray(self.offsets, dtype=_OFFSETS).tobytes()
        with open(f"{self.base}.idx{self._tmp}", "wb") as f:
            f.write(idx)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f"{self.base}.bin{self._tmp}", f"{self.base}.bin")
        os.replace(f"{self.base}.idx{self._tmp}", f"{self.base}.idx")
        record = dict(record, name=os.path.basename(self.base), tokens=self.tokens, documents=self.documents,
                      sha256=self._hash.hexdigest())
        write_json_atomic(f"{self.base}.json", record, indent=1)
        return record

    def abort(self) -> None:
        self._bin.close()
        for suffix in (".bin", ".idx"):
            if os.path.exists(self.base + suffix + self._tmp):
                os.remove(self.base + suffix + self._tmp)


def shard_is_complete(folder: str, record: dict[str, Any], dtype: str) -> bool:
    """A shard counts as done when its record exists and its files have the recorded sizes."""
    base = os.path.join(folder, record["name"])
    try:
        return (os.path.getsize(f"{base}.bin") == record["tokens"] * _DTYPES[dtype].itemsize
                and os.path.getsize(f"{base}.idx") == (record["documents"] + 1) * _OFFSETS.itemsize)
    except OSError:
        return False


class FormatError(ValueError):
    """A folder that is not a complete prepared dataset (the message says what is wrong)."""


class TokenCorpus:
    """A prepared dataset read by memory map: random access to its token stream and documents.

    Memory: one small array of shard boundaries; shards are mapped lazily (per process, so the
    object can be sent to loader workers) and the pages a read touched are released again, so the
    resident memory stays small whatever the corpus size."""

    def __init__(self, folder: str):
        self.folder = folder
        if not os.path.isdir(folder):
            raise FormatError(f"{folder}: no such folder (prepare one with `python -m torchtrain.data.prepare ... "
                              f"--out {folder}`)")
        manifest = read_json(os.path.join(folder, MANIFEST))
        if manifest is None:
            raise FormatError(f"{folder} has no readable {MANIFEST}: not a prepared dataset, or its preparation "
                              f"failed or did not finish (run `python -m torchtrain.data.prepare ... --out {folder}`)")
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise FormatError(f"{folder}/{MANIFEST} is not a {FORMAT} v{VERSION} manifest")
        self.manifest = manifest
        try:
            self.dtype = _DTYPES[manifest["dtype"]]
            self.tokenizer: dict[str, Any] = dict(manifest["tokenizer"])
            shards = [(str(s["name"]), int(s["tokens"]), int(s["documents"])) for s in manifest["shards"]]
            self.num_documents = int(manifest["num_documents"])
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{folder}/{MANIFEST} has a missing or malformed field ({type(e).__name__}: {e}): the "
                              f"dataset is damaged; prepare it again") from None
        bad = next((n for n, t, d in shards if os.path.basename(n) != n or n in ("", ".", "..") or t < 0 or d < 0), None)
        if bad is not None:
            raise FormatError(f"{folder}/{MANIFEST} lists a shard {bad!r} that is not a file of the folder with "
                              f"non-negative counts: the dataset is damaged; prepare it again")
        self.shards = [name for name, _, _ in shards]
        counts = [tokens for _, tokens, _ in shards]
        self.bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self.num_tokens = int(self.bounds[-1])
        totals = {"num_documents": (self.num_documents, sum(d for _, _, d in shards)),
                  "num_tokens": (manifest.get("num_tokens", self.num_tokens), self.num_tokens)}
        for key, (said, summed) in totals.items():
            if said != summed:
                raise FormatError(f"{folder}/{MANIFEST} says {key} = {said!r}, but its shards hold {summed}: the "
                                  f"dataset is damaged; prepare it again")
        if self.num_tokens == 0:
            raise FormatError(f"{folder} holds no documents: its preparation found no usable text (see "
                              f"{os.path.join(folder, PROBLEMS)}); fix the input and prepare it again")
        for name, tokens, documents in shards:  # sizes only: a stat per file, no data read
            expected = (("bin", tokens, self.dtype.itemsize, f"{manifest['dtype']} tokens"),
                        ("idx", documents + 1, _OFFSETS.itemsize, "document offsets"))
            for kind, count, itemsize, what in expected:
                path = os.path.join(folder, f"{name}.{kind}")
                size = os.path.getsize(path) if os.path.exists(path) else -1
                if size != count * itemsize:
                    state = "is missing" if size < 0 else f"has {size} bytes"
                    raise FormatError(f"{path} {state}, but the manifest says {count} {what} "
                                      f"({count * itemsize} bytes): the dataset is damaged (a truncated copy?); "
                                      f"copy or prepare it again")
        self._maps: dict[tuple[int, str], tuple[mmap.mmap, np.ndarray]] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def _array(self, shard: int, kind: str) -> tuple[mmap.mmap, np.ndarray]:
        if self._pid != os.getpid():  # a forked loader worker: map the files again in this process
            self._maps, self._pid = {}, os.getpid()
        key = (shard, kind)
        if key not in self._maps:
            path = os.path.join(self.folder, f"{self.shards[shard]}.{kind}")
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
            dtype = {"bin": self.dtype, "idx": _OFFSETS, "mask": MASK_DTYPE}[kind]
            arr = np.frombuffer(mm, dtype=dtype) if mm is not None else np.zeros(0, dtype=dtype)
            if mm is not None and hasattr(mmap, "MADV_RANDOM"):
                mm.madvise(mmap.MADV_RANDOM)
            self._maps[key] = (mm, arr)
        return self._maps[key]

    def _release(self, mm: mmap.mmap | None, start_byte: int, end_byte: int) -> None:
        """Drop the pages of [start_byte, end_byte) from this process's resident set (they stay in
        the OS page cache): a long run touches every page of a corpus, which would otherwise all count
        as this process's memory."""
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo = start_byte // _RELEASE * _RELEASE
        hi = min(len(mm), -(-end_byte // _RELEASE) * _RELEASE)
        if hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _shard_of(self, offset: int) -> int:
        return int(np.searchsorted(self.bounds, offset, side="right")) - 1

    def array(self, shard: int, kind: str) -> np.ndarray:
        """The whole memory-mapped array of one shard's file: "bin" (tokens), "idx" (document offsets)
        or "mask" (chat data's per-token trained flags)."""
        return self._array(shard, kind)[1]

    def read(self, start: int, length: int, kind: str = "bin") -> np.ndarray:
        """Tokens [start, start + length) of the stream (int64), across shard boundaries; with kind
        "mask", chat data's trained flags of those tokens."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside the stream of {self.num_tokens}")
        out = np.empty(length, dtype=np.int64)
        done = 0
        while done < length:
            shard = self._shard_of(start + done)
            local = start + done - int(self.bounds[shard])
            take = min(length - done, int(self.bounds[shard + 1]) - (start + done))
            mm, arr = self._array(shard, kind)
            out[done:done + take] = arr[local:local + take]
            self._release(mm, local * arr.itemsize, (local + take) * arr.itemsize)
            done += take
        return out

    def positions(self, start: int, length: int) -> np.ndarray:
        """For tokens [start, start + length): each token's position in its document (0 at every
        document start, counting up), int64."""
        pos = np.empty(length, dtype=np.int64)
        done = 0
        while done < length:
            shard = self._shard_of(start + done)
            base = int(self.bounds[shard])
            local = start + done - base
            take = min(length - done, int(self.bounds[shard + 1]) - (start + done))
            mm, offsets = self._array(shard, "idx")
            lo = int(np.searchsorted(offsets, local, side="right")) - 1  # the document holding `local`
            hi = int(np.searchsorted(offsets, local + take, side="left"))
            starts = np.asarray(offsets[lo:hi], dtype=np.int64)  # document starts up to the range's end
            self._release(mm, lo * _OFFSETS.itemsize, hi * _OFFSETS.itemsize)
            idx = np.arange(local, local + take, dtype=np.int64)
            pos[done:done + take] = idx - starts[np.searchsorted(starts, idx, side="right") - 1]
            done += take
        return pos


def tokenizer_matches(stored: dict[str, Any], job: dict[str, Any]) -> bool:
    """The same tokenizer: identical file hash (or kind, for the built-in one) and special tokens."""
    keys = ("kind", "sha256", "vocab_size", "bos_id", "eos_id")
    return all(stored.get(k) == job.get(k) for k in keys)
