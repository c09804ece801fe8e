"""What the engine's one applier (`distributed/parallelize.py`) needs of a transformers model, read from
what the model declares: its checks against the layout, its tensor-parallel plan (`tp_plan.py`), its
FSDP units (a vision tower's blocks and the rest of it, the embedding, each decoder layer, the final norm
with the output head) and, under expert parallelism, its MoE blocks swapped for the engine's MoE layer
(`moe.py`).

Pipeline parallelism cuts the model by decoder layers (`pipeline.py`). Layouts refused, each with one
ConfigError naming the model type and the layout: pipeline parallelism of a model whose forward does more
than its layers to the embeddings or logits (`pipeline.py::check_pipelinable`), context parallelism and block-causal masks for a model
whose attention does not go through transformers' attention-function registry, tensor parallelism for
a model without a plan or with an entry that has no DTensor translation, tied embeddings under tensor
parallelism, an MoE model under tensor parallelism without expert parallelism, and pipeline or expert
parallelism of a vision-language model (`vision_language.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.models.registry import Layout
from torchtrain.models.transformers import linear_attention, moe, pipeline, stages, tp_plan
from torchtrain.models.transformers.args import TransformersArgs
from torchtrain.models.transformers.attention import uses_registry
from torchtrain.models.transformers.build import build_model, model_class

_META: dict[str, nn.Module] = {}


def meta_model(args: TransformersArgs) -> nn.Module:
    """The model on the meta device (a few kept, by arguments; for checks and the planner only: do not
    modify)."""
    key = f"{args!r}@{args.config_mtime()}"
    if key not in _META:
        if len(_META) >= 4:
            _META.pop(next(iter(_META)))
        with torch.device("meta"):
            _META[key] = build_model(args)
    return _META[key]


def own_styles(layer: nn.Module) -> dict[str, object]:
    """TP styles of the modules the engine swapped into a layer: MoE blocks (`moe.py`), linear attention
    (`linear_attention.py`)."""
    return {**moe.own_styles(layer), **linear_attention.own_styles(layer)}


def recurrent_mixers(model: nn.Module) -> list[str]:
    """Class names of the decoder layers' token mixers that carry a recurrent state over the sequence instead of
    attending through the registry (linear attention: Qwen3.5's and Qwen3-Next's Gated DeltaNet, Mamba-style
    layers): they see neither context parallelism's shards nor block-causal documents."""
    names = set()
    for layer in model.decoder_layers:
        # the engine's layers (and what they hold): documents and context parallelism reach them
        engines = {id(m) for e in layer.modules() if isinstance(e, linear_attention.TransformersGatedDeltaNet)
                   for m in e.modules()}
        for module in layer.modules():
            kind = type(module).__name__
            if id(module) not in engines and any(t in kind for t in ("GatedDeltaNet", "LinearAttention", "Mamba",
                                                                      "Mixer")):
                names.add(kind)
    return sorted(names)


def check_attention(args: TransformersArgs, layout: Layout) -> None:
    kind, dims = args.model_type, layout.dims
    if dims.cp_enabled or args.attention_mask == "block_causal":
        mixers = recurrent_mixers(meta_model(args))
        if mixers:
            key = ("[parallelism.context_parallel_degree]" if dims.cp_enabled else "[model.attention_mask]")
            raise ConfigError(f"{key} model type {kind!r}: its linear-attention layers ({', '.join(mixers)}) carry a "
                              f"state along the sequence in transformers' own code, which neither context parallelism "
                              f"nor block-causal documents reach (torchtrain maps Qwen3.5's layout to its own layer, "
                              f"not this one); set context_parallel_degree = 1 and attention_mask = \"causal\"")
    if uses_registry(model_class(args.config)):
        return
    if dims.cp_enabled:
        raise ConfigError(f"[parallelism.context_parallel_degree] model type {kind!r} computes its attention itself "
                          f"(not through transformers' attention-function registry), so context parallelism cannot "
                          f"shard it; set context_parallel_degree = 1")
    if args.attention_mask == "block_causal":
        raise ConfigError(f"[model.attention_mask] model type {kind!r} computes its attention itself (not through "
                          f"transformers' attention-function registry): block-causal masks need torchtrain's; use "
                          f"\"causal\"")


