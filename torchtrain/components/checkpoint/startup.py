"""What a run loads at start-up, decided before any tensor is touched.

`preflight` runs on every rank before the process group exists and turns impossible requests
(a missing `initial_load_path`, a `load_step` that is not a complete checkpoint, pinned memory on a
CPU...) into ConfigErrors. `plan_start` runs on rank 0 once the group exists and picks, in this
order: a resume point in the checkpoint folder (the newest full-state checkpoint, a `step-0` seed,
or `load_step`), else the initial load, else nothing; every choice is logged, including an initial
load that is skipped because a resume point exists. A checkpoint whose files no longer match their
hashes (`verify`) is skipped for the next older one, in one warning line naming the file; one that
was asked for by name (`load_step`, `initial_load_path`) is an error instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from torchtrain.components.checkpoint import folder as fs
from torchtrain.components.checkpoint import torchtitan
from torchtrain.components.checkpoint.validate import read_metadata
from torchtrain.config.checkpoint import CHECKPOINT_KEYS
from torchtrain.config.fields import ConfigError
from torchtrain.utils.logging import logger


@dataclass
class StartPlan:
    """What start-up loads: kind is resume | finished | initial_dcp | initial_hf | none."""

    kind: str
    path: str = ""
    step: int = 0
    keys: tuple[str, ...] = ()
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    base: "StartPlan | None" = None
    """A resume from an adapter-only checkpoint: the initial load of its base weights, done first."""


def resolve_dcp_path(path: str) -> tuple[str, dict[str, Any]]:
    """A DCP checkpoint given as its own folder (with .metadata) or as a checkpoint folder (its newest
    complete step); returns (folder, marker content or {})."""
    if os.path.exists(os.path.join(path, ".metadata")):
        meta, _ = fs.read_marker(path)
        return path, meta or {}
    complete = [c for c in fs.scan(path) if c.complete]
    if not complete:  # another trainer's folder (torchtitan's): DCP writes .metadata last, once complete
        steps = [c for c in fs.scan(path) if os.path.exists(os.path.join(c.path, ".metadata"))
                 and fs.read_marker(c.path)[0] is None]
        if steps:
            return steps[-1].path, {}
        raise ConfigError(
            f"[checkpoint.initial_load_path] {path} is neither a DCP checkpoint (no .metadata) nor a checkpoint "
            f"folder with a complete step-N; for Hugging Face weights set checkpoint.initial_load_in_hf = true"
        )
    return complete[-1].path, complete[-1].meta


def imported_context_length(cfg, adapter) -> int:
    """The context window of the model the job's initial weights come from (`[checkpoint]` `cfg`): the Hugging
    Face folder's config.json (read by the model's `adapter`) or the context length a DCP checkpoint recorded;
    0 where there are no initial weights or they do not say (a missing folder is the start-up check's to name)."""
    path = cfg.initial_load_path
    if not path:
        return 0
    try:
        if cfg.initial_load_in_hf:
            with open(os.path.join(path, "config.json")) as f:
                return adapter.context_length(json.load(f))
        _, meta = resolve_dcp_path(path)
    except (OSError, ValueError, ConfigError):
        return 0
    length = ((meta.get("model") or {}).get("args") or {}).get("context_length")
    return length if isinstance(length, int) and length > 0 else 0


def preflight(cfg, dump_folder: str, device_type: str, model_name: str, has_hf_adapter: bool) -> None:
    """Checks of `[checkpoint]` needing no process group (run on every rank before it starts, for a job
    writing into `dump_folder` on `device_type`): ConfigError if bad."""
    if not cfg.enable:
        return
    if cfg.async_mode == "async_with_pinned_mem" and device_type != "cuda":
        raise ConfigError("[checkpoint.async_mode] async_with_pinned_mem needs CUDA (pinned memory speeds up "
                          "device-to-host copies); on CPU use async_mode = \"async\"")
    if cfg.initial_load_path:
        path = cfg.initial_load_path
        if not os.path.exists(path):
            raise ConfigError(f"[checkpoint.initial_load_path] {path} does not exist")
        if cfg.initial_load_in_hf:
            if not os.path.isdir(path) or not any(n.endswith(".safetensors") for n in os.listdir(path)):
                raise ConfigError(f"[checkpoint.initial_load_path] {path} is not a Hugging Face model folder "
                                  f"(no *.safetensors files)")
        else:
            resolve_dcp_path(path)
    folder = os.path.join(dump_folder, cfg.folder)
    found = fs.scan(folder)
    if cfg.load_step >= 0:
        match = [c for c in found if c.step == cfg.load_step]
        available = ", ".join(str(c.step) for c in found if c.complete) or "none"
        if not match:
            raise ConfigError(f"[checkpoint.load_step] {folder} has no step-{cfg.load_step} (complete "
                              f"checkpoints: {available})")
        if not match[0].complete:
            raise ConfigError(f"[checkpoint.load_step] step-{cfg.load_step} in {folder} is incomplete "
                              f"({match[0].problem}); complete checkpoints: {available}")
        if not (match[0].full_state or cfg.load_step == 0):
            raise ConfigError(f"[checkpoint.load_step] step-{cfg.load_step} holds the model weights only (an "
                              f"export), not a training state to resume; use it as checkpoint.initial_load_path")
    if cfg.create_seed_checkpoint and any(c.complete for c in found):
        raise ConfigError(f"[checkpoint.create_seed_checkpoint] {folder} already holds checkpoints; a seed "
                          f"checkpoint goes into an empty checkpoint.folder")
    if (cfg.last_save_in_hf or cfg.initial_load_in_hf) and not has_hf_adapter:
        raise ConfigError(f"[checkpoint] model {model_name!r} has no Hugging Face state-dict adapter; HF "
                          f"import/export is unavailable for it")



Verify = Callable[[fs.CheckpointInfo], "str | None"]
"""Checks a complete checkpoint's files against their hashes: the problem in one line, or None."""


def _unverified(c: fs.CheckpointInfo) -> str | None:
    return None


def plan_start(cfg, folder: str, total_steps: int, verify: Verify = _unverified,
               model_weights: str | None = None) -> StartPlan:
    """Decide what start-up loads, and say so in the log (rank 0 runs it; the others follow).
    `model_weights`: a Hugging Face folder of the model's own weights, the initial load unless
    `checkpoint.initial_load_path` names another."""
    if not cfg.initial_load_path and model_weights:
        cfg = dataclasses.replace(cfg, initial_load_path=model_weights, initial_load_in_hf=True)
    found = fs.scan(folder)
    for c in found:
        if not c.complete:
            logger.warning("checkpoint %s is incomplete (%s): skipped", c.path, c.problem)
    complete = [c for c in found if c.complete]
    chosen, corrupt = None, []
    if cfg.create_seed_checkpoint:
        pass
    elif cfg.load_step >= 0:
        chosen = next((c for c in complete if c.step == cfg.load_step), None)
        if chosen is None:
            raise ConfigError(f"[checkpoint.load_step] step-{cfg.load_step} is not a complete checkpoint in "
                              f"{folder}")
        problem = verify(chosen)
        if problem:
            raise ConfigError(f"[checkpoint.load_step] {chosen.path} is corrupt: {problem}")
    else:
        for c in reversed(complete):
            if c.full_state or c.step == 0:
                problem = verify(c)
                if problem:
                    logger.warning("checkpoint %s is corrupt: %s; skipped for the newest good one", c.path, problem)
                    corrupt.append(f"step-{c.step}: {problem}")
                    continue
                chosen = c
                break
            if c.meta.get("final") and c.step >= total_steps:
                logger.info("checkpoint %s is the final export of a finished run (step %d >= training.steps "
                            "%d): nothing left to train", c.path, c.step, total_steps)
                return StartPlan("finished", c.path, c.step, (), c.meta)
            logger.info("checkpoint %s holds the model only (an export), not a resume point; looking further "
                        "back", c.path)
    if chosen is None and corrupt:
        raise ConfigError(f"[checkpoint] {folder} holds no good checkpoint to resume: every one is corrupt "
                          f"({'; '.join(corrupt)}). Not starting over them: move them out of the folder to start "
                          f"afresh, or set checkpoint.verify_on_load = false to load one as it is")
    if chosen is not None:
        keys = tuple(k for k in CHECKPOINT_KEYS if k in chosen.contents and k not in cfg.exclude_from_loading)
        if chosen.meta.get("adapter_only"):
            base = _initial_plan(cfg, "the adapter-only checkpoint " + chosen.path, verify) if cfg.initial_load_path else None
            if base is None:
                logger.info("%s holds LoRA adapters only and there is no checkpoint.initial_load_path: the base "
                            "weights are the seed's initial ones", chosen.path)
            return StartPlan("resume", chosen.path, chosen.step, keys, chosen.meta, base=base)
        if cfg.initial_load_path:
            logger.info("checkpoint.initial_load_path %s is NOT loaded: a resume point exists, and resuming "
                        "always wins over an initial load", cfg.initial_load_path)
        return StartPlan("resume", chosen.path, chosen.step, keys, chosen.meta)
    if cfg.initial_load_path:
        return _initial_plan(cfg, f"no checkpoint to resume in {folder}", verify)
    logger.info("no checkpoint to resume in %s and no checkpoint.initial_load_path: training starts from the "
                "initial weights", folder)
    return StartPlan("none")


def _initial_plan(cfg, where: str, verify: Verify = _unverified) -> StartPlan:
    """The initial load of `checkpoint.initial_load_path` (set)."""
    if cfg.initial_load_in_hf:
        logger.info("%s: initial load of Hugging Face weights from %s", where, cfg.initial_load_path)
        return StartPlan("initial_hf", cfg.initial_load_path, 0, ("model",))
    path, meta = resolve_dcp_path(cfg.initial_load_path)
    if meta:  # written by torchtrain: its files have hashes (unless it is older)
        problem = verify(fs.CheckpointInfo(int(meta.get("step", 0)), path, True, meta))
        if problem:
            raise ConfigError(f"[checkpoint.initial_load_path] {path} is corrupt: {problem}")
    contents = meta.get("contents", ["model"])
    if not meta:  # not written by torchtrain: torchtitan's? (components/checkpoint/torchtitan.py)
        metadata = read_metadata(path, "checkpoint.initial_load_path", cfg.trust_initial_load)
        version = torchtitan.detect(metadata)
        if version is not None:
            meta, contents = {"torchtitan": version}, torchtitan.contents(metadata)
            logger.info("%s is a torchtitan %s checkpoint (%s)", path, version, ", ".join(contents))
    wanted = ("model",) if cfg.initial_load_model_only else tuple(
        k for k in CHECKPOINT_KEYS if k in contents and k not in cfg.exclude_from_loading)
    logger.info("%s: initial load of %s from %s", where, ", ".join(wanted), path)
    return StartPlan("initial_dcp", path, int(meta.get("step", 0)), wanted, meta)
