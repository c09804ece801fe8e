"""Model registry: name -> what is the model's own, for the trainer to build and parallelise it.

A model supplies only what is specific to it (see docs/architecture.md, "Add a model"): its module
and arguments, its flavors, where its repeated blocks live, and optionally its tensor-parallel plan,
FSDP units, checks against the layout, pipeline split and Hugging Face adapter. The generic
parallelism applier (`distributed/parallelize.py`) does everything else -- the order TP ->
activation checkpointing -> compile -> FSDP/HSDP/DDP/ZeRO, precision and reshard policy -- from the
resolved Layout, so every model gets every strategy without writing any of it.

A new model plugs in by calling :func:`register_model_spec` (in its package's ``__init__.py``) and naming
that package in ``BUILTIN_FAMILIES`` (or in the job's ``job.custom_imports``); ``[model] name = "<name>"``
then works everywhere. The built-in families load on the registry's first lookup, not when
``torchtrain.models`` is imported: a module that needs one model part (a head, the base arguments) does not
import every family.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from torchtrain.config.fields import ConfigError, coerce, default_of, did_you_mean, field_docs, field_types
from torchtrain.models.base import BaseModel, BaseModelArgs
from torchtrain.models.common.decoder import SHARED_KEYS
from torchtrain.models.layout_view import LayoutView

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtrain.models.state_dict_adapter import StateDictAdapter

Layout = LayoutView
"""The resolved layout (`distributed/layout.py::Layout`) a model's checks receive, as the protocol of what they
may read of it (`models/layout_view.py`): the model registry does not depend on the distributed layout."""


@dataclass
class ModelSpec:
    """Everything model-specific. Optional hooks default to "not supported" (a config error names it)."""

    name: str
    model_cls: Callable[[BaseModelArgs], nn.Module]
    """Builds the model from its arguments (a class, or a factory returning a module)."""
    args_cls: type[BaseModelArgs]
    flavors: dict[str, BaseModelArgs]
    """Named presets of the arguments (instances of `args_cls` or of its base classes: a family's dense and
    MoE flavors; a flavor takes the `[model]` keys of its own class). Empty: the model has no presets -- its
    `[model]` keys alone describe it (e.g. a Hugging Face folder), and `model.flavor` keeps its default."""
    blocks: str = "layers"
    """Attribute (or dotted path, e.g. "model.layers") of the model holding its repeated blocks, an
    nn.ModuleDict keyed by global block index (an nn.ModuleList works when the model has no pipeline
    split). Activation checkpointing and compile apply per block; by default each block is one FSDP unit."""
    tp_plan: Callable[[nn.Module, "DeviceMesh", bool], None] | None = None
    """(model, tp_mesh, loss_parallel): shard the model's matmuls over the TP mesh (DTensor
    `parallelize_module` plans). None: tensor parallelism is unsupported for this model."""
    fsdp_units: Callable[[nn.Module], list[nn.Module | list[nn.Module]]] | None = None
    """The modules FSDP2 shards as units, in forward order (a list groups several into one unit);
    the root takes the rest. None: each block is a unit."""
    validate: Callable[[BaseModelArgs, "Layout"], None] | None = None
    """Check the model's arguments against the resolved layout (heads divisible by the TP degree...);
    raise ConfigError naming the key."""
    stage_modules: Callable[[BaseModelArgs, int, int, int], list[list[str]]] | None = None
    """Pipeline split: (args, num_stages, first_less, last_less) -> module names per stage, in model
    order. Stages are cut with `models.common.parallel.keep_modules`, so the model's top-level modules
    must tolerate being None and its blocks must live in an nn.ModuleDict."""
    state_dict_adapter: Callable[[BaseModelArgs], "StateDictAdapter"] | None = None
    """Converts weights to/from Hugging Face format (HF export/import of `[checkpoint]`): the adapter class, or a
    function of the model's arguments returning the adapter (a family whose flavors differ in kind)."""
    compile_also: tuple[str, ...] = ()
    """Top-level modules compiled beside the blocks when the model is compiled (element-wise work
    outside the blocks, e.g. the final norm before the output projection). A module that is None on
    this pipeline stage is skipped. Not applied under tensor parallelism (those modules carry the
    plan's DTensor redistribution hooks and stay eager)."""
    cheap_to_recompute: tuple[str, ...] = ()
    """Modules inside a block (names relative to the block, e.g. "attention.wkv_b") whose outputs are
    cheap to recompute and heavy to store: selective activation checkpointing "cheap" recomputes
    exactly these in backward (`distributed/activation_checkpoint.py`) and the planner sizes the
    option from the same names (`models/contract.py` ModelContract.cheap_to_recompute). Empty: the
    option is refused for this model."""
    context_parallel: bool = False
    """The model's attention is `models/common/attention.py::AttentionCore` and its forward takes
    `seq_index` (and `positions`), so context parallelism can shard its sequences."""
    compile_fullgraph: bool = True
    """Compile each block as one graph (False: Dynamo may break the graph where the block's code needs it,
    e.g. a model whose code was not written for `fullgraph`)."""
    adapt: Callable[[nn.Module, "Layout"], None] | None = None
    """The model's own changes for a layout, made first on the meta-device model (e.g. a Hugging Face MoE
    block becomes the engine's MoE layer under expert parallelism). None: none."""
    hf_weights: Callable[[BaseModelArgs], str | None] | None = None
    """A Hugging Face folder holding the model's own initial weights (safetensors), loaded at start-up
    unless a checkpoint is resumed or `checkpoint.initial_load_path` names other weights; None: none."""

    encoder_blocks: str = ""
    """Dotted path of an encoder's own repeated blocks (a vision tower's `vision_encoder.layers`), which activation
    checkpointing and compile wrap like the decoder's; empty: none."""

    def encoder_blocks_of(self, model: nn.Module) -> nn.Module | None:
        """The encoder's blocks (`encoder_blocks`), or None where this model (or pipeline stage) has none."""
        if not self.encoder_blocks:
            return None
        try:
            return model.get_submodule(self.encoder_blocks)
        except AttributeError:
            return None

    def build(self, args: BaseModelArgs) -> BaseModel:
        """The model of `args` (on the current default device); it must derive `BaseModel`, whose declarations
        the step and the sampler read."""
        model = self.model_cls(args)
        if not isinstance(model, BaseModel):
            raise TypeError(f"model {self.name!r}: {type(model).__name__} must derive torchtrain.models.base.BaseModel "
                            f"(it declares the batch entries its forward takes and whether it decodes with a cache)")
        return model

    def compiled_also_of(self, model: nn.Module) -> list[nn.Module]:
        """The modules `compile_also` names that `model` holds (a pipeline stage holds some of them, None the rest)."""
        found = []
        for name in self.compile_also:
            try:
                found.append(model.get_submodule(name))
            except AttributeError:  # (None on this stage)
                continue
        return found

    def takes_cache(self, args: BaseModelArgs) -> bool:
        """Whether the model of `args` decodes with a key/value cache (`BaseModel.takes_cache`): its class's
        declaration, or, where `model_cls` is a factory choosing the class by the arguments, the built model's (on
        the meta device)."""
        if isinstance(self.model_cls, type):
            return self.model_cls.takes_cache
        with torch.device("meta"):
            return self.build(args).takes_cache

    def blocks_of(self, model: nn.Module) -> nn.Module:
        """The model's container of repeated blocks (`blocks`)."""
        try:
            container = model.get_submodule(self.blocks)
        except AttributeError:
            container = None
        if not isinstance(container, (nn.ModuleDict, nn.ModuleList)):
            raise TypeError(f"model {self.name!r}: ModelSpec.blocks = {self.blocks!r} must name an nn.ModuleDict or "
                            f"nn.ModuleList attribute of {type(model).__name__}")
        return container


