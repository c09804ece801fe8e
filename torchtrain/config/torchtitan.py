"""torchtitan v0.2.x job files, read unchanged (docs/migrating_from_torchtitan.md).

torchtrain's keys are torchtitan's wherever the feature is the same, so most of a torchtitan TOML file
already is a torchtrain job. This module adapts the rest of it, on the raw values, before the
sections are built (`manager.parse_args`):

* **same meaning, other spelling** -- translated silently: `[fault_tolerance]` (torchft replica
  groups) becomes `[fault]`'s replica keys; `expert_tensor_parallel_degree = 1` is what torchtrain
  always does; torchtitan's flavor names that torchtrain files under another model or spells with an
  argument (`qwen3` / `debugmodel_moe` is `qwen3_moe` / `debugmodel`; `debugmodel_flex_attn` is
  `debugmodel` with `attention_mask = "block_causal"`) become that model, flavor and argument;
* **no equivalent** -- accepted and dropped with one notice each, naming the key and saying what
  torchtrain does instead, including where that changes the math (DiLoCo's semi-synchronous
  replicas, flux's diffusion-only keys).

Dataset names `c4`, `c4_test` and `c4_validation` are datasets of their own (`data/hf.py`),
and `hf_assets_path` already has torchtitan's meaning. The notices are returned to the caller, which
keeps them on the config (`job.notices`); the trainer logs them once, on the log rank.
"""

from __future__ import annotations

from typing import Any

# torchtitan sections / keys of its flux (diffusion) model and its VLM experiment: torchtrain trains
# language models only, and refuses model.name = "flux" on its own.
_DIFFUSION = "belongs to torchtitan's diffusion (flux) model, which torchtrain does not have; ignored"
IGNORED_SECTIONS = {"encoder": _DIFFUSION, "inference": _DIFFUSION,
                    "data": "belongs to torchtitan's VLM experiment (images per batch); ignored"}

IGNORED_KEYS = {
    "metrics.disable_color_printing": "torchtrain's console log has no colours; ignored",
    "training.classifier_free_guidance_prob": _DIFFUSION,
    "training.img_size": _DIFFUSION,
    "validation.all_timesteps": _DIFFUSION,
    "validation.classifier_free_guidance_scale": _DIFFUSION,
    "validation.denoising_steps": _DIFFUSION,
    "validation.enable_classifier_free_guidance": _DIFFUSION,
    "validation.save_img_count": _DIFFUSION,
    "validation.save_img_folder": _DIFFUSION,
}

# torchtitan's sections that torchtrain has not: adapted (fault_tolerance) or dropped here
SECTIONS = (*IGNORED_SECTIONS, "fault_tolerance")

# job.custom_config_module: torchtitan extends its config with a Python module; the ones its shipped
# files name are handled here (fault_tolerance) or belong to models torchtrain does not have.
KNOWN_CONFIG_MODULES = ("torchtitan.components.ft.config", "torchtitan.models.flux.job_config",
                        "torchtitan.experiments.vlm.job_config")

# (torchtitan model, flavor) -> (torchtrain model, flavor, model arguments set by the name)
FLAVOR_ALIASES: dict[tuple[str, str], tuple[str, str, dict[str, Any]]] = {
    ("qwen3", "debugmodel_moe"): ("qwen3_moe", "debugmodel", {}),
    ("qwen3", "30B-A3B"): ("qwen3_moe", "30B-A3B", {}),
    ("qwen3", "235B-A22B"): ("qwen3_moe", "235B-A22B", {}),
    ("llama3", "debugmodel_flex_attn"): ("llama3", "debugmodel", {"attention_mask": "block_causal"}),
    ("llama3", "debugmodel_varlen_attn"): ("llama3", "debugmodel", {"attention_mask": "block_causal"}),
    ("llama3", "8B_flex"): ("llama3", "8B", {"attention_mask": "block_causal"}),
    ("llama3", "8B_varlen"): ("llama3", "8B", {"attention_mask": "block_causal"}),
    ("deepseek_v3", "debugmodel_flex_attn"): ("deepseek_v3", "debugmodel", {"attention_mask": "block_causal"}),
}


