"""The planner's view of a transformers model (`models/contract.py`), read off the model built on the meta
device and the plan it declares: each decoder layer's modules with their widths (its linear layers, its
norms), the TP styles the engine applies to them (`tp_plan.py`, with sequence parallelism where the plan
allows it) from which the contract derives the collectives and matmul splits, the attention shape from
the config, and -- for an MoE model -- its blocks as the engine's MoE layer (how expert parallelism runs
them, `moe.py`). Parameter and FLOP counts are the arguments' (`args.py`)."""

from __future__ import annotations

from torch import nn

from torchtrain.models import contract
from torchtrain.models.transformers import moe, tp_plan
from torchtrain.models.transformers.args import TransformersArgs
from torchtrain.models.transformers.parallelize import meta_model, own_styles


def _modules(layer: nn.Module, skip: tuple[str, ...]) -> dict[str, contract.Module]:
    """The layer's parameter-holding modules by name (relative to it), those under `skip` left out."""
    out: dict[str, contract.Module] = {}
    for name, module in layer.named_modules():
        if not name or any(name == s or name.startswith(s + ".") for s in skip):
            continue
        params = [p for p in module.parameters(recurse=False)]
        if isinstance(module, nn.Linear):
            shapes = ((module.out_features, module.in_features),) + (((module.out_features, 1),)
                                                                       if module.bias is not None else ())
            out[name] = contract.Module(module.in_features, module.out_features, shapes, linear=True)
        elif params and all(p.dim() == 1 for p in params):
            out[name] = contract.Module(params[0].numel(), params[0].numel(), tuple((p.numel(), 1) for p in params))
    return out


def _block(args: TransformersArgs, layer: nn.Module, sp: bool) -> contract.Block:
    """One decoder layer as the planner reads it (module doc)."""
    blocks = moe.blocks(layer)
    own = own_styles(layer)
    entries = tp_plan.layer_entries(layer, args.config, set(blocks))
    plan = tp_plan.layer_plan(layer, entries, sp, own)
    modules = _modules(layer, tuple(blocks))
    shape = None
    for name, block in blocks.items():
        shape = contract.MoEShape(block.experts.gate_up_proj.shape[0], args.num_experts_per_tok,
                                  moe.layout_of(block.experts)[1], 0)
        modules.update(moe.as_transformers_names(name, block, contract.moe_modules(args.dim, shape, prefix=name)))
    for name in plan:  # the modules whose inputs the plan gathers (attention, MLP): the hidden width
        modules.setdefault(name, contract.Module(args.dim, args.dim))
    return contract.Block(plan, modules, moe=shape, dim=args.dim)


@contract.register(TransformersArgs)
def declare(args: TransformersArgs) -> contract.ModelContract:
    """The contract of a transformers model (module doc)."""
    model = meta_model(args)
    layers = list(model.decoder_layers)
    sp = tp_plan.model_sp_problem(model, own_styles) is None
    is_moe = tuple(bool(moe.blocks(layer)) for layer in layers)
    dense = next((layer for layer, m in zip(layers, is_moe) if not m), layers[0])
    moe_layer = next((layer for layer, m in zip(layers, is_moe) if m), None)
    dense_block = _block(args, dense, sp)
    moe_block = _block(args, moe_layer, sp) if moe_layer is not None else None
    config = args.config.get_text_config()
    return contract.ModelContract(
        dim=args.dim, n_layers=args.n_layers, vocab_size=args.vocab_size, n_heads=args.n_heads,
        head_dim=args.head_dim, kv_heads=args.kv_heads,
        attention=contract.AttentionShape(args.n_heads, args.head_dim, args.head_dim, args.kv_heads),
        dense=dense_block if moe_block is None or not all(is_moe) else moe_block, moe_block=moe_block,
        moe_layers=is_moe, num_params=args.num_params(), num_active_params=args.num_active_params(),
        flops_per_token=args.flops_per_token, ffn_hidden=int(getattr(config, "intermediate_size", 0) or 0),
        tie_word_embeddings=args.tie_word_embeddings, block_causal=args.attention_mask == "block_causal",
        qk_norm=any(name.endswith(("q_norm", "k_norm")) for name in dense_block.modules),
        notes=(f"transformers model type {args.model_type}: its blocks and plan as declared, "
               f"{'with' if sp else 'without'} sequence parallelism under TP",))
