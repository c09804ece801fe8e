"""What a checkpoint holds, as state dicts that torch.distributed.checkpoint (DCP) saves and reshards.

Top-level keys (each becomes a prefix of the flat keys DCP stores):

* ``model``: ``get_model_state_dict`` of every model part, merged. Keys are canonical parameter
  names (``layers.3.attention.wq.weight``), values are the parts' own tensors: DTensors under
  FSDP/HSDP/TP (DCP stores each shard once with its global offset), plain tensors on one process.
  Because keys and global shapes do not depend on the layout, any layout loads any other's save.
* ``optimizer``: ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` of every
  (part, optimizer) pair, merged: ``state.<param>.exp_avg`` etc. and ``param_groups.<param>.lr``,
  again keyed by parameter name, so they reshard with the weights.
* ``lr_scheduler``: the schedule's counters (``last_epoch``...).
* ``dataloader``: ``dp_rank_<r>``: the loader state of data-parallel rank r as a uint8 tensor of UTF-8
  JSON (every rank of a data-parallel group writes the same key; DCP keeps one copy).
* ``train_state``: the trainer's ``step`` and ``tokens_seen``, int64 tensors.
* ``rng``: ``rank_<r>``: Python, torch CPU and (on CUDA) the device's RNG states of global rank r, a
  uint8 tensor of UTF-8 JSON (generator states base64-encoded).
* ``reference`` (a ``[dpo]`` job only): its frozen reference weights by parameter name, or its precomputed
  log-prob table ``logps`` (`posttrain/reference.py`); added to the states by the trainer.

No torchtrain state is pickled: the only pickles of a checkpoint are DCP's metadata and its plain
values (the optimizer's hyper-parameters, the schedule's counter). Checkpoints written before stored
the loader and RNG states as pickled bytes; those load through `safety.safe_loads` (builtins only).
"""

from __future__ import annotations

import base64
import random
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from torchtrain.components.checkpoint.safety import safe_loads
from torchtrain.models.converters.float8 import high_precision
from torchtrain.models.converters.lora import is_adapter_param
from torchtrain.utils.json_tensor import decode_json, encode_json


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModelState:
    """The model parts as one state dict (parameter names are unique across parts)."""

    def __init__(self, model_parts: list[nn.Module], adapter_only: bool = False):
        self.model_parts = model_parts
        self.adapter_only = adapter_only
        """Saves hold the LoRA adapters only (`lora.save_adapter_only`)."""

    def saved_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """What a save writes: the whole state dict, or its adapters only."""
        state = self.state_dict(dtype)
        return {k: v for k, v in state.items() if is_adapter_param(k)} if self.adapter_only else state

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            sd = get_model_state_dict(part)
            clash = merged.keys() & sd.keys()
            if clash:
                raise RuntimeError(f"model parts share parameter names: {sorted(clash)[:3]}")
            merged.update(sd)
        merged = {k: high_precision(v) for k, v in merged.items()}  # float8 all-gather wraps the weights
        if dtype is not None:
            merged = {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v
                      for k, v in merged.items()}
        return merged

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        # Each part takes its own keys from the merged dict; completeness was checked beforehand
        # against the checkpoint's metadata, so strict=False only skips the other parts' keys.
        for part in self.model_parts:
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))


def decode_state(stored: torch.Tensor | bytes, source: str) -> Any:
    """A stored state back: a JSON tensor, or a legacy pickled blob (read with builtins only)."""
    if isinstance(stored, torch.Tensor):
        return decode_json(stored)
    return safe_loads(stored, source=source)


class DataLoaderState:
    """The loader's state stored per data-parallel rank (see docs/checkpointing.md, Resharding)."""

    def __init__(self, dataloader: Stateful, dp_rank: int):
        self.dataloader, self.dp_rank = dataloader, dp_rank

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"dp_rank_{self.dp_rank}": encode_json(self.dataloader.state_dict())}

    def load_state_dict(self, stored: torch.Tensor | bytes) -> None:
        self.dataloader.load_state_dict(decode_state(stored, "the dataloader state"))


class RNGState:
    """Python, torch CPU and (on CUDA) the current device's generator states of this process."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device

    def state_dict(self) -> dict[str, torch.Tensor]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": _b64(torch.get_rng_state())}
        if self.device.type == "cuda":
            state["cuda"] = _b64(torch.cuda.get_rng_state(self.device))
        return {f"rank_{self.rank}": encode_json(state)}

    def load_state_dict(self, stored: torch.Tensor | bytes) -> None:
        state = decode_state(stored, "the RNG state")
        if isinstance(stored, torch.Tensor):
            version, internal, gauss = state["python"]
            random.setstate((version, tuple(internal), gauss))
            torch.set_rng_state(_from_b64(state["torch"]))
            if self.device.type == "cuda" and "cuda" in state:
                torch.cuda.set_rng_state(_from_b64(state["cuda"]), self.device)
            return
        random.setstate(state["python"])  # a legacy pickled state: raw generator bytes
        torch.set_rng_state(_tensor(state["torch"]))
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(_tensor(state["cuda"]), self.device)


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def _from_b64(text: str) -> torch.Tensor:
    return _tensor(base64.b64decode(text))


def _tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def training_states(model_parts: list[nn.Module], optimizers: Stateful, lr_schedulers: Stateful,
                    dataloader: Stateful, train_state: Stateful, dp_rank: int, rank: int,
                    device: torch.device, adapter_only: bool = False) -> dict[str, Stateful]:
    """What a checkpoint saves and restores, by top-level key (see the module docstring); `adapter_only`:
    the model's saves hold its LoRA adapters only."""
    return {"model": ModelState(model_parts, adapter_only), "optimizer": optimizers, "lr_scheduler": lr_schedulers,
            "dataloader": DataLoaderState(dataloader, dp_rank), "train_state": train_state,
            "rng": RNGState(rank, device)}