def _fault_tolerance(table: dict[str, Any], merged: dict[str, dict[str, Any]], note) -> None:
    """torchtitan's [fault_tolerance] (torchft) -> [fault]'s replica-group keys."""
    fault = merged.setdefault("fault", {})
    renamed = {"enable": "replica_ft", "replica_id": "replica_id", "min_replica_size": "min_replica_groups"}
    for key, value in table.items():
        where = f"fault_tolerance.{key}"
        if key in renamed:
            fault.setdefault(renamed[key], value)
        elif key == "process_group_timeout_ms":
            fault.setdefault("replica_timeout_s", float(value) / 1000.0)
        elif key == "semi_sync_method":
            if value:
                note(f"{where} = {value!r}: torchtrain's replica groups synchronise their gradients at every "
                     f"step (plain HSDP), not semi-synchronously: the training math differs from {value}'s")
        elif key in ("sync_steps", "num_fragments", "should_quantize", "fragment_sync_delay",
                     "fragment_update_alpha"):
            if table.get("semi_sync_method"):
                note(f"{where} = {value!r}: a setting of semi-synchronous training, which torchtrain does not do; "
                     f"ignored")
        elif key == "process_group":
            note(f"{where} = {value!r}: the replica groups use the job's own backend (comm.backend); ignored")
        elif key == "group_size":  # torchtitan: the number of replica groups, each its own launch
            parallelism = merged.setdefault("parallelism", {})
            if str(parallelism.get("data_parallel_replicate_degree", 1)) not in ("1", "-1"):
                note(f"{where} = {value!r} with parallelism.data_parallel_replicate_degree = "
                     f"{parallelism['data_parallel_replicate_degree']}: torchtrain's replica groups are the "
                     f"data_parallel_replicate_degree, so it becomes {value} (HSDP inside a group is not kept)")
            parallelism["data_parallel_replicate_degree"] = value
        else:
            note(f"{where} = {value!r}: torchft setting without a torchtrain equivalent; ignored")


def _model_alias(model: dict[str, Any], origin: dict[str, str], note) -> None:
    name, flavor = model.get("name", "llama3"), model.get("flavor")
    if not (isinstance(name, str) and isinstance(flavor, str)):
        return  # a value of the wrong type: reported by the [model] section's type check
    alias = FLAVOR_ALIASES.get((name, flavor))
    if alias is None:
        return
    new_name, new_flavor, args = alias
    model["name"], model["flavor"] = new_name, new_flavor
    for key, value in args.items():
        if key not in model:
            model[key] = value
            origin[key] = f"from torchtitan's flavor name {flavor!r}"
    extra = "".join(f", {k} = {v!r}" for k, v in args.items())
    note(f"model {name!r} flavor {flavor!r} (torchtitan's name) is torchtrain's model {new_name!r} flavor "
         f"{new_flavor!r}{extra}", level="info")


_ABSENT = object()


def _pop(merged: dict[str, dict[str, Any]], origin: dict[str, dict[str, str]], section: str,
         key: str | None = None) -> Any:
    """Remove a raw section (`key` None) or one key, and the record of where it came from; _ABSENT when
    the job does not have it."""
    if key is None:
        origin.pop(section, None)
        return merged.pop(section, _ABSENT)
    origin.get(section, {}).pop(key, None)
    return merged.get(section, {}).pop(key, _ABSENT)


def translate(merged: dict[str, dict[str, Any]], origin: dict[str, dict[str, str]]) -> list[tuple[str, str]]:
    """Adapt the raw job values (file overlaid by the command line) in place; returns the notices as
    (level, text): "info" for a translation, "warning" for a key torchtrain does not act on."""
    notices: list[tuple[str, str]] = []

    def note(text: str, level: str = "warning") -> None:
        notices.append((level, f"torchtitan job key: {text}"))

    for section, reason in IGNORED_SECTIONS.items():
        table = _pop(merged, origin, section)
        if table is not _ABSENT:
            note(f"[{section}] ({', '.join(table)}) {reason}")
    table = _pop(merged, origin, "fault_tolerance")
    if table is not _ABSENT:
        _fault_tolerance(table, merged, note)
        for section in ("fault", "parallelism"):
            origin.setdefault(section, {}).update({k: "from [fault_tolerance]" for k in merged.get(section, {})
                                                   if k not in origin[section]})
    for dotted, reason in IGNORED_KEYS.items():
        value = _pop(merged, origin, *dotted.split("."))
        if value is not _ABSENT:
            note(f"{dotted} = {value!r} {reason}")
    module = _pop(merged, origin, "job", "custom_config_module")
    if module is not _ABSENT and module not in KNOWN_CONFIG_MODULES:
        note(f"job.custom_config_module = {module!r}: torchtrain's config is not extended by Python modules "
             f"(job.custom_imports registers models and datasets); its keys, if any, are refused as unknown")
    etp = _pop(merged, origin, "parallelism", "expert_tensor_parallel_degree")
    if etp is not _ABSENT and str(etp) != "1":
        note(f"parallelism.expert_tensor_parallel_degree = {etp}: torchtrain does not shard experts with tensor "
             f"parallelism; the expert-parallel group takes whole TP groups instead (torchtitan's 1): the same "
             f"math, other memory and communication (docs/moe.md)")
    if "model" in merged:
        _model_alias(merged["model"], origin.setdefault("model", {}), note)
    return notices