def check_tp(args: TransformersArgs, layout: Layout, swapped: tuple[str, ...]) -> None:
    """The declared plan translates, and the sizes it shards divide by the TP degree."""
    dims, kind = layout.dims, args.model_type
    tp_plan.check_translatable(args.config, swapped)
    if args.tie_word_embeddings:
        raise ConfigError(f"[parallelism.tensor_parallel_degree] model type {kind!r} ties its input and output "
                          f"embeddings ({args.hf_path}/config.json tie_word_embeddings), which tensor parallelism "
                          f"does not split here; set tensor_parallel_degree = 1")
    model = meta_model(args)
    problem = tp_plan.model_sp_problem(model, own_styles)
    if swapped and problem is not None:
        raise ConfigError(f"[parallelism.tensor_parallel_degree] model type {kind!r}: its MoE layers run under "
                          f"tensor parallelism with sequence parallelism, which its plan does not allow ({problem})")
    sizes = {"num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab_size}
    for layer_index, layer in enumerate(model.decoder_layers):
        for name, style in tp_plan.layer_entries(layer, model.config, set(swapped)).items():
            module = layer.get_submodule(name)
            if isinstance(module, nn.Linear) and style in tp_plan.COL:
                sizes[f"layers.{layer_index}.{name} out_features"] = module.out_features
            elif isinstance(module, nn.Linear) and style in tp_plan.ROW:
                sizes[f"layers.{layer_index}.{name} in_features"] = module.in_features
    for what, size in sizes.items():
        if size % dims.tp:
            raise ConfigError(f"[parallelism.tensor_parallel_degree] {dims.tp} does not divide model type {kind!r}'s "
                              f"{what} ({size}, {args.hf_path}/config.json): each TP rank holds an equal share; "
                              f"choose a degree that divides it")
    if problem is None and layout.local_seq_len % dims.tp:
        raise ConfigError(f"[training.seq_len] sequence parallelism splits each rank's {layout.local_seq_len} tokens "
                          f"over tensor_parallel_degree {dims.tp}; use a multiple of {dims.tp * dims.cp}")


def validate(args: TransformersArgs, layout: Layout) -> None:
    """The model's checks against the layout (module doc)."""
    dims, kind = layout.dims, args.model_type
    if args.composite:
        for on, key, what in ((dims.pp_enabled, "pipeline_parallel_degree", "pipeline stages (the vision tower feeds "
                               "the first stage's embeddings; stages are cut by decoder layers only)"),
                              (dims.ep_enabled, "expert_parallel_degree", "expert parallelism (its MoE blocks are "
                               "checked for the swap on a text model only)")):
            if on:
                raise ConfigError(f"[parallelism.{key}] vision-language model type {kind!r}: torchtrain does not "
                                  f"run it with {what}; set {key} = 1")
    if dims.pp_enabled:
        pipeline.check_pipelinable(args)
    check_attention(args, layout)
    swapped: tuple[str, ...] = ()
    if args.num_experts:
        if dims.tp_enabled and not dims.ep_enabled:
            raise ConfigError(f"[parallelism.expert_parallel_degree] model type {kind!r}: its experts' declared "
                              f"tensor-parallel plan (packed expert weights) has no DTensor translation; with "
                              f"tensor_parallel_degree {dims.tp} use expert_parallel_degree a multiple of {dims.tp}, "
                              f"which runs its MoE blocks as torchtrain's MoE layer")
        if dims.ep_enabled:
            swapped = moe.check_swappable(args, meta_model(args))
    if dims.tp_enabled:
        check_tp(args, layout, swapped)


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    """The declared plan (`tp_plan.apply_tp`), the swapped MoE layers' own styles included."""
    tp_plan.apply_tp(model, tp_mesh, loss_parallel, own_styles)


def fsdp_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """A vision tower's units (its blocks, then the rest of it: `vision_language.py`), the embedding, each decoder
    layer, then the text model's other weights (the final norm) with the output head; with tied embeddings the
    shared table stays with the root. A pipeline stage has the units of the modules it holds."""
    def has_weights(m: nn.Module | None) -> bool:
        return m is not None and next(m.parameters(), None) is not None

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = has_weights(head) and has_weights(embed) and head.weight is embed.weight
    units: list[nn.Module | list[nn.Module]] = list(model.encoder_units())
    units += [] if tied or not has_weights(embed) else [embed]
    units += list(model.decoder_layers)
    tail = [m for _, m in model.top_modules()]
    if not tied and has_weights(head):
        tail.append(head)
    if tail and not tied:
        units.append(tail)
    return units


def adapt(model: nn.Module, layout: Layout) -> None:
    """Before anything else of the layout: a pipeline stage's missing modules become the identity
    (`pipeline.py`); under expert parallelism the MoE blocks become torchtrain's MoE layer (`moe.py`)."""
    if layout.dims.pp_enabled:
        stages.fill_stage(model)
    if layout.dims.ep_enabled:
        moe.swap_blocks(model)


def stage_modules(args: TransformersArgs, num_stages: int, first_less: int = 0, last_less: int = 0
                  ) -> list[list[str]]:
    """The pipeline split (`pipeline.py::stage_modules`) of the model of `args`."""
    return pipeline.stage_modules(meta_model(args), num_stages, first_less, last_less)
