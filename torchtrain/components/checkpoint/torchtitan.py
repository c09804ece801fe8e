"""torchtitan's DCP checkpoints, both ways: load one as `checkpoint.initial_load_path`, write one
(`scripts/convert_to_torchtitan.py`).

What torchtitan (0.2.x and 0.3.x) stores in a `step-N` folder, as DCP keys:

* the model's parameters **at the top level**, under torchtitan's module paths
  (`tok_embeddings.weight`, `layers.0.attention.wq.weight` -- 0.3: `...attention.qkv_linear.wq.weight`,
  `output.weight` -- 0.3: `lm_head.weight`, MoE layers under `moe.`); each model's state-dict adapter
  says how its parameter names map (`StateDictAdapter.torchtitan_key`);
* `optimizer.state.<param>.<name>` and `optimizer.param_groups.<param>.<name>`: the same flattened
  optimizer state as torchtrain's, keyed by torchtitan's parameter names;
* `train_state.step`, `train_state.ntokens_seen`; `lr_scheduler.*` (a LambdaLR's own state; torchtrain
  derives the schedule from the step instead); `dataloader.*` (torchtitan's loader; not read).

A checkpoint is recognised from its metadata alone (`detect`): top-level model keys and no `model.`
prefix. Loading renames the state dicts torchtrain loads into (`rename`), lets DCP fill them --
resharded to any torchtrain layout, as for its own checkpoints -- and renames them back (`restore`).
A parameter the checkpoint does not have is an error, except the ones torchtitan may not write: the
routing bias of auxiliary-loss-free balancing (kept at zero) and multi-token-prediction modules
(kept at their initial weights), each logged.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchtrain.components.checkpoint.validate import CheckpointError
from torchtrain.models.state_dict_adapter import torchtitan_key
from torchtrain.utils.logging import logger

OPTIONAL = ("expert_bias",)  # parameter name endings torchtitan writes only with load balancing on
OPTIONAL_PREFIXES = ("mtp.",)  # modules torchtitan 0.2 has not


def detect(metadata: Metadata) -> str | None:
    """"0.2" or "0.3" for a torchtitan checkpoint (its naming), None for anything else."""
    keys = metadata.state_dict_metadata
    if "tok_embeddings.weight" not in keys or "model.tok_embeddings.weight" in keys:
        return None
    newer = any(".qkv_linear." in k or k == "lm_head.weight" or ".routed_experts." in k for k in keys)
    return "0.3" if newer else "0.2"


def contents(metadata: Metadata) -> list[str]:
    """torchtrain's checkpoint keys that a torchtitan checkpoint can provide."""
    stored = metadata.state_dict_metadata
    out = ["model"]
    if any(k.startswith("optimizer.state.") for k in stored):
        out.append("optimizer")
    if "train_state.step" in stored:
        out += ["lr_scheduler", "train_state"]
    return out


def _mapper(adapter) -> Callable[[str, str], str]:
    return adapter.torchtitan_key if adapter is not None else torchtitan_key


def _optional(key: str) -> bool:
    return key.endswith(OPTIONAL) or key.startswith(OPTIONAL_PREFIXES)


def _rename_optimizer_key(key: str, names: dict[str, str]) -> str:
    """`state.<param>.<name>` / `param_groups.<param>.<name>` with the parameter renamed."""
    head, _, rest = key.partition(".")
    param, _, leaf = rest.rpartition(".")
    return f"{head}.{names.get(param, param)}.{leaf}"


def rename(template: dict[str, Any], model, meta: dict[str, Any], metadata: Metadata, label: str
           ) -> tuple[dict[str, Any], Callable[[dict[str, Any]], dict[str, Any]]]:
    """(the state dict to load from the checkpoint, a function turning the loaded one back into
    torchtrain's keys). `template` is what torchtrain loads into (model, optimizer, ...); `model` the
    manager's ModelInfo; `meta["torchtitan"]` the checkpoint's naming version (`startup.plan_start`),
    absent for torchtrain's own checkpoints, which are returned as they are."""
    version = meta.get("torchtitan")
    if not version:
        return template, lambda loaded: loaded
    adapter = model.adapter(model.args) if model.adapter is not None else None
    stored = metadata.state_dict_metadata
    to_titan = _mapper(adapter)
    names = {k: to_titan(k, version) for k in template["model"]}
    skipped = [k for k, t in names.items() if t not in stored and _optional(k)]
    missing = [t for k, t in names.items() if t not in stored and not _optional(k)]
    if missing:
        have = sorted(k for k in stored if "." in k and not k.startswith(("optimizer.", "train_state.",
                                                                           "lr_scheduler.", "dataloader.")))[:3]
        raise CheckpointError(f"[checkpoint] {label}: this torchtitan {version} checkpoint lacks {len(missing)} of the "
                              f"model's parameters, e.g. {missing[0]!r} (it has e.g. {', '.join(have)}): another "
                              f"model or flavor? (set [model] as in the torchtitan job)")
    if skipped:
        logger.info("%s: not in the torchtitan checkpoint, kept as initialised: %s", label, ", ".join(skipped[:6]))
    loading: dict[str, Any] = {names[k]: v for k, v in template["model"].items() if k not in skipped}
    opt_names: dict[str, str] = {}
    if "optimizer" in template:
        wanted = {}
        for key, value in template["optimizer"].items():
            titan = _rename_optimizer_key(key, names)
            if f"optimizer.{titan}" in stored:
                wanted[key], opt_names[key] = value, titan
            elif key.startswith("state.") and not _optional(key.split(".", 1)[1]):
                raise CheckpointError(f"[checkpoint] {label}: the torchtitan checkpoint's optimizer lacks "
                                      f"{'optimizer.' + titan!r}: another optimizer (optimizer.name)? Load the model "
                                      f"only (checkpoint.initial_load_model_only = true)")
        loading["optimizer"] = {opt_names[k]: v for k, v in wanted.items()}
    if "train_state" in template:  # torchtitan stores plain ints; older releases and converted ones tensors
        loading["train_state"] = {k: _counter_slot(stored.get(f"train_state.{k}")) for k in ("step", "ntokens_seen")}

    def restore(loaded: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"model": {k: loaded[t] for k, t in names.items() if k not in skipped}}
        if "optimizer" in template:
            # a param_groups entry torchtitan did not store (another torch version's option) keeps ours
            out["optimizer"] = {k: loaded["optimizer"][opt_names[k]] if k in opt_names else v
                                for k, v in template["optimizer"].items()}
        if "train_state" in template:
            step = int(loaded["train_state"]["step"])
            out["train_state"] = {"step": step, "tokens_seen": int(loaded["train_state"]["ntokens_seen"])}
            if "lr_scheduler" in template:
                out["lr_scheduler"] = {"last_epoch": step}
        return out

    return loading, restore


