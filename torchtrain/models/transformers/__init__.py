"""Any causal language model of the installed transformers, trained by the engine (docs/transformers.md):
`--model.name transformers --model.hf_path DIR`, DIR a local folder with a Hugging Face config.json
(optionally safetensors weights and a tokenizer); a composite vision-language config of a type the backend
trains (`vision_language.py`) sees images. Registered as "transformers"; it has no flavors -- the folder
describes the model."""

from __future__ import annotations

import glob
import os

from torchtrain.models.registry import ModelSpec, register_model_spec
from torchtrain.models.transformers import declare  # noqa: F401  (registers the planner's contract)
from torchtrain.models.transformers.args import TransformersArgs
from torchtrain.models.transformers.build import build_model
from torchtrain.models.transformers.parallelize import adapt, apply_tp, fsdp_units, stage_modules, validate
from torchtrain.models.transformers.state_dict_adapter import TransformersStateDictAdapter


def weights_folder(args: TransformersArgs) -> str | None:
    """The model folder when it holds safetensors weights (the initial load)."""
    return args.hf_path if glob.glob(os.path.join(args.hf_path, "*.safetensors")) else None


SPEC = ModelSpec(name="transformers", model_cls=build_model, args_cls=TransformersArgs, flavors={},
                 blocks="decoder_layers", tp_plan=apply_tp, fsdp_units=fsdp_units, validate=validate,
                 stage_modules=stage_modules,
                 state_dict_adapter=TransformersStateDictAdapter, context_parallel=True, compile_fullgraph=False,
                 adapt=adapt, hf_weights=weights_folder, encoder_blocks="model.visual.blocks")
register_model_spec(SPEC)

__all__ = ["SPEC", "TransformersArgs", "TransformersStateDictAdapter", "build_model"]
