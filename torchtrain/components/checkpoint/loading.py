"""Loading a checkpoint into the live training state, with every rank agreeing on errors.

`CheckpointLoader` loads a DCP checkpoint (this package's, or torchtitan's under its names:
`torchtitan.py`) or a Hugging Face folder into the `states` the checkpoint manager holds: the
checkpoint is first checked against what it loads into (`validate.py`), and a problem on any rank
raises the same error on every rank (`agree`, `collective_try`), so a bad checkpoint stops every rank
with one message instead of leaving some waiting. The data loader's and RNG states are matched to
this run's data-parallel ranks and world size, which may differ from the saved run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtrain.components.checkpoint import integrity, torchtitan
from torchtrain.components.checkpoint.hf import load_hf_into_model
from torchtrain.components.checkpoint.safety import failure_line
from torchtrain.components.checkpoint.state import Stateful, decode_state
from torchtrain.components.checkpoint.validate import (
    CheckpointError,
    check_against_metadata,
    read_metadata,
    stored_keys,
)
from torchtrain.config.checkpoint import CHECKPOINT_KEYS
from torchtrain.models.converters.lora import lora_load_keys
from torchtrain.models.registry import args_differences
from torchtrain.utils.logging import logger


@dataclass
class ModelInfo:
    """What a checkpoint records about the model, and how to convert it to/from Hugging Face."""

    name: str
    flavor: str
    args: Any
    """The model's arguments dataclass (recorded; a resume with other arguments is warned about)."""
    adapter: Any = None
    """The model's StateDictAdapter class, or None (no HF import/export)."""
    weights: str | None = None
    """A Hugging Face folder of the model's own initial weights (`ModelSpec.hf_weights`): the initial
    load when there is no resume point and no `checkpoint.initial_load_path`, with or without checkpoints."""
    tokenizer: str = ""
    """The tokenizer's file or folder (`model.hf_assets_path`, absolute), recorded so that a checkpoint copied away
    from its job is read with it; empty: the built-in byte tokenizer."""