def _counter_slot(entry: Any) -> Any:
    """What a stored train-state counter loads into: a tensor of its shape and dtype, or a plain int."""
    if isinstance(entry, TensorStorageMetadata):
        return torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
    return 0


def _counters_as_bytes(src: str, metadata: Metadata, kept: dict[str, Any], out: str) -> None:
    """torchtitan stores its train state as plain ints (byte entries); torchtrain as int64 tensors. The
    tensors are read and written as torchtitan's byte entries into a small data file of their own."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    tensors = {k: v for k, v in metadata.state_dict_metadata.items()
               if k in kept and k.startswith("train_state.") and isinstance(v, TensorStorageMetadata)}
    if not tensors:
        return
    values = {k: _counter_slot(v) for k, v in tensors.items()}
    dcp.load(values, checkpoint_id=src, no_dist=True)  # flat keys: read as they are stored
    name = "__train_state.distcp"
    with open(os.path.join(out, name), "wb") as f:
        for key, value in values.items():
            buffer = io.BytesIO()
            torch.save(int(value), buffer)
            offset = f.tell()
            f.write(buffer.getvalue())
            metadata.state_dict_metadata[key] = BytesStorageMetadata()
            metadata.storage_data = {i: info for i, info in metadata.storage_data.items() if i.fqn != key}
            metadata.storage_data[MetadataIndex(key)] = _StorageInfo(name, offset, len(buffer.getvalue()))


def write_torchtitan(src: str, out: str, adapter, version: str, with_optimizer: bool = False) -> dict[str, int]:
    """Write the torchtrain checkpoint `src` (a step-N folder) as a torchtitan checkpoint in `out`.

    DCP's data files hold raw chunks that its `.metadata` maps to keys, so renaming keys rewrites the
    metadata only: the data files are hard-linked (copied across filesystems), whatever the model's
    size, without loading a tensor. Model weights always; with `with_optimizer` also the optimizer
    state and `train_state` (step, ntokens_seen) -- torchtitan then continues the run when told to
    skip what it cannot find: `checkpoint.exclude_from_loading = ["dataloader", "lr_scheduler"]`.
    Returns counts of the keys written per part."""
    import pickle
    import shutil

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from torchtrain.components.checkpoint.validate import read_metadata

    metadata = read_metadata(src, src)  # after the pickle scan
    to_titan = _mapper(adapter)
    params = {k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")}
    names = {k: to_titan(k, version) for k in params}

    def new_key(key: str) -> tuple[str, tuple[str, ...]] | None:
        """(torchtitan's flat key, its path in the nested state dict), or None to leave it out."""
        head, _, rest = key.partition(".")
        if head == "model":
            return names[rest], (names[rest],)
        if with_optimizer and head == "optimizer":
            renamed = _rename_optimizer_key(rest, names)
            return f"optimizer.{renamed}", ("optimizer", renamed)
        if with_optimizer and head == "train_state" and rest in ("step", "tokens_seen"):
            leaf = "ntokens_seen" if rest == "tokens_seen" else rest
            return f"train_state.{leaf}", ("train_state", leaf)
        return None

    kept = {k: new for k in metadata.state_dict_metadata if (new := new_key(k)) is not None}
    os.makedirs(out, exist_ok=True)
    _counters_as_bytes(src, metadata, kept, out)
    metadata.state_dict_metadata = {kept[k][0]: v for k, v in metadata.state_dict_metadata.items() if k in kept}
    metadata.storage_data = {MetadataIndex(kept[i.fqn][0], i.offset, i.index): info
                             for i, info in (metadata.storage_data or {}).items() if i.fqn in kept}
    metadata.planner_data = {flat: path for flat, path in kept.values()}
    os.makedirs(out, exist_ok=True)
    for name in sorted({info.relative_path for info in metadata.storage_data.values()}):
        target = os.path.join(out, name)
        if not os.path.exists(target):
            try:
                os.link(os.path.join(src, name), target)
            except OSError:
                shutil.copy2(os.path.join(src, name), target)
    with open(os.path.join(out, ".metadata.tmp"), "wb") as f:
        pickle.dump(metadata, f)
    os.replace(os.path.join(out, ".metadata.tmp"), os.path.join(out, ".metadata"))
    return dict(Counter(path[0] if len(path) > 1 else "model" for _, path in kept.values()))
