"""What the decoder families share about being parallelised: their checks against the layout, FSDP
units, pipeline split, and the TP plan of per-head query/key norms. A family's `parallelize.py` states
only its own sizes and plan; the generic applier (`distributed/parallelize.py`) calls these in its fixed
order from the resolved Layout.

* `check_decoder_layout`: one rule for tensor, context and sequence parallelism. Context parallelism
  gives each rank seq_len / cp tokens of every sequence (a head and a tail chunk,
  `distributed/context_parallel.py`); sequence parallelism then splits *those* tokens over the TP ranks
  (`distributed/tensor_parallel.py`), so it is the per-rank length seq_len / cp that the TP degree must
  divide -- with the heads, the feed-forward width and the vocabulary, which TP shards too.
* `decoder_fsdp_units`: a vision encoder's blocks and the encoder's rest, the token embedding, each block,
  and (norm, output) together; the root takes whatever is left (the RoPE buffer; with tied embeddings the
  shared table, which both ends use).
* `keep_modules`: the cut itself -- a copy of the model holding only a stage's modules, by name;
* `decoder_stage_modules`: stages in model order -- the first holds `tok_embeddings` (and a vision encoder:
  images join the text there), the last `norm` and `output`, the blocks split evenly in between
  (`block_stages`, which the transformers backend's split shares); `first_less` / `last_less` take blocks
  away from the first / last stage to balance the embedding and the output head (which, with a large
  vocabulary, cost about as much as a block or two).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from torchtrain.config.fields import ConfigError
from torchtrain.models.common.tp import apply_decoder_top, check_divisible, check_tp_has_ep

if TYPE_CHECKING:
    from torchtrain.distributed.layout import Layout


def check_decoder_layout(args, layout: "Layout", tp_sizes: dict[str, int]) -> None:
    """The decoder family's checks of `args` (with `vocab_size`, `tie_word_embeddings`) against the
    layout, before any process group starts; `tp_sizes`: the family's sizes that tensor parallelism
    shards (`model.<key>` -> size: heads, feed-forward width), checked in order before the vocabulary
    and the per-rank sequence length."""
    dims = layout.dims
    if dims.pp_enabled and args.tie_word_embeddings:
        raise ConfigError("[model.tie_word_embeddings] tied embeddings cannot be split across pipeline stages "
                          "(the table would live on the first and the last stage); set it false or "
                          "pipeline_parallel_degree = 1")
    tp, cp = dims.tp, dims.cp
    if tp == 1:
        return
    if args.tie_word_embeddings:
        raise ConfigError("[model.tie_word_embeddings] tied embeddings are not supported with tensor parallelism "
                          "in this plan; set model.tie_word_embeddings = false or tensor_parallel_degree = 1")
    per_rank = "" if cp == 1 else f" (each of the {cp} context-parallel ranks holds seq_len / {cp} tokens)"
    check_divisible(tp, {**tp_sizes, "model.vocab_size": args.vocab_size, "training.seq_len": layout.local_seq_len},
                    fixes={
        "model.vocab_size": f"pad the vocabulary: --model.vocab_size {-(-args.vocab_size // tp) * tp} "
                            f"(extra rows are never produced by the tokenizer)",
        "training.seq_len": f"sequence parallelism splits each rank's sequence evenly{per_rank}; use a multiple "
                            f"of the TP degree x the context parallel degree ({tp * cp})",
    })


def check_moe_decoder_layout(args, layout: "Layout") -> None:
    """A mixture-of-experts decoder's checks: `check_decoder_layout` of the heads (the experts are not
    tensor-parallel), then expert parallelism over the TP ranks."""
    check_decoder_layout(args, layout, {"model.n_heads": args.n_heads, "model.n_kv_heads": args.kv_heads})
    check_tp_has_ep(layout.dims)


def decoder_tp(block_plan: Callable[[Any], dict[str, object]]) -> Callable[[nn.Module, Any, bool], None]:
    """A decoder family's `tp_plan` (model, tp_mesh, loss_parallel): the shared top (embedding, final norm,
    output: `apply_decoder_top`) and `block_plan(model.args)` on every block."""

    def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
        apply_decoder_top(model, tp_mesh, loss_parallel)
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, block_plan(model.args))

    return apply_tp


def qk_norm_plan() -> dict[str, object]:
    """TP styles of per-head query/key norms (module names relative to the block): their weights are
    replicated and their inputs sharded over heads (dim 2 of (batch, seq, heads, head_dim)), so each
    rank normalises its own heads and the norms' gradients are summed over the TP ranks."""
    return {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


def decoder_fsdp_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """The FSDP units in forward order (see the module doc)."""
    units: list[nn.Module | list[nn.Module]] = []
    encoder = model.vision_encoder
    if encoder is not None:  # each encoder block, then the rest of the encoder (patch embedding, positions, merger)
        units += [*encoder.layers.values(), encoder]
    if model.tok_embeddings is not None and not model.args.tie_word_embeddings:
        units.append(model.tok_embeddings)
    units += list(model.layers.values())
    tail = [m for m in (model.norm, model.output) if m is not None]
    if tail and not model.args.tie_word_embeddings:
        units.append(tail)
    return units


def decoder_stage_modules(args, num_stages: int, first_less: int = 0, last_less: int = 0) -> list[list[str]]:
    """Module names per pipeline stage (see the module doc) of a decoder family with arguments `args`."""
    stages = block_stages(args.n_layers, num_stages, first_less, last_less)
    stages[0][:0] = ["tok_embeddings"] + (["vision_encoder"] if args.image_geometry() is not None else [])
    stages[-1] += ["norm", "output"]
    return stages


def block_stages(n_layers: int, num_stages: int, first_less: int = 0, last_less: int = 0) -> list[list[str]]:
    """The blocks (`layers.<i>`) of each of `num_stages` pipeline stages: split evenly, but `first_less` /
    `last_less` fewer on the first / last stage (ConfigError where that leaves a stage without blocks)."""
    units = n_layers + first_less + last_less
    if units % num_stages or units // num_stages < 1:
        raise ConfigError(
            f"[model.n_layers] {n_layers} blocks (+ {first_less} first-stage and {last_less} last-stage "
            f"less layers = {units}) cannot be split evenly into {num_stages} pipeline stages; change "
            f"parallelism.pipeline_parallel_degree / pipeline_parallel_layers_per_stage, or the "
            f"pipeline_parallel_first/last_stage_less_layers"
        )
    per = units // num_stages
    counts = [per] * num_stages
    counts[0] -= first_less
    counts[-1] -= last_less
    if min(counts) < 0 or (num_stages > 1 and min(counts[1:-1] or [1]) < 1):
        raise ConfigError(
            f"[parallelism.pipeline_parallel_first_stage_less_layers] {first_less} / last {last_less} leave a "
            f"stage with a negative or zero number of blocks ({counts}); use smaller values"
        )
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [[f"layers.{start + j}" for j in range(count)] for start, count in zip(starts, counts)]


def keep_modules(model: nn.Module, names: list[str], share: bool = False) -> nn.Module:
    """A copy of `model` holding only the named modules: top-level modules not named become None,
    and a ModuleDict (like `layers`) keeps only its named entries ("layers.3"). A dotted name reaching
    deeper ("model.layers.3", "model.norm": a model whose blocks sit inside another module) cuts that
    module the same way; a module without parameters (a RoPE table) stays on every stage. `share`: copy
    only the containers (the model object, the modules the names reach into, their ModuleDicts) and share
    the kept modules with `model` -- for callers that only read the cut's structure (the planner's
    schedule objects)."""
    part = copy.copy(model) if share else copy.deepcopy(model)
    wanted = set(names)
    _cut(part, "", wanted, share)
    if wanted:
        raise ConfigError(f"[parallelism.module_fqns_per_model_part] unknown module names {sorted(wanted)}")
    return part


def _cut(part: nn.Module, prefix: str, wanted: set[str], share: bool) -> None:
    """Keep in `part` (named `prefix`) the modules of `wanted` (removing those found), see `keep_modules`."""
    if share:
        part._modules = {attr: (nn.ModuleDict(dict(child.items())) if type(child) is nn.ModuleDict else
                                copy.copy(child) if child is not None and isinstance(child, nn.ModuleDict) else child)
                         for attr, child in part._modules.items()}
    for attr, child in list(part.named_children()):
        path = f"{prefix}{attr}"
        if isinstance(child, nn.ModuleDict):
            if share:
                child._modules = dict(child._modules)
            for key in list(child.keys()):
                if f"{path}.{key}" not in wanted:
                    del child[key]
                else:
                    wanted.discard(f"{path}.{key}")
        elif path in wanted:
            wanted.discard(path)
        elif any(w.startswith(path + ".") for w in wanted):
            if share:
                child = copy.copy(child)
                setattr(part, attr, child)
            _cut(child, path + ".", wanted, share)
        elif next(child.parameters(), None) is not None:
            setattr(part, attr, None)
