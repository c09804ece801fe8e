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
* replicated weights on sequence shards (`SequenceParallel`): one all-reduce of each parameter's
  gradient in backward.

Expert parallelism (`distributed/expert_parallel.py`) and context parallelism
(`distributed/context_parallel.py`) are generic: `ep_collectives` and `cp_collectives` state them from
the MoE and attention shapes; the expert all-to-alls follow the token dispatcher the job selects
(`parallelism.expert_parallel_comm_backend`, `Dispatch`), with group-limited routing's expected node
count (`expected_nodes`) for the node-limited one.

Sizes (`BlockCollective`): elements per token of the rank's micro-batch (t = batch x seq_len / cp,
before sequence parallelism splits it), per sequence, and fixed; for an all-gather or reduce-scatter
the whole gathered tensor, for an all-reduce the tensor, for an all-to-all what the rank sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from torchtrain.config.fields import ConfigError
from torchtrain.distributed.tensor_parallel import GatherForLocalHeads


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
class AttentionShape:
    heads: int
    qk_head_dim: int
    v_head_dim: int
    kv_heads: int


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


@dataclass(frozen=True)
class BlockCollective:
    """Collectives of one kind a block issues per micro-batch (see the module doc for the sizes)."""

    kind: str
    """"all_gather", "reduce_scatter", "all_reduce" or "all_to_all"."""
    mesh: str
    """"tp", "cp" or "ep"; the node-limited dispatcher's "ep_inter" (one rank per node of the EP
    group) and "ep_intra" (the EP ranks of one node)."""
    backward: bool
    """False: issued in forward (again when activation checkpointing re-runs the forward)."""
    per_token: float = 0.0
    per_sequence: float = 0.0
    fixed: float = 0.0
    dtype: str = "compute"
    """"compute" (the parameters' compute dtype), "float32" or "int64"."""
    count: int = 1

    def elements(self, tokens: float, sequences: float) -> float:
        """Elements of one of these collectives."""
        return self.per_token * tokens + self.per_sequence * sequences + self.fixed

    def nbytes(self, tokens: float, sequences: float, compute_bytes: int) -> float:
        size = {"compute": compute_bytes, "float32": 4, "int64": 8}[self.dtype]
        return self.elements(tokens, sequences) * size


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
        if isinstance(style, RowwiseParallel):
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


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    hidden: int
    """One routed expert's hidden size."""
    shared: int
    """Shared experts (each of the routed hidden size)."""
    n_group: int = 1
    """Group-limited routing: the experts form this many equal groups (1: none)."""
    topk_group: int = 1
    """Groups a token's experts may come from (read when n_group > 1)."""


@dataclass(frozen=True)
class Dispatch:
    """How routed tokens travel to their experts' ranks (`parallelism.expert_parallel_comm_backend`)."""

    backend: str = "standard"
    """"standard": one all-to-all over the EP group, every routed copy sent separately; "node_limited":
    a token crosses to each selected node once and fans out inside it (the combine mirrors it)."""
    ranks_per_node: int = 0
    """EP ranks per node (`parallelism.expert_parallel_ranks_per_node`; 0: the whole group is one node)."""


def _miss(pool: int, own: int, k: int) -> float:
    """Probability that k experts drawn uniformly without replacement from `pool` miss `own` of them."""
    return math.comb(pool - own, k) / math.comb(pool, k) if pool - own >= k else 0.0


