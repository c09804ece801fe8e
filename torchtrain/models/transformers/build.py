"""Building a transformers model as a torchtrain model: `Torchtrain<Class>`, the class transformers maps the
folder's config to with torchtrain's mixin first in its method order -- `model.py::TorchtrainCausalLM` for a
causal LM, `vision_language.py::TorchtrainImageTextLM` for a composite vision-language config -- and the
model of a job's arguments (`build_model`)."""

from __future__ import annotations

from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.models.transformers import attention, linear_attention
from torchtrain.models.transformers.args import TransformersArgs, hf_class, import_transformers, is_composite
from torchtrain.models.transformers.model import TorchtrainCausalLM
from torchtrain.models.transformers.stages import index_layers
from torchtrain.models.transformers.vision_language import TorchtrainImageTextLM, attach_scatter

_CLASSES: dict[type, type] = {}


def model_class(config) -> type:
    """`Torchtrain<Class>` for the class transformers maps `config` to (one per class): its causal LM, or for a
    composite vision-language config its image-text-to-text class (`vision_language.py`)."""
    base = hf_class(config)
    if base not in _CLASSES:
        mixin = TorchtrainImageTextLM if is_composite(config) else TorchtrainCausalLM
        _CLASSES[base] = type(f"Torchtrain{base.__name__}", (mixin, base),
                              {"__module__": base.__module__, "__doc__": mixin.__doc__})
    return _CLASSES[base]


def build_model(args: TransformersArgs) -> nn.Module:
    """The model of `args` (on the current default device: the trainer builds it on meta)."""
    import_transformers()
    attention.register()
    config = args.config
    cls = model_class(config)
    registry = attention.uses_registry(cls)
    if registry:  # the text model's attention (a vision tower keeps transformers' own, non-causal)
        config.get_text_config()._attn_implementation = attention.IMPLEMENTATION
    model = cls(config)
    if not isinstance(getattr(model.text_model, "layers", None), nn.ModuleList):
        raise ConfigError(f"[model.hf_path] model type {config.model_type!r}: its decoder layers are not the base "
                          f"model's `layers` (transformers' decoder layout, which its tensor-parallel plan names too)")
    if is_composite(config):
        attach_scatter(model)
    model.tie_weights()  # tied input and output embeddings share one parameter, as transformers loads them
    index_layers(model)  # layers keyed by their global index: names that survive a pipeline cut
    linear_attention.swap_layers(model)  # Gated DeltaNet layers as the engine's (TP, CP and documents reach them)
    model.tt_setup(args, registry)
    return model
