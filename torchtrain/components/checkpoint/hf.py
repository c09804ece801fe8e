"""Hugging Face checkpoints: safetensors folders written from and read into torchtrain models.

An HF model folder holds `config.json` and either one `model.safetensors` or, past a size
threshold, `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {hf_key: file}}`). The model's
`StateDictAdapter` converts names and layouts key by key, so every conversion here streams:

* export (`export_dcp_to_hf`): from a DCP checkpoint folder, one shard's tensors are read (a partial
  DCP load on one process), converted and written before the next; peak memory is about one shard.
  Exporting from the DCP files makes the export independent of the training layout (FSDP, TP, PP:
  the DCP checkpoint holds every stage's tensors with their global shapes).
* import into a live model (`load_hf_into_model`): every rank reads, for each parameter of its own
  model parts, the full HF tensor, converts it, and keeps its shard (`distribute_tensor` with
  `src_data_rank=None`: a local slice, no communication, any placement). Peak extra memory: one
  full tensor.
* import to DCP (`hf_to_dcp`, offline, one process): the whole model in memory, written as a
  model-only DCP checkpoint that any layout can load.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtrain.components.checkpoint.state import ModelState
from torchtrain.components.checkpoint.validate import CheckpointError, read_metadata
from torchtrain.models.state_dict_adapter import StateDictAdapter
from torchtrain.utils.progress import Progress

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """Silence DCP's "torch.distributed is disabled ... single process" warning: one process is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _natural(key: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def shard_file_name(index: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of keys, each at most `max_bytes` (a bigger tensor gets a shard of its own)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for key, nbytes in sizes:
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(key)
        used += nbytes
    if current:
        shards.append(current)
    return shards


def export_dcp_to_hf(ckpt_path: str, out_dir: str, adapter: StateDictAdapter, dtype: torch.dtype | None = None,
                     max_shard_bytes: int = 5 * 1024**3, label: str = "checkpoint", show_progress: bool = False
                     ) -> dict[str, Any]:
    """Write the `model.*` tensors of a DCP checkpoint as an HF folder; returns a summary.
    `show_progress`: a progress line (bytes written, rate, ETA) on stderr, shard by shard."""
    metadata = read_metadata(ckpt_path, label)
    entries = []  # (torchtrain key, global size, stored dtype)
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            entries.append((key[len("model."):], tuple(md.size), md.properties.dtype))
    if not entries:
        raise CheckpointError(f"[checkpoint] {label} ({ckpt_path}) holds no model weights to export")
    entries = [e for e in entries if adapter.hf_keys(e[0])]  # buffers HF does not store are left out
    entries.sort(key=lambda e: (_natural(adapter.hf_keys(e[0])[0]), adapter.hf_part(e[0]) or 0))
    out_dtype = {e[0]: dtype or e[2] for e in entries}
    by_key = {e[0]: e for e in entries}
    # the parameters written as one HF tensor (`StateDictAdapter.hf_part`) go into one shard together
    groups: dict[str, list[str]] = {}
    for key, *_ in entries:
        groups.setdefault(adapter.hf_keys(key)[0], []).append(key)
    nbytes = {e[0]: torch.Size(e[1]).numel() * out_dtype[e[0]].itemsize for e in entries}
    sizes = [(name, sum(nbytes[k] for k in keys)) for name, keys in groups.items()]
    shards = [[k for name in names for k in groups[name]] for names in plan_shards(sizes, max_shard_bytes)]
    os.makedirs(out_dir, exist_ok=True)
    weight_map: dict[str, str] = {}
    bar = Progress("export to HF", sum(n for _, n in sizes), "bytes", enabled=show_progress)
    for i, keys in enumerate(shards):
        name = shard_file_name(i, len(shards))
        placeholders = {k: torch.empty(by_key[k][1], dtype=by_key[k][2]) for k in keys}
        try:
            with _one_process():
                dcp.load({"model": placeholders}, checkpoint_id=ckpt_path, no_dist=True)
        except Exception as e:  # DCP wraps read errors of any kind
            raise CheckpointError(f"[checkpoint] {label} ({ckpt_path}): reading weights for the HF export "
                                  f"failed: {e}") from None
        tensors = {hf: t.contiguous()
                   for hf, t in adapter.to_hf_state((k, placeholders[k].to(out_dtype[k])) for k in keys).items()}
        save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update({hf: name for hf in tensors})
        bar.update(sum(t.numel() * t.element_size() for t in tensors.values()))
        del placeholders, tensors
    bar.close()
    total = sum(nbytes.values())
    if len(shards) > 1:
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                      indent=2)
    config_dtype = dtype or entries[0][2]
    write_config(out_dir, adapter, config_dtype)
    return {"files": len(shards), "tensors": len(weight_map), "bytes": total}


