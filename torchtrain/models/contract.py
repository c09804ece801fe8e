"""What a model family declares about itself for tools that reason about it without running it (the
planner): its shapes, each block's matmuls and attention, and the collectives its parallel plans issue
per block. A family builds a `ModelContract` from its arguments (`register` / `declare`); everything
the planner knows about a model comes from here.

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
  gradient in backward.

Expert and context parallelism are generic: their collectives, and the sizes of a collective
(`BlockCollective`), are in `models/collectives.py` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from torchtrain.config.fields import ConfigError
from torchtrain.models.collectives import (  # noqa: F401  (re-exported: the contract's vocabulary)
    AttentionShape,
    BlockCollective,
    Dispatch,
    MoEShape,
    cp_collectives,
    ep_collectives,
    expected_nodes,
)
from torchtrain.models.common.tp import GatherForLocalHeads


@dataclass(frozen=True)
class Matmul:
    """One weight matmul of a block: `tokens x in_features @ in_features x out_features`."""

    name: str
    in_features: int
    out_features: int
    kind: str
    """How parallelism splits it: "column" (output features over tp, tokens gathered over the
    sequence), "row" (input features over tp), "local" (whole weight on this rank's sequence shard: an
    MoE router, shared experts, MLA's latent projections), "expert" (one routed expert, applied to
    top-k routed tokens; experts split over ep)."""

    @property
    def attention(self) -> bool:
        return self.name.startswith("attention.")


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


def linear(in_features: int, out_features: int) -> Module:
    return Module(in_features, out_features, ((out_features, in_features),), linear=True)


def norm(width: int) -> Module:
    return Module(width, width, ((width, 1),))


def _layouts(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def tp_collectives(plan: dict[str, object], modules: dict[str, Module], tp: int) -> list[BlockCollective]:
    """The tensor-parallel collectives `plan` issues per block and micro-batch (module doc)."""
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


def _memo(obj, name: str, key: tuple, compute: Callable[[], list]) -> list:
    """`compute()` once per (frozen `obj`, name, key): the planner asks a contract the same questions
    for every layout of a search."""
    memo = obj.__dict__.setdefault("_memo", {})
    if (name, key) not in memo:
        memo[(name, key)] = compute()
    return memo[(name, key)]


@dataclass(frozen=True)
class Block:
    """One block as its family's plan sees it."""

    plan: dict[str, object]
    """The block's TP plan (module name relative to the block -> style), as `apply_tp` applies it."""
    modules: dict[str, Module]
    """Every module the plan names, and every other parameter-holding module of the block."""
    moe: MoEShape | None = None
    dim: int = 0
    fused: tuple[tuple[str, ...], ...] = ()
    """Groups of the block's matmuls (one input, weights concatenated) that its modules run as one GEMM
    where the layout says so (`Layout.fused_qkv`): `matmuls(fused=True)` gives each group as one."""

    def matmuls(self, fused: bool = False) -> list[Matmul]:
        return list(_memo(self, "matmuls", (fused,), lambda: self._matmuls(fused)))

    def _matmuls(self, fused: bool) -> list[Matmul]:
        out = [Matmul(name, m.in_features, m.out_features, matmul_kind(self.plan.get(name)))
               for name, m in self.modules.items() if m.linear]
        for group in self.fused if fused else ():
            members = [m for m in out if m.name in group]
            first = out.index(members[0])
            out = [m for m in out if m.name not in group]
            out.insert(first, Matmul("+".join(group), members[0].in_features, sum(m.out_features for m in members),
                                     members[0].kind))
        if self.moe is not None:
            h, H = self.dim, self.moe.hidden
            out += [Matmul("experts.w1", h, H, "expert"), Matmul("experts.w3", h, H, "expert"),
                    Matmul("experts.w2", H, h, "expert")]
        return out

    def params(self, tp: int, ep: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(TP-local (rows, cols) of the block's parameters but the routed experts', those of its
        routed experts on one EP rank)."""
        dense = []
        for name, m in self.modules.items():
            kind = matmul_kind(self.plan.get(name)) if tp > 1 else "local"
            for r, c in m.params:
                dense.append((r // tp, c) if kind == "column" else (r, c // tp) if kind == "row" else (r, c))
        if self.moe is None:
            return dense, []
        local, h, H = self.moe.num_experts // ep, self.dim, self.moe.hidden
        return dense, [(local * H, h), (local * h, H), (local * H, h)]

    def collectives(self, tp: int, cp: int, ep: int, att: AttentionShape,
                    dispatch: Dispatch = Dispatch()) -> list[BlockCollective]:
        return list(_memo(self, "collectives", (tp, cp, ep, att, dispatch),
                          lambda: self._collectives(tp, cp, ep, att, dispatch)))

    def _collectives(self, tp: int, cp: int, ep: int, att: AttentionShape,
                     dispatch: Dispatch) -> list[BlockCollective]:
        out = tp_collectives(self.plan, self.modules, tp) + cp_collectives(att, tp, cp)
        return out + (ep_collectives(self.moe, self.dim, tp, ep, dispatch) if self.moe is not None else [])


@dataclass(frozen=True)
class ModelContract:
    """A model as the planner reads it."""

    dim: int
    n_layers: int
    vocab_size: int
    n_heads: int
    head_dim: int
    """A head's query/key width."""
    kv_heads: int
    attention: AttentionShape
    """The attention kernel's shape (MLA: value heads padded to the query/key width)."""
    dense: Block
    """A block without experts (for a dense model, every block)."""
    moe_block: Block | None
    moe_layers: tuple[bool, ...]
    """Per block (n_layers, then one per multi-token-prediction depth): whether it has experts."""
    num_params: int
    num_active_params: int
    flops_per_token: Callable[[int], int]
    """Training FLOPs per token at a sequence length (the family's own count)."""
    ffn_hidden: int = 0
    """The dense SwiGLU's hidden size."""
    tie_word_embeddings: bool = False
    mtp_depth: int = 0
    max_seq_len: int = 0
    """Rows of the RoPE table."""
    block_causal: bool = False
    qk_norm: bool = False
    """Per-head query/key RMSNorm (Qwen3)."""
    checkpoint_stand_ins: bool = False
    """A compiled selective "op" checkpoint saves the rotated queries and keys in place of the projections'
    outputs, so backward does not rotate them again (the blocks' attention declares it:
    `GQAttention.checkpoint_stand_ins`, grouped-query attention without query/key norms)."""
    cheap_to_recompute: tuple[str, ...] = ()
    """Block modules that selective checkpointing "cheap" recomputes (the family's `ModelSpec` field of
    the same name, from one constant of the family)."""
    notes: tuple[str, ...] = field(default=())

    @property
    def moe(self) -> MoEShape | None:
        return self.moe_block.moe if self.moe_block is not None else None

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe else 0

    @property
    def num_experts_per_tok(self) -> int:
        return self.moe.top_k if self.moe else 0

    @property
    def moe_intermediate_size(self) -> int:
        return self.moe.hidden if self.moe else 0

    @property
    def num_shared_experts(self) -> int:
        return self.moe.shared if self.moe else 0

    @property
    def block(self) -> Block:
        """The block the time model costs every block as (the MoE block when the model has experts)."""
        return self.moe_block or self.dense

    def is_moe_layer(self, i: int) -> bool:
        return self.moe_layers[i]

    def matmuls(self, fused: bool = False) -> list[Matmul]:
        """The block's matmuls; `fused`: its fused groups as one each (`Block.fused`)."""
        return self.block.matmuls(fused)

    def flops(self, seq_len: int) -> int:
        """`flops_per_token(seq_len)`, computed once per sequence length."""
        return _memo(self, "flops", (seq_len,), lambda: self.flops_per_token(seq_len))

    def cheap_matmuls(self) -> list[Matmul]:
        """The block's matmuls among `cheap_to_recompute` (what selective "cheap" runs again)."""
        return [m for m in self.matmuls() if m.name in self.cheap_to_recompute]

    def collectives(self, tp: int, cp: int, ep: int, dispatch: Dispatch = Dispatch()) -> list[BlockCollective]:
        return self.block.collectives(tp, cp, ep, self.attention, dispatch)


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


# ---------------------------------------------------------------------------------- the registry
_DECLARATIONS: dict[type, Callable[[object], ModelContract]] = {}


def register(args_cls: type):
    """Decorator: `fn(args) -> ModelContract` declares models whose arguments are `args_cls`."""

    def wrap(fn: Callable[[object], ModelContract]) -> Callable[[object], ModelContract]:
        _DECLARATIONS[args_cls] = fn
        return fn

    return wrap


_DECLARED: dict[tuple[type, str], ModelContract] = {}


def declare(args) -> ModelContract:
    """The contract of the model with these arguments (its family's declaration; the most derived
    registered argument class wins). Contracts are frozen: one per distinct arguments is kept."""
    key = (type(args), repr(args))
    if key in _DECLARED:
        return _DECLARED[key]
    for cls in type(args).__mro__:
        if cls in _DECLARATIONS:
            _DECLARED[key] = _DECLARATIONS[cls](args)
            return _DECLARED[key]
    raise ConfigError(f"[model.name] the planner cannot size this model: its arguments ({type(args).__name__}) "
                      f"declare no contract; register one with `models.contract.register` (docs/architecture.md, "
                      f"'Add a model')")


def qk_norm_modules(head_dim: int) -> dict[str, Module]:
    """Per-head query/key norms (`models/common/parallel.py::qk_norm_plan`)."""
    return {"attention.q_norm": norm(head_dim), "attention.k_norm": norm(head_dim)}


def gqa_decoder(args, dense: Block, moe_block: Block | None, num_active_params: int, ffn_hidden: int,
                qk_norm: bool = False) -> ModelContract:
    """The contract of a grouped-query-attention decoder (`models/common/transformer.py`) around its blocks:
    every block is `moe_block` when given, else `dense`."""
    return ModelContract(
        dim=args.dim, n_layers=args.n_layers, vocab_size=args.vocab_size, n_heads=args.n_heads,
        head_dim=args.head_dim, kv_heads=args.kv_heads,
        attention=AttentionShape(args.n_heads, args.head_dim, args.head_dim, args.kv_heads),
        dense=dense, moe_block=moe_block, moe_layers=(moe_block is not None,) * args.n_layers,
        num_params=args.num_params(), num_active_params=num_active_params, flops_per_token=args.flops_per_token,
        ffn_hidden=ffn_hidden, tie_word_embeddings=args.tie_word_embeddings, max_seq_len=args.max_seq_len,
        block_causal=args.attention_mask == "block_causal", qk_norm=qk_norm, checkpoint_stand_ins=not qk_norm)
