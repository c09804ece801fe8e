"""The pickle scan: a DCP folder is read by a restricted unpickler before torch touches it.

torch.distributed.checkpoint unpickles its `.metadata` and `torch.load`s every byte entry (a
non-tensor value: an int, a string, a pickled blob) with `weights_only=False`, so a crafted folder runs
its code the moment it is loaded. `scan(path)` reads every pickle of the folder first:

* `.metadata`, with an unpickler whose `find_class` allows exactly the classes DCP's metadata is made
  of (`METADATA_CLASSES`: its dataclasses, torch.Size, dtypes, layouts, paths);
* every byte entry, found through the metadata (its `BytesStorageMetadata` keys and their file, offset
  and length in `storage_data`): a `torch.save` archive whose `data.pkl` may hold plain values and the
  few classes a saved object needs (`ENTRY_CLASSES`);
* inside those, the pickled blobs of checkpoints written before torchtrain stored its own state as
  tensors (`dataloader.dp_rank_*`, `rng.rank_*`), with builtins only (`LEGACY_CLASSES`).

Anything else is refused with one line naming the file, the key and the class, and nothing of the
folder has run: `find_class` is the only way a pickle reaches a callable, and it raises first.
`safe_loads` reads a legacy blob with the same rules when it is restored.
"""

from __future__ import annotations

import io
import os
import pickle
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from torchtrain.config.fields import ConfigError

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
METADATA_CLASSES = frozenset({
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"), (_DCP, "MetadataIndex"),
    (_DCP, "StorageMeta"), (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
})
# A byte entry is `torch.save(value)`: plain values, bytes (pickled as _codecs.encode under protocol 2),
# a BytesIO (torchtitan's train state), containers, tensors (rebuilt from a storage reference).
ENTRY_CLASSES = frozenset({
    ("_codecs", "encode"), ("_io", "BytesIO"), ("collections", "OrderedDict"), ("builtins", "set"),
    ("builtins", "frozenset"), ("torch._utils", "_rebuild_tensor_v2"), ("torch", "Size"),
})
LEGACY_CLASSES = frozenset({("_codecs", "encode"), ("builtins", "set"), ("builtins", "frozenset")})
# the keys whose values torchtrain unpickled itself before it stored them as tensors
LEGACY_BLOB_PREFIXES = ("dataloader.", "rng.")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked: missing, incomplete, corrupt, incompatible or unsafe."""


def failure_line(error: BaseException, rank: int) -> str:
    """One line for a failed DCP call: every rank's failure where DCP gathered them (its
    `CheckpointException`, a BaseException that every rank raises alike), else this rank's own error."""
    def one(e: BaseException) -> str:
        return f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"

    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {r}: {one(e)}" for r, (e, _) in sorted(error.failures.items()))
    return f"rank {rank}: {one(error)}"


