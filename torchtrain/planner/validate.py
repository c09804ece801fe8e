"""Is a layout valid, and would the trainer start it?

Both questions are answered by the trainer's own code, on the job the plan is read from (the user's
job with the planner's knobs: `from_job.py`), so the planner never keeps a second copy of a rule:

* `resolve`: the trainer's layout resolution (`distributed/layout.py::resolve_layout` with the model's
  own checks; cheap, no tokenizer) turns the job into its Layout, once, or says why the layout is
  impossible -- degrees that do not multiply to the world size, heads not divisible by the
  tensor-parallel degree, a pipeline split or schedule the trainer refuses, a global batch that is not
  a multiple of local batch x dp, a feature combination that cannot work ...;
* `runnable_problems`: everything the trainer checks before start-up (`torchtrain.trainer.preflight`: the
  above plus the tokenizer, datasets, validation settings).
"""

from __future__ import annotations

from typing import Any

from torchtrain.config import ConfigError, JobConfig
from torchtrain.distributed.layout import Layout
from torchtrain.planner.inputs import PlanInputs


def resolve(job: JobConfig, world_size: int, device_type: str, args: Any) -> tuple[Layout | None, list[str]]:
    """(the job's Layout, []) when the trainer's layout resolution accepts it, else (None, [its reason])."""
    from torchtrain.distributed.layout import resolve_layout
    from torchtrain.models.registry import get_model_spec

    try:
        job.validate()
        layout = resolve_layout(job, world_size, device_type, args, get_model_spec(job.model.name))
    except ConfigError as e:
        return None, [str(e)]
    if layout.pipeline is not None and job.model.name == "transformers":
        # the planner's traced stages are cut by the native decoders' module names (`stage_model.py`)
        return None, ["[parallelism.pipeline_parallel_degree] the planner does not model the pipeline stages of a "
                      "transformers model (the trainer runs them); plan it without pipeline parallelism"]
    return layout, []


def runnable_problems(p: PlanInputs, tokenizer: Any) -> list[str]:
    """The trainer's start-up checks (`torchtrain.trainer.preflight`) applied to the job `p` was read from,
    on its target device type ([] = the trainer would start it)."""
    from torchtrain.trainer.preflight import preflight

    if p.job is None:
        raise ValueError("runnable_problems needs PlanInputs read from a job (from_job.inputs_from_config), "
                         "not a what-if copy")
    try:
        preflight(p.job, p.world_size + (p.grpo.generator_ranks if p.grpo else 0), p.device_type, tokenizer)
    except ConfigError as e:
        return [str(e)]
    return []