class CheckpointLoader:
    """Loads into `states` (checkpoint key -> live Stateful) of this rank; `dims` is the layout's
    ParallelDims, `group` the checkpoint's own process group."""

    def __init__(self, states: dict[str, Stateful], dims, model: ModelInfo, group):
        self.states, self.parallel_dims, self.model, self._pg = states, dims, model, group
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def agree(self, problem: str | None, error: type[Exception] = CheckpointError) -> None:
        """Raise the same error on every rank if any rank found a problem (never a rank left waiting)."""
        problems: list[str | None] = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self._pg)
        bad = [(r, p) for r, p in enumerate(problems) if p]
        if bad:
            rank, message = bad[0]
            raise error(message + (f" (seen on rank {rank})" if self.world_size > 1 else ""))

    def collective_try(self, fn: Callable[[], Any], context: str, error: type[Exception] = CheckpointError) -> Any:
        """Run fn on every rank; if it fails anywhere, raise `error` everywhere. Loading problems are
        CheckpointErrors (a clean message and exit code 2); saving problems are RuntimeErrors."""
        result, problem = None, None
        try:
            result = fn()
        except CheckpointError as e:
            problem = str(e)
        except (CheckpointException, Exception) as e:  # DCP/torch errors: wrapped with the checkpoint's name
            problem = f"[checkpoint] {context}: {failure_line(e, self.rank)}"
        self.agree(problem, error)
        return result

    def verify_files(self, path: str, files: dict[str, dict[str, Any]]) -> str | None:
        """Every rank: check its share of the checkpoint's files against the hashes written with it
        (`integrity.py`); the first problem any rank found, in one line naming the file, or None."""
        mine = integrity.share(sorted(files), self.rank, self.world_size)
        try:
            problem = integrity.verify(path, files, mine)
        except OSError as e:
            problem = f"cannot be read: {e}"
        problems: list[str | None] = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self._pg)
        return next((p for p in problems if p), None)

    def _template(self, keys: tuple[str, ...], metadata, meta: dict[str, Any]) -> dict[str, Any]:
        """The state dicts DCP loads into: live tensors; for the loader and RNG states a uint8 tensor of
        the stored size (None for a legacy byte entry); an older checkpoint's train state, stored as
        plain values, loads as them."""
        pd = self.parallel_dims
        template: dict[str, Any] = {}
        for key in keys:
            if key == "dataloader":
                own = f"dp_rank_{pd.dp_rank}"
                stored = stored_keys(metadata, "dataloader")
                same = meta.get("dp_degree", pd.dp) == pd.dp and own in stored
                template[key] = {k: _slot(metadata, f"dataloader.{k}") for k in ([own] if same else stored)}
            elif key == "rng":
                own = f"rank_{self.rank}"
                same = meta.get("world_size", self.world_size) == self.world_size
                name = own if same and own in stored_keys(metadata, "rng") else "rank_0"
                template[key] = {name: _slot(metadata, f"rng.{name}")}
            else:  # model, optimizer, lr_scheduler, train_state: load into the live state
                template[key] = self.states[key].state_dict()
                if key == "train_state":
                    entries = metadata.state_dict_metadata
                    template[key] = {k: v if isinstance(entries.get(f"{key}.{k}"), TensorStorageMetadata) else None
                                     for k, v in template[key].items() if f"{key}.{k}" in entries}  # (newer keys)
        return template

    def load_dcp(self, path: str, keys: tuple[str, ...], label: str, meta: dict[str, Any],
                 trusted: bool = False) -> None:
        """Load `keys` of the DCP folder `path`, after its pickle scan (`safety.py`) unless `trusted`."""
        self._warn_model_args(meta, label)
        keys = tuple(k for k in keys if k in self.states)  # a [dpo] run's reference, read by a job without one
        metadata = self.collective_try(lambda: read_metadata(path, label, trusted), f"{label} ({path})")
        template = self._template(keys, metadata, meta)
        if "model" in template:
            stored = {k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")}
            template["model"] = lora_load_keys(template["model"], stored)
        template, restore = self.collective_try(  # a torchtitan checkpoint: loaded under its names
            lambda: torchtitan.rename(template, self.model, meta, metadata, label), label)
        self.agree(check_against_metadata(metadata, template, path, label))
        self.collective_try(lambda: dcp.load(template, checkpoint_id=path, process_group=self._pg),
                             f"loading {label} ({path}) failed")
        loaded = restore(template)
        self.collective_try(lambda: self._apply(loaded, meta, label), f"restoring {label} ({path}) failed")

    def _apply(self, loaded: dict[str, Any], meta: dict[str, Any], label: str) -> None:
        pd = self.parallel_dims
        for key in CHECKPOINT_KEYS:
            if key not in loaded:
                continue
            value = loaded[key]
            if isinstance(value, dict) and not value and key in ("dataloader", "rng"):
                logger.warning("%s holds no %s state; it starts fresh", label, key)
                continue
            if key == "dataloader":
                value = self._pick_loader_state(value, meta.get("dp_degree"), label)
            elif key == "rng":
                value = next(iter(value.values()))
                if meta.get("world_size", self.world_size) != self.world_size:
                    logger.info("world size changed (%s -> %d): every rank restores rank 0's RNG state",
                                meta.get("world_size"), self.world_size)
            self.states[key].load_state_dict(value)
        if meta.get("layout") and (meta.get("layout"), meta.get("world_size")) != (pd.describe(), self.world_size):
            logger.info("%s was saved under %s (%s processes) and is loaded under %s (%d processes): resharded",
                        label, meta.get("layout"), meta.get("world_size"), pd.describe(), self.world_size)

    def _pick_loader_state(self, stored: dict[str, Any], saved_dp: int | None, label: str) -> Any:
        if len(stored) == 1 and saved_dp in (None, self.parallel_dims.dp):
            return next(iter(stored.values()))
        states = {k: decode_state(v, f"{label}: dataloader.{k}") for k, v in stored.items()}
        first = next(iter(states.values()))
        if any(s != first for s in states.values()):
            raise CheckpointError(
                f"[checkpoint] {label}: the data-parallel degree changed ({saved_dp} -> {self.parallel_dims.dp}) "
                f"and the saved dataloader states differ between data-parallel ranks, so the data position "
                f"cannot be carried over; add \"dataloader\" to checkpoint.exclude_from_loading to restart the "
                f"data stream instead"
            )
        logger.info("data-parallel degree changed (%s -> %d): the saved loader state is one position in the "
                    "shared global stream (identical on all %d saved data-parallel ranks), so the data continues "
                    "exactly where it stopped", saved_dp, self.parallel_dims.dp, len(states))
        return next(iter(stored.values()))

    def _warn_model_args(self, meta: dict[str, Any], label: str) -> None:
        saved = (meta.get("model") or {}).get("args")
        if not saved:
            return
        diff = args_differences(saved, self.model.args)
        if diff:
            logger.warning("%s was saved with different model arguments: %s", label,
                           ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items())))

    def load_hf(self, path: str) -> None:
        adapter = self.model.adapter(self.model.args)
        result = self.collective_try(lambda: load_hf_into_model(self.states["model"], path, adapter),
                                      f"loading Hugging Face weights from {path} failed")
        warnings, used, available = result
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, used, group=self._pg)
        unused = adapter.unused_hf_keys(set(available), set().union(*every))
        for w in warnings:
            logger.warning("initial load: %s", w)
        if unused:
            logger.warning("initial load: %d tensors of %s are not used, e.g. %s", len(unused), path,
                           ", ".join(sorted(unused)[:5]))
        logger.info("initial load: model weights loaded from the Hugging Face folder %s", path)


def _slot(metadata, key: str) -> torch.Tensor | None:
    """What DCP loads a stored loader/RNG state into: a uint8 tensor of its size, or None (bytes)."""
    entry = metadata.state_dict_metadata.get(key)
    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return None
