"""A block's modules as the planner sees them (`Module`: widths and parameters), the tensor-parallel
collectives a family's plan issues over them (`tp_collectives`), and the module sets of the shared layers
(`gqa_modules`, `swiglu_modules`, `moe_modules`, `linear_attention_modules`, the vision encoder's
`vision_block_modules` and `vision_rest_modules`). `models/contract.py`
re-exports them: families read them as `contract.X`.

The collectives are derived, not restated: a block states its modules' widths (`Module`), and
`tp_collectives` reads the family's own tensor-parallel plan (the same dict its `apply_tp` applies) to
find what each style moves per block and micro-batch:

* an input gathered over the sequence (`ColwiseParallel(input_layouts=Shard(1))`, or
  `PrepareModuleInput` from `Shard(1)` to `Replicate()`): an all-gather of the module's input width per
  token in forward, and its gradient's reduce-scatter in backward (none when the gathered input is
  handed on as a plain tensor, `use_local_output`: its gradient is then cut locally);
* a row-parallel output into sequence shards (`RowwiseParallel(output_layouts=Shard(1))`): a
  reduce-scatter of the output width in forward, an all-gather of its gradient in backward
  (`Replicate()` output: one all-reduce in forward);
* a partial sum made whole (`PrepareModuleInput` from `Partial()`): an all-reduce of the input in forward;
* a column-parallel output gathered whole (`ColwiseParallel(output_layouts=Replicate())`): an all-gather
  of the output width in forward; a row-parallel layer cutting a whole input (`RowwiseParallel(
  input_layouts=Replicate())`): an all-gather of the input width's gradient in backward;
* replicated weights on sequence shards (`SequenceParallel`): one all-reduce of each parameter's
  gradient in backward;
* a column-parallel layer over a plain replicated input (`plain_inputs`: a vision encoder's patches): an
  all-reduce of the input's gradient in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from torchtrain.models.collectives import BlockCollective, LinearAttentionShape, MoEShape
from torchtrain.models.common.tp import GatherForLocalHeads


@dataclass(frozen=True)
class Module:
    """One module a block's TP plan names: its input and output widths per token (or per sequence),
    and its parameters as (rows, cols) (a vector: (n, 1))."""

    in_features: int
    out_features: int = 0
    params: tuple[tuple[int, int], ...] = ()
    linear: bool = False
    per_sequence: bool = False
    """Its input is one row per sequence (e.g. the auxiliary loss's per-sequence expert counts)."""
    dtype: str = "compute"


def linear(in_features: int, out_features: int, bias: bool = False) -> Module:
    """A linear layer: its weight (out, in), and with `bias` its bias (out, 1) (split with the output features
    by a column-parallel style, replicated by a row-parallel one)."""
    return Module(in_features, out_features, ((out_features, in_features),) + (((out_features, 1),) if bias else ()),
                  linear=True)


def norm(width: int) -> Module:
    return Module(width, width, ((width, 1),))


def layer_norm(width: int) -> Module:
    """A LayerNorm: weight and bias."""
    return Module(width, width, ((width, 1), (width, 1)))


def _layouts(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def tp_collectives(plan: dict[str, object], modules: dict[str, Module], tp: int,
                   plain_inputs: bool = False) -> list[BlockCollective]:
    """The tensor-parallel collectives `plan` issues per block and micro-batch (module doc). `plain_inputs`:
    the modules receive plain replicated tensors (no enclosing `PrepareModuleInput` hands them DTensors, as
    in a vision encoder over replicated patches): a column-parallel layer then wraps its input itself, and
    that wrapping's backward (`DTensor.from_local`) all-reduces the input's gradient, one per layer."""
    if tp == 1:
        return []
    out: list[BlockCollective] = []

    def add(kind: str, backward: bool, m: Module, width: int) -> None:
        per = width if not m.per_sequence else 0
        seq = width if m.per_sequence else 0
        out.append(BlockCollective(kind, "tp", backward, per_token=per, per_sequence=seq, dtype=m.dtype))

    for name, style in plan.items():
        m = modules[name]
        if isinstance(style, SequenceParallel):
            out += [BlockCollective("all_reduce", "tp", True, fixed=r * c) for r, c in m.params]
        elif isinstance(style, GatherForLocalHeads):
            add("all_gather", False, m, m.in_features)
            add("reduce_scatter", True, m, m.in_features)
        elif isinstance(style, (ColwiseParallel, PrepareModuleInput)):
            src, dst = _layouts(style.input_layouts)[0], _layouts(style.desired_input_layouts)[0]
            if isinstance(src, Shard) and isinstance(dst, Replicate):
                add("all_gather", False, m, m.in_features)
                if not (isinstance(style, PrepareModuleInput) and style.use_local_output):
                    add("reduce_scatter", True, m, m.in_features)
            elif isinstance(src, Partial) and isinstance(dst, Replicate):
                add("all_reduce", False, m, m.in_features)
            elif plain_inputs and isinstance(style, ColwiseParallel) and isinstance(src, Replicate):
                add("all_reduce", True, m, m.in_features)
            if isinstance(style, ColwiseParallel) and isinstance(_layouts(style.output_layouts)[0], Replicate):
                add("all_gather", False, m, m.out_features)  # the output gathered whole (its gradient cut locally)
        if isinstance(style, RowwiseParallel):
            if isinstance(_layouts(style.input_layouts)[0], Replicate):
                add("all_gather", True, m, m.in_features)  # a whole input cut locally: its gradient gathered
            dst = _layouts(style.output_layouts)[0]
            if isinstance(dst, Shard):
                add("reduce_scatter", False, m, m.out_features)
                add("all_gather", True, m, m.out_features)
            else:
                add("all_reduce", False, m, m.out_features)
    return out


def matmul_kind(style) -> str:
    if isinstance(style, ColwiseParallel):
        return "column"
    if isinstance(style, RowwiseParallel):
        return "row"
    return "local"


def moe_modules(dim: int, moe: MoEShape, prefix: str = "feed_forward", shared_gate: bool = False
                ) -> dict[str, Module]:
    """The modules of the shared MoE layer (`models/common/moe.py`) that its TP plan names (`shared_gate`:
    the sigmoid gate of its shared experts)."""
    out = {prefix: Module(dim, dim), f"{prefix}.router": linear(dim, moe.num_experts),
           f"{prefix}.sequence_sum": Module(moe.num_experts, per_sequence=True, dtype="float32")}
    if moe.shared:
        s = moe.hidden * moe.shared
        out.update({f"{prefix}.shared_experts.w1": linear(dim, s), f"{prefix}.shared_experts.w3": linear(dim, s),
                    f"{prefix}.shared_experts.w2": linear(s, dim)})
        if shared_gate:
            out[f"{prefix}.shared_gate"] = linear(dim, 1)
    return out


def swiglu_modules(dim: int, hidden: int, prefix: str = "feed_forward") -> dict[str, Module]:
    return {prefix: Module(dim, dim), f"{prefix}.w1": linear(dim, hidden), f"{prefix}.w3": linear(dim, hidden),
            f"{prefix}.w2": linear(hidden, dim)}


GQA_FUSED = (("attention.wq", "attention.wk", "attention.wv"),)
"""The fused group of `models/common/transformer.py::GQAttention` (its `fuse_qkv`), for `Block.fused`."""


def gqa_modules(dim: int, n_heads: int, kv_heads: int, head_dim: int) -> dict[str, Module]:
    hq, hkv = n_heads * head_dim, kv_heads * head_dim
    return {"attention": Module(dim, dim), "attention.wq": linear(dim, hq), "attention.wk": linear(dim, hkv),
            "attention.wv": linear(dim, hkv), "attention.wo": linear(hq, dim), "attention_norm": norm(dim),
            "ffn_norm": norm(dim)}


def linear_attention_modules(dim: int, lin: LinearAttentionShape) -> dict[str, Module]:
    """The modules of a block's norms and Gated DeltaNet at `attention` (`models/common/linear_attention.py`)
    that its TP plan (`models/common/tp.py::gated_deltanet_plan`) names."""
    k, v, hv = lin.key_heads * lin.key_head_dim, lin.value_heads * lin.value_head_dim, lin.value_heads
    out = {"attention": Module(dim, dim), "attention_norm": norm(dim), "ffn_norm": norm(dim),
           **{f"attention.in_proj_{p}": linear(dim, w) for p, w in zip("qkvzba", (k, k, v, v, hv, hv))},
           **{f"attention.conv_{p}": Module(w, w, ((w, lin.conv_kernel),)) for p, w in zip("qkv", (k, k, v))},
           "attention.decay": Module(hv, hv, ((hv, 1), (hv, 1))), "attention.norm": norm(lin.value_head_dim),
           "attention.out_proj": linear(v, dim)}
    return out


def qk_norm_modules(head_dim: int) -> dict[str, Module]:
    """Per-head query/key norms (`models/common/parallel.py::qk_norm_plan`)."""
    return {"attention.q_norm": norm(head_dim), "attention.k_norm": norm(head_dim)}


def vision_block_modules(dim: int, hidden: int) -> dict[str, Module]:
    """One block of the shared vision encoder (`models/common/vision.py::VisionBlock`): LayerNorms, q/k/v/o
    projections and a two-layer MLP, every linear layer with a bias."""
    return {"attention_norm": layer_norm(dim), **{f"attention.w{x}": linear(dim, dim, True) for x in "qkvo"},
            "ffn_norm": layer_norm(dim), "feed_forward.w1": linear(dim, hidden, True),
            "feed_forward.w2": linear(hidden, dim, True)}


def vision_rest_modules(patch_dim: int, dim: int, positions: int, merge: int, out_dim: int) -> dict[str, Module]:
    """The shared vision encoder's modules outside its blocks: the patch embedding (per patch), the learned
    position table, and the patch merger (per decoder token: m^2 patches concatenated)."""
    merged = dim * merge * merge
    return {"patch_embed": linear(patch_dim, dim, True), "pos_embed": Module(positions, dim, ((positions, dim),)),
            "merger.norm": layer_norm(dim), "merger.w1": linear(merged, merged, True),
            "merger.w2": linear(merged, out_dim, True)}