def expected_nodes(moe: MoEShape, nodes: int) -> float:
    """Expected distinct nodes a token's top-k experts sit on, with the E experts spread evenly over
    `nodes` nodes and routing taken as uniform (the planner's balanced-routing assumption). With
    group-limited routing (n_group > 1) the k experts come from the token's topk_group groups, which
    bounds the count: a node holding whole groups is reached when one of its selected groups receives an
    expert; a group spanning several nodes sends to each of them that receives one."""
    e, k = moe.num_experts, moe.top_k
    if nodes <= 1:
        return 1.0
    per_node = e // nodes
    if moe.n_group <= 1:
        return nodes * (1.0 - _miss(e, per_node, k))
    g, pool = moe.n_group, moe.topk_group * (e // moe.n_group)
    if g % nodes == 0:  # each node holds g / nodes whole groups; j of them selected (hypergeometric)
        held = g // nodes
        total = math.comb(g, moe.topk_group)
        reach = sum(math.comb(held, j) * math.comb(g - held, moe.topk_group - j) / total
                    * (1.0 - _miss(pool, j * (e // g), k)) for j in range(1, min(held, moe.topk_group) + 1))
        return nodes * reach
    spans = nodes // g if nodes % g == 0 else 1  # nodes per group
    return min(nodes, moe.topk_group * spans) * (1.0 - _miss(pool, per_node, k))


def ep_collectives(moe: MoEShape, dim: int, tp: int, ep: int, dispatch: Dispatch = Dispatch()) -> list[BlockCollective]:
    """An MoE block's expert-parallel collectives (`distributed/expert_parallel.py`): the per-expert
    row counts exchanged (E integers), then the dispatch and combine all-to-alls of each of the rank's
    t / tp tokens, mirrored by their gradients' in backward.

    "standard" (mesh "ep"): each token's k rows of `dim` values go to their experts' ranks in one
    all-to-all. "node_limited" over n = ep / ranks_per_node > 1 nodes: first one all-to-all among the
    ranks of the same local index on each node (mesh "ep_inter"), carrying each token once per node it
    selects (`expected_nodes` rows, its own node's included as the (n - 1) / n of an all-to-all
    discounts), then one inside the node (mesh "ep_intra") fanning the k rows out to the experts' ranks;
    the combine reduces inside the node first and crosses back once."""
    if ep == 1:
        return []
    counts = BlockCollective("all_to_all", "ep", False, fixed=moe.num_experts, dtype="int64")
    rows = moe.top_k * dim / tp
    node = dispatch.ranks_per_node or ep
    if dispatch.backend != "node_limited" or node >= ep:
        return [counts, BlockCollective("all_to_all", "ep", False, per_token=rows, count=2),
                BlockCollective("all_to_all", "ep", True, per_token=rows, count=2)]
    crossing = expected_nodes(moe, ep // node) * dim / tp
    return [counts] + [BlockCollective("all_to_all", mesh, backward, per_token=size, count=2)
                       for backward in (False, True) for mesh, size in (("ep_inter", crossing), ("ep_intra", rows))]


def cp_collectives(att: AttentionShape, tp: int, cp: int) -> list[BlockCollective]:
    """Context parallelism (`distributed/context_parallel.py`): the keys and values of the whole
    sequence (cp t tokens, this rank's kv_heads / tp heads) all-gathered in forward, their gradients
    reduce-scattered in backward."""
    if cp == 1:
        return []
    kv = 2 * att.kv_heads * att.qk_head_dim * cp / tp
    return [BlockCollective("all_gather", "cp", False, per_token=kv),
            BlockCollective("reduce_scatter", "cp", True, per_token=kv)]


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

    def matmuls(self) -> list[Matmul]:
        return list(_memo(self, "matmuls", (), self._matmuls))

    def _matmuls(self) -> list[Matmul]:
        out = [Matmul(name, m.in_features, m.out_features, matmul_kind(self.plan.get(name)))
               for name, m in self.modules.items() if m.linear]
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

    def matmuls(self) -> list[Matmul]:
        return self.block.matmuls()

    def flops(self, seq_len: int) -> int:
        """`flops_per_token(seq_len)`, computed once per sequence length."""
        return _memo(self, "flops", (seq_len,), lambda: self.flops_per_token(seq_len))

    def cheap_matmuls(self) -> list[Matmul]:
        """The block's matmuls among `cheap_to_recompute` (what selective "cheap" runs again)."""
        return [m for m in self.matmuls() if m.name in self.cheap_to_recompute]

    def collectives(self, tp: int, cp: int, ep: int, dispatch: Dispatch = Dispatch()) -> list[BlockCollective]:
        return self.block.collectives(tp, cp, ep, self.attention, dispatch)


def moe_modules(dim: int, moe: MoEShape, prefix: str = "feed_forward") -> dict[str, Module]:
    """The modules of the shared MoE layer (`models/common/moe.py`) that its TP plan names."""
    out = {prefix: Module(dim, dim), f"{prefix}.router": linear(dim, moe.num_experts),
           f"{prefix}.sequence_sum": Module(moe.num_experts, per_sequence=True, dtype="float32")}
    if moe.shared:
        s = moe.hidden * moe.shared
        out.update({f"{prefix}.shared_experts.w1": linear(dim, s), f"{prefix}.shared_experts.w3": linear(dim, s),
                    f"{prefix}.shared_experts.w2": linear(s, dim)})
    return out


def swiglu_modules(dim: int, hidden: int, prefix: str = "feed_forward") -> dict[str, Module]:
    return {prefix: Module(dim, dim), f"{prefix}.w1": linear(dim, hidden), f"{prefix}.w3": linear(dim, hidden),
            f"{prefix}.w2": linear(hidden, dim)}


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
        block_causal=args.attention_mask == "block_causal", qk_norm=qk_norm)
