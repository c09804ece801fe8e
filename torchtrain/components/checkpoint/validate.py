"""Check a checkpoint against what is about to be loaded into, before any data is read.

DCP stores a flat key per leaf of the nested state dict (``model.layers.0.attention.wq.weight``,
``optimizer.state.layers.0.attention.wq.weight.exp_avg``, ``train_state.step``) with, for tensors,
the global shape and the (file, offset, length) of every stored chunk. Comparing that metadata with
the state dict we load into finds, on every rank alike and without a collective, the errors that
would otherwise surface deep inside DCP or as a silent mis-load:

* a key we need that the checkpoint lacks (another model, another optimizer);
* a tensor whose global shape differs (another model size);
* a data file that is missing or shorter than a chunk it should hold (a truncated copy).

Each message names the checkpoint step and the key.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchtrain.components.checkpoint.safety import CheckpointError, scan
from torchtrain.utils.logging import logger

__all__ = ["CheckpointError", "read_metadata", "check_against_metadata", "stored_keys"]


def read_metadata(path: str, label: str, trusted: bool = False) -> Metadata:
    """The folder's DCP metadata, after the pickle scan (`safety.py`) of the whole folder; `trusted`
    skips the scan (the user vouches for the folder: logged)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"[checkpoint] {label}: folder {path} does not exist")
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"[checkpoint] {label} ({path}) has no DCP .metadata file: not a torch.distributed.checkpoint "
            f"folder, or an incomplete copy"
        )
    if trusted:
        logger.warning("%s: %s is loaded WITHOUT the pickle scan (trusted by configuration): its pickles may "
                       "run code", label, path)
    else:
        scan(path, label)
    try:
        return FileSystemReader(path).read_metadata()
    except (EOFError, OSError, pickle.UnpicklingError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(f"[checkpoint] {label} ({path}): .metadata is unreadable ({e}); "
                              f"the checkpoint is corrupt or truncated") from None


def flat_keys(state: dict[str, Any]) -> dict[str, Any]:
    """The flat key -> leaf view DCP uses for `state` (same function DCP calls)."""
    flat, _ = flatten_state_dict(state)
    return flat


def check_against_metadata(metadata: Metadata, state: dict[str, Any], path: str, label: str) -> str | None:
    """The first problem loading `state` from this checkpoint would hit, or None."""
    stored = metadata.state_dict_metadata
    flat = flat_keys(state)
    for key, leaf in flat.items():
        entry = stored.get(key)
        if entry is None:
            section = key.split(".", 1)[0]
            have = sorted(k for k in stored if k.startswith(section + "."))[:3]
            hint = f" (it has e.g. {', '.join(have)})" if have else f" (it has no {section!r} state at all)"
            return (f"[checkpoint] {label} ({path}) lacks key {key!r}{hint}: it was saved from a different "
                    f"model or setup")
        if isinstance(leaf, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                return f"[checkpoint] {label} ({path}): key {key!r} is stored as bytes, expected a tensor"
            if tuple(entry.size) != tuple(leaf.shape):
                return (f"[checkpoint] {label} ({path}): key {key!r} has shape {tuple(entry.size)} in the "
                        f"checkpoint but {tuple(leaf.shape)} in this run: the checkpoint is from a different "
                        f"model shape (check the [model] settings)")
        elif isinstance(entry, TensorStorageMetadata) and leaf is not None:
            return f"[checkpoint] {label} ({path}): key {key!r} is a tensor in the checkpoint, expected {type(leaf).__name__}"
    return check_files(metadata, set(flat), path, label)


def check_files(metadata: Metadata, keys: set[str], path: str, label: str) -> str | None:
    """Every chunk of the wanted keys lies inside an existing data file."""
    sizes: dict[str, int | None] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in keys:
            continue
        name = info.relative_path
        if name not in sizes:
            full = os.path.join(path, name)
            sizes[name] = os.path.getsize(full) if os.path.exists(full) else None
        if sizes[name] is None:
            return (f"[checkpoint] {label} ({path}): data file {name} is missing (needed for key "
                    f"{index.fqn!r}); the checkpoint copy is incomplete")
        if info.offset + info.length > sizes[name]:
            return (f"[checkpoint] {label} ({path}): data file {name} is truncated ({sizes[name]} bytes, "
                    f"key {index.fqn!r} needs bytes {info.offset}..{info.offset + info.length}); the "
                    f"checkpoint is corrupt")
    return None


def stored_keys(metadata: Metadata, prefix: str) -> list[str]:
    """Sub-keys stored under a top-level key, e.g. prefix "dataloader" -> ["dp_rank_0", ...]."""
    return sorted(k[len(prefix) + 1:] for k in metadata.state_dict_metadata if k.startswith(prefix + "."))