def write_config(out_dir: str, adapter: StateDictAdapter, dtype: torch.dtype) -> None:
    """config.json of an export, and the files the model keeps beside it (`StateDictAdapter.extra_files`)."""
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(adapter.hf_config(dtype), f, indent=2)
    for path in adapter.extra_files():
        shutil.copyfile(path, os.path.join(out_dir, os.path.basename(path)))


class HFCheckpoint:
    """Read access to an HF safetensors folder: key -> file map, config.json, tensors by key."""

    def __init__(self, folder: str):
        self.folder = folder
        if not os.path.isdir(folder):
            raise CheckpointError(f"[checkpoint.initial_load_path] HF folder {folder} does not exist")
        self.config: dict[str, Any] | None = None
        config_path = os.path.join(folder, CONFIG_FILE)
        if os.path.exists(config_path):
            with open(config_path) as f:
                self.config = json.load(f)
        self.weight_map: dict[str, str] = {}
        index_path = os.path.join(folder, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                self.weight_map = dict(json.load(f)["weight_map"])
        else:
            files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"[checkpoint.initial_load_path] {folder} holds no *.safetensors files")
            for name in files:
                with self._open(name) as f:
                    self.weight_map.update({k: name for k in f.keys()})
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}

    def _open(self, name: str):
        path = os.path.join(self.folder, name)
        if not os.path.exists(path):
            raise CheckpointError(f"[checkpoint.initial_load_path] {self.folder}: file {name} listed in the "
                                  f"index is missing")
        try:
            return safe_open(path, framework="pt")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"[checkpoint.initial_load_path] {path} is truncated or not a safetensors "
                                  f"file ({e})") from None

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def get(self, key: str) -> torch.Tensor:
        name = self.weight_map[key]
        if name not in self._handles:
            self._handles[name] = self._stack.enter_context(self._open(name))
        try:
            return self._handles[name].get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"[checkpoint.initial_load_path] {self.folder}/{name}: cannot read {key!r} "
                                  f"({e})") from None

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