class RefusedPickle(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _is_storage(module: str, name: str) -> bool:
    return module in ("torch", "torch.storage") and name.endswith("Storage") and "." not in name


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the (module, name) pairs in `allowed` (and torch dtypes).
    `stub_calls`: allowed callables that would build from data the scan does not read (tensors) are
    replaced by a function returning None: the scan checks names, it does not rebuild tensors."""

    def __init__(self, data: bytes, allowed: frozenset, stub_calls: bool = False):
        super().__init__(io.BytesIO(data))
        self.allowed, self.stub_calls = allowed, stub_calls
        self.seen: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        storage = self.stub_calls and _is_storage(module, name)
        if (module, name) not in self.allowed and not _is_dtype(module, name) and not storage:
            raise RefusedPickle(module, name)
        self.seen.add(f"{module}.{name}")
        if storage or (self.stub_calls and (module, name) == ("torch._utils", "_rebuild_tensor_v2")):
            return _stub
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> None:  # a tensor's storage in a torch.save archive
        return None


def _stub(*args: Any, **kwargs: Any) -> None:
    return None


def safe_loads(data: bytes, allowed: frozenset = LEGACY_CLASSES, *, source: str = "pickle") -> Any:
    """Unpickle `data` allowing only `allowed`; a CheckpointError naming `source` and the class otherwise."""
    try:
        return RestrictedUnpickler(data, allowed).load()
    except RefusedPickle as e:
        raise CheckpointError(_refusal(source, e)) from None


def _refusal(source: str, e: RefusedPickle) -> str:
    # the names come from the file: escaped, so that a damaged one (a newline, say) stays on the one line
    imported = f"{e.module}.{e.name}".encode("unicode_escape").decode("ascii")
    return (f"[checkpoint] {source} holds a pickle that imports {imported}, which no checkpoint "
            f"needs: refused before loading (loading it could run code from the folder)")


@dataclass
class ScanReport:
    """What `scan` read: the metadata (safely unpickled), the number of pickles and byte entries, and
    every class they import."""

    path: str
    metadata: Any = None
    pickles: int = 0
    byte_entries: int = 0
    classes: set[str] = field(default_factory=set)
    seconds: float = 0.0

    def describe(self) -> str:
        return (f"{self.path}: {self.pickles} pickles ({METADATA} and {self.byte_entries} byte entries) read in "
                f"{self.seconds * 1000:.0f} ms; classes: {', '.join(sorted(self.classes)) or 'none'}")


def scan(path: str, label: str = "checkpoint") -> ScanReport:
    """Read every pickle of the DCP folder `path` with the restricted unpickler (see the module
    docstring); CheckpointError (one line) on anything else, on a missing or truncated file."""
    t0 = time.perf_counter()
    report = ScanReport(path)
    meta_file = os.path.join(path, METADATA)
    where = f"{label}: {meta_file}"
    try:
        with open(meta_file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"[checkpoint] {label} ({path}): {METADATA} cannot be read: {e.strerror or e}") from None
    unpickler = RestrictedUnpickler(data, METADATA_CLASSES)
    try:
        metadata = unpickler.load()
    except RefusedPickle as e:
        raise CheckpointError(_refusal(where, e)) from None
    except Exception as e:  # truncated, not a pickle, wrong shape
        raise CheckpointError(f"[checkpoint] {label} ({path}): {METADATA} is unreadable ({type(e).__name__}: {e}); "
                              f"the checkpoint is corrupt or truncated") from None
    report.metadata, report.pickles = metadata, 1
    report.classes |= unpickler.seen
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"[checkpoint] {where} is not DCP metadata (no state_dict_metadata/storage_data)")
    files: dict[str, Any] = {}
    try:
        for index, info in sorted(storage.items(), key=lambda kv: (str(kv[1].relative_path), int(kv[1].offset))):
            entry = entries.get(index.fqn)
            if type(entry).__name__ != "BytesStorageMetadata":
                continue
            _scan_entry(path, label, index.fqn, info, files, report)
    except CheckpointError:
        raise
    except Exception as e:  # entries of the wrong shape (made only of allowed classes, but not DCP's layout)
        raise CheckpointError(f"[checkpoint] {where} is malformed DCP metadata ({type(e).__name__}: {e})") from None
    finally:
        for f in files.values():
            f.close()
    report.seconds = time.perf_counter() - t0
    return report


def _scan_entry(path: str, label: str, key: str, info: Any, files: dict, report: ScanReport) -> None:
    name = str(info.relative_path)
    where = f"{label}: {os.path.join(path, name)} (key {key!r})"
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"[checkpoint] {where} is stored through a stream transform "
                              f"({', '.join(info.transform_descriptors)}) that the scan cannot read: refused")
    full = os.path.normpath(os.path.join(path, name))
    if os.path.dirname(full) != os.path.normpath(path):
        raise CheckpointError(f"[checkpoint] {where}: the data file lies outside the checkpoint folder: refused")
    if name not in files:
        try:
            files[name] = open(full, "rb")
        except OSError as e:
            raise CheckpointError(f"[checkpoint] {label} ({path}): data file {name} is missing or unreadable "
                                  f"({e.strerror or e}; needed for key {key!r}); the checkpoint copy is incomplete"
                                  ) from None
    f = files[name]
    f.seek(int(info.offset))
    raw = f.read(int(info.length))
    if len(raw) != int(info.length):
        raise CheckpointError(f"[checkpoint] {label} ({path}): data file {name} is truncated (key {key!r} needs bytes "
                              f"{info.offset}..{info.offset + info.length}); the checkpoint is corrupt")
    report.byte_entries += 1
    value = None
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        pickles = [n for n in archive.namelist() if n.endswith(".pkl")]
    except zipfile.BadZipFile:
        raise CheckpointError(f"[checkpoint] {where} is not a torch.save archive: it cannot be checked, so it is "
                              f"refused") from None
    for member in pickles:
        loaded = _checked_load(RestrictedUnpickler(archive.read(member), ENTRY_CLASSES, stub_calls=True), where,
                               report)
        if member.endswith("data.pkl"):
            value = loaded
    if isinstance(value, bytes) and key.startswith(LEGACY_BLOB_PREFIXES) and value[:1] == b"\x80":
        _checked_load(RestrictedUnpickler(value, LEGACY_CLASSES), f"{where}: its pickled state", report)


def _checked_load(unpickler: "RestrictedUnpickler", where: str, report: ScanReport) -> Any:
    """Unpickle through the allow-list; a refused class or an unreadable pickle is one line naming `where`."""
    try:
        loaded = unpickler.load()
    except RefusedPickle as e:
        raise CheckpointError(_refusal(where, e)) from None
    except Exception as e:
        raise CheckpointError(f"[checkpoint] {where} is unreadable ({type(e).__name__}: {e}); the checkpoint "
                              f"is corrupt") from None
    report.pickles += 1
    report.classes |= unpickler.seen
    return loaded