BUILTIN_FAMILIES = ("deepseek_v3", "gpt_oss", "llama3", "qwen3", "qwen3_5", "qwen3_moe", "transformers")
"""The families shipped as `torchtrain/models/<name>/`, each registering itself (`register_model_spec`) when its
package is imported; `qwen3_5` registers dense and MoE flavors, `transformers` any causal LM of that package."""

_REGISTRY: dict[str, ModelSpec] = {}
_BUILTINS_LOADED = False


def register_model_spec(spec: ModelSpec) -> None:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"model {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def _load_builtins() -> None:
    """Import (and so register) the built-in families, once."""
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        for family in BUILTIN_FAMILIES:
            importlib.import_module(f"torchtrain.models.{family}")


def get_model_spec(name: str) -> ModelSpec:
    _load_builtins()
    if name not in _REGISTRY:
        hint = did_you_mean(name, list(_REGISTRY))
        raise ConfigError(f"[model.name] unknown model {name!r}{hint} Registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def model_names() -> list[str]:
    _load_builtins()
    return list(_REGISTRY)


def coerce_overrides(spec: ModelSpec, overrides: dict[str, Any], sources: dict[str, str] | None = None,
                     args_cls: type | None = None) -> dict[str, Any]:
    """The `[model]` section's model arguments, checked against the model's argument names (those of
    `args_cls`: a flavor's own class, e.g. a family's MoE flavors, default `spec.args_cls`) and converted
    to their types (ConfigError naming an unknown key, with the closest valid one)."""
    types_ = field_types(args_cls or spec.args_cls)
    out = {}
    for key, value in overrides.items():
        if key not in types_:
            from torchtrain.config.job import Model

            valid = [f.name for f in dataclasses.fields(Model) if not f.metadata.get("internal")] + list(types_)
            where = f" ({sources[key]})" if sources and key in sources else ""
            raise ConfigError(f"unknown key model.{key}{where}{did_you_mean(key, valid)} "
                              f"Valid keys of [model] for {spec.name!r}: {', '.join(valid)}")
        out[key] = coerce(value, types_[key], f"model.{key}")
    return out


def build_model_args(spec: ModelSpec, flavor: str, overrides: dict[str, Any],
                     sources: dict[str, str] | None = None) -> BaseModelArgs:
    """The flavor preset with the job's `[model]` overrides applied, validated. A model without presets
    (`ModelSpec.flavors` empty) starts from its arguments' defaults and takes no other flavor."""
    if not spec.flavors:
        from torchtrain.config.job import Model

        if flavor != default_of(next(f for f in dataclasses.fields(Model) if f.name == "flavor")):
            raise ConfigError(f"[model.flavor] {spec.name} has no flavors: its [model] keys describe the model; "
                              f"leave model.flavor unset")
        args = spec.args_cls().replace(**coerce_overrides(spec, overrides, sources))
        args.validate()
        return args
    if flavor not in spec.flavors:
        hint = did_you_mean(flavor, list(spec.flavors))
        raise ConfigError(
            f"[model.flavor] {spec.name} has no flavor {flavor!r}{hint} Flavors: {', '.join(spec.flavors)}"
        )
    base = spec.flavors[flavor]
    args = base.replace(**coerce_overrides(spec, overrides, sources, type(base)))
    args.validate()
    return args


def model_arguments(name: str) -> list[tuple[str, Any, Any, str]]:
    """(key, type, default, doc) of every argument of model `name`, for `--help`: the family's own first, then the
    keys every decoder shares (`models/common/decoder.py::DecoderArgs`, declared before them)."""
    spec = get_model_spec(name)
    types_, docs = field_types(spec.args_cls), field_docs(spec.args_cls)
    ordered = sorted(dataclasses.fields(spec.args_cls), key=lambda f: f.name in SHARED_KEYS)
    return [(f.name, types_[f.name], default_of(f), docs.get(f.name, "")) for f in ordered]


# ------------------------------------------------------------------------------ what a checkpoint records
def args_classes(spec: ModelSpec) -> dict[str, type[BaseModelArgs]]:
    """Every class of arguments the family builds from, by name: its registered class and its flavors' own
    (a family's dense and MoE flavors are different classes)."""
    classes = {spec.args_cls.__name__: spec.args_cls}
    for flavor in spec.flavors.values():
        classes.setdefault(type(flavor).__name__, type(flavor))
    return classes


def model_record(name: str, flavor: str, args: BaseModelArgs) -> dict[str, Any]:
    """What a checkpoint or an export records of its model (`complete.json`'s "model"): the family, the flavor, the
    class of its arguments ("kind") and every argument; `model_from_record` rebuilds exactly that model."""
    return {"name": name, "flavor": flavor, "kind": type(args).__name__, "args": dataclasses.asdict(args)}


def model_from_record(record: dict[str, Any]) -> tuple[ModelSpec, BaseModelArgs]:
    """The family and arguments a checkpoint recorded (`model_record`), rebuilt with the class it was saved with --
    never the family's default class (a dense Qwen3.5 stays dense). A record written before "kind" existed takes
    its flavor's class, else the family's class whose arguments are exactly the recorded ones."""
    spec = get_model_spec(record["name"])
    saved = dict(record["args"])
    classes = args_classes(spec)
    cls = classes.get(record.get("kind", ""))
    if cls is None:
        flavor = spec.flavors.get(record.get("flavor", ""))
        by_fields = [c for c in classes.values() if {f.name for f in dataclasses.fields(c)} == set(saved)]
        cls = (type(flavor) if flavor is not None and type(flavor) in by_fields
               else by_fields[0] if by_fields else spec.args_cls)
    types_ = field_types(cls)
    unknown = sorted(set(saved) - set(types_))
    if unknown:
        raise ConfigError(f"the checkpoint's model record has arguments {cls.__name__} does not know: "
                          f"{', '.join(unknown)} (saved by another version of torchtrain?)")
    values = {k: coerce(v, types_[k], f"model.{k}") for k, v in saved.items()}
    return spec, cls(**{k: tuple(v) if typing.get_origin(types_[k]) is tuple else v for k, v in values.items()})


def args_differences(saved: dict[str, Any], args: BaseModelArgs) -> dict[str, tuple[Any, Any]]:
    """key -> (recorded, now) of every argument a record (`model_record`'s "args", read back from JSON) holds with
    another value than `args` (a tuple and the list JSON made of it are the same value)."""
    now = json.loads(json.dumps(dataclasses.asdict(args)))
    return {k: (saved[k], now[k]) for k in saved.keys() & now.keys() if saved[k] != now[k]}
