"""The tensor-parallel plan a transformers model declares (`config.base_model_tp_plan`: module name ->
style name, e.g. "layers.*.self_attn.q_proj": "colwise"), translated to DTensor parallel styles.

Block entries ("layers.*.<name>") become one decoder layer's plan, each style name translated by
`utils/tp_styles.py` (column- and row-parallel projections, "replicated_with_grad_allreduce" for norms on
head shards), and:

* "local_rowwise" on a parameter (not a module): split on its first dimension, read as this rank's
  slice (`models/common/tp.py::LocalShards`): per-head vectors beside column-parallel heads (gpt-oss's
  attention sinks).

Where transformers declares less than a model type needs (gpt-oss's plan names only its embedding since
transformers 5), `COMPLETED` states the rest in the same vocabulary, for model types checked against
one process; the declared entries win over it.

An "embedding_rowwise" entry for the input embedding agrees with what the engine does to it anyway
(vocabulary-parallel); every other style (packed expert layouts, MLA's, ...) has no DTensor translation
here and is refused with a ConfigError naming the model type, the entry and the layout. The model's
top -- embedding (vocabulary rows split), final norm and output head (column-parallel over the
vocabulary, loss-parallel logits when the layout says so) -- is the decoder family's, as in
`distributed/tensor_parallel.py::apply_decoder_top`.

**Sequence parallelism** applies where the plan allows it (`sequence_parallel_problem`): every module
the plan reaches into (a layer's attention, its MLP) ends in a row-parallel projection, and every other
parameter of the layer sits on the residual stream in a norm (vectors only). Then the residual stream
and the norms work on sequence shards (`SequenceParallel`), each planned module gathers its input over
the sequence first (`GatherSequence`) and its row-parallel projection reduce-scatters into sequence
shards. Otherwise the plan runs without it: activations between the planned modules are whole on every
TP rank (one all-reduce per row-parallel projection).
"""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.tp import LocalShards
from torchtrain.utils import tp_styles
from torchtrain.utils.logging import logger

BLOCK = "layers.*."
ROW, COL = tp_styles.ROW, tp_styles.COLUMN
GRAD_SUM = ("replicated_with_grad_allreduce",)
EMBEDDING = ("embedding_rowwise",)
PARAM = ("local_rowwise",)

COMPLETED: dict[str, dict[str, str]] = {
    "gpt_oss": {f"{BLOCK}self_attn.{name}": style for name, style in (
        ("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"), ("o_proj", "rowwise"),
        ("sinks", "local_rowwise"))},
}
"""Block entries torchtrain adds to a model type's declared plan (module doc)."""


