"""Pipeline parallelism of a transformers model: stages split by decoder layers, each stage running
transformers' own forward over the modules it holds.

* **Names that survive the cut**: the base model's decoder layers are held in an `IndexedLayers` (a
  ModuleDict keyed by the global layer index that iterates, indexes and slices like the ModuleList
  transformers' code expects), so a stage keeping layers 4..7 still names them `model.layers.4` ...: the
  initialisation, checkpoints and Hugging Face names stay those of the whole model.
* **The split** (`stage_modules`): the first stage holds the input embedding, the last the base model's
  final norm(s) and the output head, the decoder layers are divided in order in between (the decoder
  family's rule, `models/common/parallel.py::block_stages`); modules without parameters (the
  rotary table) stay on every stage.
* **A stage's forward**: transformers' forward with what the stage lacks made the identity
  (`fill_stage`): a later stage receives the previous stage's hidden states as `inputs_embeds`, a stage
  before the last returns its hidden states through an identity norm and head.

That is exact only for models whose forward does nothing else to the embeddings before the first layer or
to the hidden states after the last (Gemma scales the embeddings inside its forward, Granite and Cohere
scale the logits, Gemma 2 soft-caps them): every stage would apply it again. So pipeline parallelism is
checked once per model type on a small copy (`check_pipelinable`: two stages against the whole model) and
refused with a config error naming the model type where they differ.
"""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import torch
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.parallel import block_stages
from torchtrain.models.transformers import attention
from torchtrain.models.transformers.args import small_config
from torchtrain.models.transformers.build import model_class
from torchtrain.models.transformers.stages import fill_stage, index_layers
from torchtrain.models.transformers.tp_plan import name_of

TOLERANCE = 1e-5


def stage_modules(model: nn.Module, num_stages: int, first_less: int = 0, last_less: int = 0) -> list[list[str]]:
    """Module names per stage (module doc); `model` the whole model (on the meta device)."""
    base = model.base_model_prefix
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    top = [f"{base}.{name}" for name, _ in model.top_modules()]
    stages = []
    for i, names in enumerate(block_stages(len(model.decoder_layers), num_stages, first_less, last_less)):
        own = [f"{base}.{n}" for n in names]
        if i == 0:
            own.insert(0, f"{base}.{name_of(model.base_model, embed)}")
        if i == num_stages - 1:
            own += top + [name_of(model, head)]
        stages.append(own)
    return stages


@functools.lru_cache(maxsize=8)
def _pipelinable(config_cls: type, config_json: str, kind: str) -> str | None:
    """Why two pipeline stages of a small copy of the model differ from the whole model (None: they agree)."""
    from torchtrain.models.common.parallel import keep_modules

    config = config_cls.from_dict(json.loads(config_json))
    cls = model_class(config)
    registry = attention.uses_registry(cls)  # as in training: torchtrain's attention where the model takes it
    if registry:
        attention.register()
        config._attn_implementation = attention.IMPLEMENTATION
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            model = cls(config).float().eval()
        except Exception as e:  # noqa: BLE001 - any model code
            return f"its model could not be built for the check ({e})"
        index_layers(model)
        model.tt_setup(SimpleNamespace(attention_mask="causal"), registry)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        tokens = torch.randint(0, config.vocab_size, (2, 8))
        stages = [keep_modules(model, names) for names in stage_modules(model, 2)]
        for stage in stages:
            fill_stage(stage)
        with torch.no_grad():
            whole = model(tokens)
            staged = stages[1](stages[0](tokens))
    if staged.shape != whole.shape or (staged - whole).abs().max().item() > TOLERANCE * max(
            1.0, whole.abs().max().item()):
        return "its forward transforms the embeddings or the logits beyond its layers, which every stage would repeat"
    return None


def check_pipelinable(args) -> None:
    """ConfigError when the model type cannot be cut into pipeline stages exactly (module doc)."""
    kind = args.model_type
    if args.tie_word_embeddings:
        raise ConfigError(f"[parallelism.pipeline_parallel_degree] model type {kind!r} ties its input and output "
                          f"embeddings ({args.hf_path}/config.json), which would live on the first and the last "
                          f"stage; set pipeline_parallel_degree = 1")
    config = small_config(args, layers=2)
    why = _pipelinable(type(config), config.to_json_string(use_diff=False), kind)
    if why is not None:
        raise ConfigError(f"[parallelism.pipeline_parallel_degree] model type {kind!r}: {why}; set "
                          f"pipeline_parallel_degree = 1")
