"""The `ModelSpec` of a decoder family, with the family's defaults filled in: blocks in `layers`, the
final norm compiled beside them, context parallelism supported, and the FSDP units and pipeline split
of `models/common/parallel.py` unless the family states its own."""

from __future__ import annotations

from typing import Any

from torchtrain.models.common.parallel import decoder_fsdp_units, decoder_stage_modules
from torchtrain.models.registry import ModelSpec, register_model_spec


def register_decoder(name: str, model_cls: type, args_cls: type, flavors: dict[str, Any], **hooks: Any) -> ModelSpec:
    """Register and return the spec of decoder family `name`; `hooks`: the other `ModelSpec` fields
    (`tp_plan`, `validate`, `state_dict_adapter`, and `fsdp_units` / `stage_modules` to replace the
    defaults)."""
    defaults: dict[str, Any] = dict(blocks="layers", fsdp_units=decoder_fsdp_units, stage_modules=decoder_stage_modules,
                                    compile_also=("norm",), context_parallel=True)
    spec = ModelSpec(name=name, model_cls=model_cls, args_cls=args_cls, flavors=flavors, **{**defaults, **hooks})
    register_model_spec(spec)
    return spec