def _hf_tensor(ckpt: HFCheckpoint, adapter: StateDictAdapter, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    hf_keys = adapter.hf_keys(key)
    for hf_key in hf_keys:
        if hf_key not in ckpt.weight_map:
            raise CheckpointError(f"[checkpoint.initial_load_path] {ckpt.folder} lacks {hf_key!r} (parameter {key})")
    try:
        tensor = adapter.from_hf_tensors(key, [ckpt.get(k) for k in hf_keys])
    except ValueError as e:  # the stored tensors do not have the layout the adapter converts (e.g. quantized ones)
        raise CheckpointError(f"[checkpoint.initial_load_path] {ckpt.folder}/{ckpt.weight_map[hf_keys[0]]}: {e}; "
                              f"parameter {key} cannot be loaded from it") from None
    if tuple(tensor.shape) != tuple(shape):
        shown = hf_keys[0] if len(hf_keys) == 1 else f"{hf_keys[0]} ... ({len(hf_keys)} tensors)"
        raise CheckpointError(
            f"[checkpoint.initial_load_path] {ckpt.folder}: {shown!r} has shape {tuple(tensor.shape)} but "
            f"parameter {key} has {tuple(shape)}; the HF model has a different shape (check [model])"
        )
    return tensor


def load_hf_into_model(model_state: ModelState, folder: str, adapter: StateDictAdapter
                       ) -> tuple[list[str], set[str], set[str]]:
    """Copy HF weights into this rank's (possibly sharded) model parts, through their `ModelState`
    (one merged state dict; parameter names clashing between parts are an error there).

    Returns (config warnings, HF keys used, all HF keys) so the caller can report unused keys over
    all ranks."""
    ckpt = HFCheckpoint(folder)
    try:
        adapter = adapter.reading(ckpt.keys())
        if ckpt.config is not None:
            warnings = adapter.check_hf_config(ckpt.config, os.path.join(folder, CONFIG_FILE))
        else:
            warnings = [f"{folder} has no config.json; only tensor names and shapes are checked"]
        used: set[str] = set()
        sd = model_state.state_dict()
        with torch.no_grad():
            for key, target in sd.items():
                if not adapter.hf_keys(key):  # not stored by HF (e.g. an MoE routing bias): keeps its value
                    continue
                full = _hf_tensor(ckpt, adapter, key, tuple(target.shape)).to(target.dtype)
                if isinstance(target, DTensor):
                    full = full.to(target.device)
                    local = distribute_tensor(full, target.device_mesh, target.placements,
                                              src_data_rank=None).to_local()
                    target.to_local().copy_(local)
                else:
                    target.copy_(full)
                used.update(adapter.hf_keys(key))
        model_state.load_state_dict(sd)
        return warnings, used, ckpt.keys()
    finally:
        ckpt.close()


def iter_model_keys(model: nn.Module) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    for key, value in model.state_dict().items():
        yield key, tuple(value.shape), value.dtype


def hf_to_dcp(folder: str, out_dir: str, model: nn.Module, adapter: StateDictAdapter,
              dtype: torch.dtype | None = None, show_progress: bool = False) -> dict[str, Any]:
    """Offline, one process: an HF folder -> a model-only DCP checkpoint at `out_dir` (keys `model.*`).

    `model` only provides names and shapes (it may live on the meta device). `show_progress`: progress
    lines on stderr (bytes read, rate, ETA; then the DCP write)."""
    ckpt = HFCheckpoint(folder)
    keys = list(iter_model_keys(model))
    out_bytes = lambda shape, model_dtype: torch.Size(shape).numel() * (dtype or model_dtype).itemsize  # noqa: E731
    try:
        adapter = adapter.reading(ckpt.keys())
        warnings = adapter.check_hf_config(ckpt.config, folder) if ckpt.config else []
        state = {}
        with Progress("read HF", sum(out_bytes(s, d) for _, s, d in keys), "bytes", enabled=show_progress) as bar:
            for key, shape, model_dtype in keys:
                if adapter.hf_keys(key):
                    state[key] = _hf_tensor(ckpt, adapter, key, shape).to(dtype or model_dtype).contiguous()
                else:  # a buffer HF does not store (an MoE routing bias) starts at zero, as a fresh model's
                    state[key] = torch.zeros(shape, dtype=model_dtype)
                bar.update(out_bytes(shape, model_dtype))
        unused = adapter.unused_hf_keys(set(ckpt.keys()), {h for k in state for h in adapter.hf_keys(k)})
    finally:
        ckpt.close()
    with Progress("write DCP", None, "bytes", enabled=show_progress) as bar:  # one call: time and rate at the end
        with _one_process():
            dcp.save({"model": state}, checkpoint_id=out_dir, no_dist=True)
        bar.done = sum(t.numel() * t.element_size() for t in state.values())
    return {"tensors": len(state), "warnings": warnings, "unused": sorted(unused)}
