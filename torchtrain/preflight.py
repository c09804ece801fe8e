"""Preflight: every check of a job that needs no process group, and what they resolve.

The trainer runs this on every rank before starting distributed, so a bad job fails in a second
with a message naming the key instead of hanging or failing deep inside PyTorch; the planner and
the tests run the same checks for any world size on one CPU process.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.components.tokenizer import Tokenizer, build_tokenizer
from torchtrain.components.validation import check_validation_layout
from torchtrain.config import BatchPlan, JobConfig, resolve_batch
from torchtrain.distributed.checks import check_layout
from torchtrain.distributed.parallel_dims import ParallelDims
from torchtrain.distributed.pipeline import PipelinePlan, plan_pipeline, validate_combination
from torchtrain.models.base import BaseModelArgs
from torchtrain.models.registry import ModelSpec, build_model_args, get_model_spec


@dataclass
class Preflight:
    parallel_dims: ParallelDims
    batch: BatchPlan
    tokenizer: Tokenizer
    model_spec: ModelSpec
    model_args: BaseModelArgs
    pp_plan: PipelinePlan | None


def preflight(cfg: JobConfig, world_size: int, device_type: str, tokenizer: Tokenizer | None = None) -> Preflight:
    """Resolve the layout, batch, tokenizer, model arguments and pipeline plan; raise ConfigError."""
    pd = ParallelDims.from_config(cfg.parallelism, world_size)
    batch = resolve_batch(cfg.training, pd.dp)
    tokenizer = tokenizer or build_tokenizer(cfg.model.hf_assets_path)
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model.flavor, cfg.model.overrides)
    args.update_from_config(cfg, tokenizer)
    if spec.validate_fn is not None:
        spec.validate_fn(args, pd, cfg)
    check_layout(cfg, pd, device_type)
    validate_combination(cfg, pd)
    check_validation_layout(cfg, pd)
    pp_plan = None
    if pd.pp_enabled:
        local_sequences = batch.local_batch_size * batch.grad_accum_steps
        pp_plan = plan_pipeline(cfg, pd, args, spec.stage_modules_fn, local_sequences)
    return Preflight(pd, batch, tokenizer, spec, args, pp_plan)
