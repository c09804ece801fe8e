"""`Accelerator.save_state(dir)` / `load_state(dir)`: a DCP checkpoint that any layout loads.

One torch.distributed.checkpoint (DCP) save holds, as tensors only (no pickled objects):

* ``model``: `get_model_state_dict` -- parameter names and global shapes do not depend on the layout
  (FSDP/TP shards are DTensors, stored once each with their offsets), so DCP reshards on load;
* ``optimizer``: `get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`, keyed by
  parameter name, so it reshards with the weights;
* ``scheduler``: the scheduler's `state_dict()` as JSON text in a byte tensor;
* ``dataloader``: the prepared loader's position and the random state its epoch started from
  (`data.py`), the same on every rank;
* ``rng``: ``rank_<r>``: each process's torch CPU (and CUDA) generator state and Python's `random`
  state; a process whose rank the saving run did not have takes rank 0's.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtrain.components.checkpoint.safety import scan
from torchtrain.utils.json_tensor import decode_json, encode_json

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _rng() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state(), "python": encode_json(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = decode_json(state["python"])
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _state(models, optimizers, schedulers, loaders) -> dict:
    state: dict = {}
    for i, model in enumerate(models):
        state[f"model_{i}"] = get_model_state_dict(model)
    for i, (model, opt) in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt, options=_OPTIONS)
    for i, sched in enumerate(schedulers):
        state[f"scheduler_{i}"] = encode_json(sched.state_dict())
    for i, loader in enumerate(loaders):
        state[f"dataloader_{i}"] = loader.state_dict()
    return state


def save_state(folder: str, models, optimizers, schedulers, loaders) -> None:
    """Save everything prepared (optimizers as (model, optimizer) pairs) to `folder`."""
    state = _state(models, optimizers, schedulers, loaders)
    state["rng"] = {f"rank_{_rank()}": _rng()}
    dcp.save(state, checkpoint_id=folder)


def _sized(metadata, prefix: str) -> dict[str, torch.Tensor]:
    """Empty tensors shaped as the checkpoint's entries under `prefix` (their size is only known there)."""
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            out[key[len(prefix):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return out


def load_state(folder: str, models, optimizers, schedulers, loaders) -> None:
    """Load a `save_state` folder of any layout into the prepared objects of this one, after the pickle
    scan (`components/checkpoint/safety.py`: a folder holding a pickle that could run code is refused)."""
    scan(folder, "load_state")
    metadata = dcp.FileSystemReader(folder).read_metadata()
    state = _state(models, optimizers, schedulers, loaders)
    for i in range(len(schedulers)):
        state[f"scheduler_{i}"] = _sized(metadata, f"scheduler_{i}")[""] if f"scheduler_{i}" in \
            metadata.state_dict_metadata else state[f"scheduler_{i}"]
    for i in range(len(loaders)):
        state[f"dataloader_{i}"] = _sized(metadata, f"dataloader_{i}.")
    rank = _rank()
    key = f"rank_{rank}" if f"rng.rank_{rank}.torch" in metadata.state_dict_metadata else "rank_0"
    state["rng"] = {key: _sized(metadata, f"rng.{key}.")}
    dcp.load(state, checkpoint_id=folder)
    for i, model in enumerate(models):
        set_model_state_dict(model, state[f"model_{i}"])
    for i, (model, opt) in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"], options=_OPTIONS)
    for i, sched in enumerate(schedulers):
        sched.load_state_dict(decode_json(state[f"scheduler_{i}"]))
    for i, loader in enumerate(loaders):
        loader.load_state_dict(state[f"dataloader_{i}"])
    _set_rng(state["rng"][key])
