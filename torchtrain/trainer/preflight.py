"""Preflight: every check of a job that needs no process group, and what they resolve.

The trainer runs this on every rank before starting distributed, so a bad job fails in a second
with a message naming the key instead of hanging or failing deep inside PyTorch; the planner, the
launch-time check (`launch_check.py`, run by run_train.sh and the SLURM script before torchrun) and
the tests run the same checks for any world size on one CPU process.

It resolves the job into a `ResolvedJob`: the model (spec and arguments, the job's `[model]` overrides
checked and converted), the tokenizer, and the resolved `Layout` (distributed/layout.py) that every
other part reads its decisions from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtrain.components.checkpoint.startup import imported_context_length
from torchtrain.components.checkpoint.startup import preflight as checkpoint_preflight
from torchtrain.components.evaluation.tasks import check_eval
from torchtrain.components.evaluation.validation import check_validation, check_validation_data
from torchtrain.components.observability.wandb_sink import check_wandb
from torchtrain.components.offload.runtime import check_nvme_folder
from torchtrain.config import JobConfig
from torchtrain.config.fields import ConfigError, field_types
from torchtrain.data.build import check_sources
from torchtrain.data.image.pixels import ImageSpec
from torchtrain.data.sources import CHAT, IMAGE_TEXT, PREFERENCE, check_dataset_name
from torchtrain.data.tokenizer import Tokenizer, build_tokenizer
from torchtrain.distributed.layout import Layout, resolve_layout
from torchtrain.distributed.replica_ft import check_replica_ft
from torchtrain.models.base import BaseModelArgs
from torchtrain.models.converters.lora import check_stages_have_adapters, lora_targets
from torchtrain.models.registry import ModelSpec, build_model_args, coerce_overrides, get_model_spec

PACKED = (CHAT, IMAGE_TEXT, PREFERENCE)
"""Datasets that pack several samples per row (block-causal attention); chat and image-text may hold images."""


@dataclass
class ResolvedJob:
    layout: Layout
    tokenizer: Tokenizer
    model_spec: ModelSpec
    model_args: BaseModelArgs
    image_spec: ImageSpec | None = None
    """How the job's images become patches and tokens (a vision-language model), else None."""


def image_spec_for(cfg: JobConfig, args: BaseModelArgs, tokenizer: Tokenizer) -> ImageSpec | None:
    """The job's `ImageSpec` -- the model's patch geometry, `[images]`, the tokenizer's image tokens -- with the
    token ids bound to the model's arguments; None for a model that does not see images."""
    geometry = args.image_geometry()
    if geometry is None:
        return None
    spec = ImageSpec.from_tokenizer(tokenizer, *geometry, cfg.images.min_pixels, cfg.images.max_pixels)
    args.bind_image_tokens(spec.image_pad_id, spec.vision_start_id, spec.vision_end_id)
    return spec


def resolve_model(cfg: JobConfig, tokenizer) -> tuple[ModelSpec, BaseModelArgs]:
    """The job's model spec and its arguments (flavor + overrides, adapted to the job). The overrides
    in `cfg.model` are replaced by their checked, typed values (so the saved config is typed). Chat data
    packs conversations into rows: its attention mask defaults to block-causal (a notice says so)."""
    spec = get_model_spec(cfg.model.name)
    cfg.model.overrides = coerce_overrides(spec, cfg.model.overrides, cfg.model.override_sources)
    if (cfg.training.dataset in PACKED and "attention_mask" not in cfg.model.overrides
            and "attention_mask" in field_types(spec.args_cls)):
        cfg.model.overrides["attention_mask"] = "block_causal"
        cfg.model.override_sources["attention_mask"] = f"by training.dataset = \"{cfg.training.dataset}\""
        notice = ("info", f"training.dataset = \"{cfg.training.dataset}\" packs several samples into each row: "
                          "model.attention_mask defaults to \"block_causal\" so that they do not attend to each other")
        if notice not in cfg.job.notices:
            cfg.job.notices.append(notice)
    args = build_model_args(spec, cfg.model.flavor, cfg.model.overrides)
    args.update_from_job(cfg.training.seq_len, tokenizer)
    if spec.state_dict_adapter is not None:  # the context window of the weights it starts from, kept for exports
        args.adopt_context_length(imported_context_length(cfg.checkpoint, spec.state_dict_adapter(args)))
    return spec, args


def preflight(cfg: JobConfig, world_size: int, device_type: str, tokenizer: Tokenizer | None = None) -> ResolvedJob:
    """Resolve the model, tokenizer and layout (batch plan and pipeline split included); raise ConfigError."""
    tokenizer = tokenizer or build_tokenizer(cfg.model.hf_assets_path)
    spec, args = resolve_model(cfg, tokenizer)
    image_spec = image_spec_for(cfg, args, tokenizer) if cfg.training.dataset in (CHAT, IMAGE_TEXT) else None
    layout = resolve_layout(cfg, world_size, device_type, args, spec)
    check_dataset_name(cfg.training.dataset, "training.dataset")
    if layout.lora is not None:  # every target pattern must select a linear layer (a meta model: no memory)
        with torch.device("meta"):
            targets = lora_targets(spec.build(args), layout.lora)
        if layout.pipeline is not None:
            check_stages_have_adapters(targets, layout.pipeline.modules_per_stage)
    if cfg.training.dataset in PACKED and args.attention_mask != "block_causal":
        raise ConfigError(f"[model.attention_mask] {cfg.training.dataset} data packs several samples into each row: set "
                          "model.attention_mask = \"block_causal\" so that they do not attend to each other")
    check_validation(cfg.validation, cfg.training, layout.dims.tp, layout.dims.cp)
    check_eval(cfg.eval, cfg.training.seq_len, layout.dims.tp, layout.dims.cp)
    return ResolvedJob(layout, tokenizer, spec, args, image_spec)


def check_data(cfg: JobConfig, tokenizer: Tokenizer) -> None:
    """The data checks that read no tokens and prepare nothing (`data.build.check_sources`): every
    prepared folder of the job (training and validation) by its manifest and file sizes, the mixture,
    and the inputs of a `files` dataset. They do not depend on the world size."""
    from torchtrain.posttrain.objectives import check_objective_data

    t = cfg.training
    if not check_objective_data(cfg, tokenizer):  # an objective's own data (GRPO's prompts) is checked by it
        check_sources(t.dataset, t.dataset_path, t.datasets, t.dataset_text_field, t.seq_len, tokenizer)
    check_validation_data(cfg.validation, t, tokenizer)


def check_job(cfg: JobConfig, world_size: int, device_type: str) -> ResolvedJob:
    """`preflight` plus the checkpoint folder's start-up checks, the metrics backends' packages and the
    cheap data checks (`check_data`): everything the trainer checks before its process group starts,
    except preparing document datasets and building the loader. The trainer runs it on every rank;
    `launch_check` runs it once before torchrun starts any."""
    job = preflight(cfg, world_size, device_type)
    checkpoint_preflight(cfg.checkpoint, cfg.job.dump_folder, device_type, cfg.model.name,
                         job.model_spec.state_dict_adapter is not None)
    check_wandb(cfg.metrics)
    check_replica_ft(cfg.fault)
    check_data(cfg, job.tokenizer)
    dims = job.layout.dims
    try:  # the nvme folder: writable, with room for this node's offloaded shards
        check_nvme_folder(cfg.offload, job.model_args.num_params(), cfg.optimizer.name,
                          dims.fsdp_shard_degree * dims.tp * dims.pp if job.layout.strategy.sharded else dims.tp * dims.pp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return job