class GatherSequence(PrepareModuleInput):
    """A module's hidden states -- its first positional input, or its `hidden_states` keyword (transformers
    layers call their attention by keyword and their MLP positionally) -- gathered over the sequence: from
    `Shard(1)` to a replicated DTensor, whose gradient is reduce-scattered back in backward."""

    def __init__(self):
        super().__init__(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return x.redistribute(device_mesh, (Replicate(),))

        def hook(_module, args, kwargs):
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            raise RuntimeError(f"{type(_module).__name__} got neither a positional input nor hidden_states")

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def declared(config) -> dict[str, str]:
    """The model's plan: what its (text model's) config declares, completed by `COMPLETED`."""
    config = config.get_text_config()
    return {**COMPLETED.get(config.model_type, {}), **(getattr(config, "base_model_tp_plan", None) or {})}


def block_entries(config) -> dict[str, str]:
    """The plan of one decoder layer: module name relative to the layer -> declared style name."""
    return {name[len(BLOCK):]: style for name, style in declared(config).items() if name.startswith(BLOCK)}


def check_translatable(config, skip: tuple[str, ...] = ()) -> None:
    """ConfigError naming the first entry of the declared plan that has no translation (`skip`: block
    module prefixes the engine replaces, e.g. an MoE block it swaps for its own layer)."""
    kind = config.model_type
    plan = declared(config)
    if not plan:
        raise ConfigError(f"[parallelism.tensor_parallel_degree] model type {kind!r} declares no tensor-parallel plan "
                          f"(config.base_model_tp_plan); set tensor_parallel_degree = 1")
    for name, style in plan.items():
        inner = name[len(BLOCK):] if name.startswith(BLOCK) else None
        if inner is not None and any(inner == s or inner.startswith(s + ".") for s in skip):
            continue
        known = ROW + COL + GRAD_SUM + PARAM if inner is not None else EMBEDDING
        if style not in known:
            raise ConfigError(f"[parallelism.tensor_parallel_degree] model type {kind!r}: its tensor-parallel plan "
                              f"entry {name!r}: {style!r} has no translation in torchtrain (it translates "
                              f"{', '.join(ROW + COL + GRAD_SUM)}); set tensor_parallel_degree = 1")


def _containers(entries: dict[str, str]) -> set[str]:
    return {name.split(".")[0] for name in entries}


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
        return True
    except AttributeError:
        return False


def layer_entries(layer: nn.Module, config, own: set[str] = frozenset()) -> dict[str, str]:
    """The declared block entries of modules present in this layer (an MoE model's dense layers lack its
    expert modules, its MoE layers its dense MLP's), without those under `own` (children the engine plans
    itself)."""
    return {n: s for n, s in block_entries(config).items()
            if n.split(".")[0] not in own and s not in PARAM and _has(layer, n)}


def param_entries(layer: nn.Module, config) -> dict[str, str]:
    """The declared block entries of parameters present in this layer ("local_rowwise")."""
    entries = {}
    for name, style in block_entries(config).items():
        owner, _, param = name.rpartition(".")
        if style in PARAM and _has(layer, owner) and isinstance(getattr(layer.get_submodule(owner), param, None),
                                                                   nn.Parameter):
            entries[name] = style
    return entries


def sequence_parallel_problem(layer: nn.Module, entries: dict[str, str], own: set[str] = frozenset()) -> str | None:
    """Why sequence parallelism does not fit a layer with this plan, or None when it does (module doc);
    `own`: children the engine plans itself (with sequence parallelism)."""
    containers = _containers(entries)
    for c in sorted(containers):
        inner = {n: s for n, s in entries.items() if n.split(".")[0] == c}
        if c in inner:
            return f"the plan shards {c} itself"
        if not any(s in ROW for s in inner.values()):
            return f"{c} has no row-parallel projection"
    for name, child in layer.named_children():
        if name not in containers | set(own) and any(p.dim() != 1 for p in child.parameters()):
            return f"{name} ({type(child).__name__}) holds weights outside the plan"
    return None


def layer_plan(layer: nn.Module, entries: dict[str, str], sp: bool, own: dict[str, object]) -> dict[str, object]:
    """DTensor styles of one decoder layer (module names relative to it); `own`: the engine's styles of
    the children it plans itself."""
    plan: dict[str, object] = {name: tp_styles.translate(s, sp) for name, s in entries.items()}
    if sp:
        containers, owned = _containers(entries), _containers(own)
        for name, child in layer.named_children():
            if name in containers:
                plan[name] = GatherSequence()
            elif name not in owned and any(True for _ in child.parameters()):
                plan[name] = SequenceParallel(use_local_output=True)
    return {**plan, **own}


def name_of(root: nn.Module, module: nn.Module) -> str:
    """The name of `module` within `root`."""
    return next(name for name, m in root.named_modules() if m is module)


def top_plan(model: nn.Module, sp: bool, loss_parallel: bool) -> tuple[dict[str, object], dict[str, object]]:
    """(styles relative to the text model: embedding and final norms; styles relative to the model: head, and a
    vision-language model's `image_scatter`, after which the embeddings are cut into sequence shards)."""
    base = model.text_model
    embed = model.get_input_embeddings()
    scatter = model.scatter_module()
    cut = sp and scatter is None  # the embedding's output is cut, or left whole for the images to join it
    base_plan: dict[str, object] = {name_of(base, embed): RowwiseParallel(input_layouts=Replicate(),
                                                                           output_layouts=Shard(1) if cut else Replicate())}
    if sp:
        for name, _ in model.top_modules():
            base_plan[name] = SequenceParallel(use_local_output=True)
    head = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                           output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel)
    model_plan: dict[str, object] = {name_of(model, model.get_output_embeddings()): head}
    if sp and scatter is not None:
        model_plan["image_scatter"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    return base_plan, model_plan


OwnStyles = Callable[[nn.Module], dict[str, object]]
"""A layer -> the engine's TP styles of the children it planned itself (names relative to the layer)."""


def model_sp_problem(model: nn.Module, own: OwnStyles | None = None) -> str | None:
    """`sequence_parallel_problem` over every layer (the first problem found), and the model's top: the
    base model's other children with weights must be norms."""
    for layer in model.decoder_layers:
        owned = _containers(own(layer)) if own is not None else set()
        problem = sequence_parallel_problem(layer, layer_entries(layer, model.config, owned), owned)
        if problem is not None:
            return problem
    for name, child in model.top_modules():
        if any(p.dim() != 1 for p in child.parameters()):
            return f"the base model's {name} holds weights outside the plan"
    return None


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, own: OwnStyles | None = None) -> None:
    """Shard `model` over `tp_mesh` as its declared plan says (module doc); `own`: the styles of modules the
    engine swapped in (they need sequence parallelism, which the model's checks made sure of)."""
    problem = model_sp_problem(model, own)
    sp = problem is None
    logger.info("tensor parallelism of model type %s from its declared plan, %s%s", model.config.model_type,
                "with sequence parallelism" if sp else f"without sequence parallelism ({problem})",
                "; its vision tower (no plan declared) replicated on every TP rank"
                if model.scatter_module() is not None else "")
    base_plan, head_plan = top_plan(model, sp, loss_parallel)
    parallelize_module(model.text_model, tp_mesh, base_plan)
    parallelize_module(model, tp_mesh, head_plan)
    for layer in model.decoder_layers:
        styles = own(layer) if own is not None else {}
        entries = layer_entries(layer, model.config, _containers(styles))
        parallelize_module(layer, tp_mesh, layer_plan(layer, entries, sp, styles))
        for name in param_entries(layer, model.config):
            owner, _, param = name.rpartition(".")
            parallelize_module(layer.get_submodule(owner), tp_mesh, LocalShards(0, (param,)))
