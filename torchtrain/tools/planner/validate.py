"""Is a layout valid, and would the trainer start it?

Both questions are answered by the trainer's own code, on the job config that selects the layout
(`inputs.config_variant`), so the planner never keeps a second copy of a rule:

* `layout_problems`: the layout itself is impossible -- degrees that do not multiply to the world size,
  heads not divisible by the tensor-parallel degree, a pipeline split or schedule the trainer refuses,
  a global batch that is not a multiple of local batch x dp, a feature combination that cannot work
  ... (`distributed/layout.py::resolve_layout` with the model's own checks; cheap, no tokenizer);
* `runnable_problems`: everything the trainer checks before start-up (`torchtrain.trainer.preflight`: the
  above plus the tokenizer, datasets, validation settings).
"""

from __future__ import annotations

from typing import Any

from torchtrain.config import ConfigError, JobConfig
from torchtrain.tools.planner.inputs import PlanInputs, config_variant


def layout_problems(p: PlanInputs, cfg: JobConfig) -> list[str]:
    """[] when the trainer's layout resolution accepts this layout, else its reason."""
    from torchtrain.distributed.layout import resolve_layout
    from torchtrain.models.registry import get_model_spec

    try:
        variant = config_variant(cfg, p)
        variant.validate()
        resolve_layout(variant, p.world_size, p.device_type, p.args, get_model_spec(p.model_name))
    except ConfigError as e:
        return [str(e)]
    return []


def runnable_problems(p: PlanInputs, cfg: JobConfig, tokenizer: Any) -> list[str]:
    """The trainer's start-up checks (`torchtrain.trainer.preflight`) applied to this layout on its target
    device type ([] = the trainer would start it)."""
    from torchtrain.trainer.preflight import preflight

    try:
        preflight(config_variant(cfg, p), p.world_size, p.device_type, tokenizer)
    except ConfigError as e:
        return [str(e)]
    return []
