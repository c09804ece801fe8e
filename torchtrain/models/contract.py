"""What a model family declares about itself for tools that reason about it without running it (the
planner): its shapes, each block's matmuls and attention, and the collectives its parallel plans issue
per block. A family builds a `ModelContract` from its arguments (`register` / `declare`); everything
the planner knows about a model comes from here.

The collectives are derived, not restated: a block states its modules' widths (`Module`), and
`tp_collectives` reads the family's own tensor-parallel plan (the same dict its `apply_tp` applies) to
find what each style moves per block and micro-batch (`models/block_modules.py`, re-exported here with
the module sets of the shared layers).

Expert and context parallelism are generic: their collectives, and the sizes of a collective
(`BlockCollective`), are in `models/collectives.py` (re-exported here).

Layers differ in kind: a model states per layer whether its feed-forward has experts (`moe_layers`),
whether its token mixer is linear attention (`linear_layers`, `Block.linear`) and its attention window
(`windows`); `ModelContract.layer_kind` gives a layer's block and attention together (`LayerKind`), and
`kinds` counts them over a run of layers: the planner costs each kind once and sums.

A model that sees images declares its vision encoder (`vision`: `models/vision_contract.py::VisionShape`,
its sizes and its blocks' and merger's modules with their TP styles): the planner costs it per image.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable

from torchtrain.config.fields import ConfigError
from torchtrain.models.block_modules import (  # noqa: F401  (re-exported: what families declare blocks with)
    GQA_FUSED,
    Module,
    gqa_modules,
    layer_norm,
    linear,
    linear_attention_modules,
    matmul_kind,
    moe_modules,
    norm,
    qk_norm_modules,
    swiglu_modules,
    tp_collectives,
    vision_block_modules,
    vision_rest_modules,
)
from torchtrain.models.block_shape import Block, FeedForwardBytes, Matmul, memoized  # noqa: F401  (re-exported: the contract's vocabulary)
from torchtrain.models.collectives import (  # noqa: F401  (re-exported: the contract's vocabulary)
    AttentionShape,
    BlockCollective,
    Dispatch,
    LinearAttentionShape,
    MoEShape,
    expected_nodes,
)

if TYPE_CHECKING:
    from torchtrain.models.vision_contract import VisionShape


@dataclass(frozen=True, eq=False)
class LayerKind:
    """What the planner costs a layer by: its block and its attention's shape with the layer's window
    (unread for a linear-attention block). Layers of one kind cost alike (`ModelContract.kinds`)."""

    block: Block
    attention: AttentionShape

    def collectives(self, tp: int, cp: int, ep: int, dispatch: Dispatch = Dispatch()) -> list[BlockCollective]:
        return self.block.collectives(tp, cp, ep, self.attention, dispatch)


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
    linear_block: Block | None = None
    """The block of a linear-attention layer (`Block.linear`; its feed-forward as `moe_layers` says: one
    block for all the model's linear layers)."""
    linear_layers: tuple[bool, ...] = ()
    """Per block (as `moe_layers`): whether its token mixer is linear attention; () or missing: none."""
    windows: tuple[int | None, ...] = ()
    """Per block: its attention's sliding window (None: the whole sequence); () or missing: none."""
    vision: "VisionShape | None" = None
    """The model's vision encoder (`models/vision_contract.py`); None: text only. Its parameters are in
    `num_params`; its FLOPs, which run per image patch, are not in `flops_per_token`."""

    @property
    def moe(self) -> MoEShape | None:
        return self.moe_block.moe if self.moe_block is not None else None

    # The MoE sizes under the model arguments' names (0 for a dense model), so a shape reads like its args.
    num_experts = property(lambda self: self.moe.num_experts if self.moe else 0)
    num_experts_per_tok = property(lambda self: self.moe.top_k if self.moe else 0)
    moe_intermediate_size = property(lambda self: self.moe.hidden if self.moe else 0)
    num_shared_experts = property(lambda self: self.moe.shared if self.moe else 0)

    @property
    def block(self) -> Block:
        """The model's representative block (the MoE block when the model has experts): what the
        planner's per-block functions cost when not handed a layer's kind (`layer_kind`)."""
        return self.moe_block or self.dense

    def is_moe_layer(self, i: int) -> bool:
        return self.moe_layers[i]

    def is_linear_layer(self, i: int) -> bool:
        return i < len(self.linear_layers) and self.linear_layers[i]

    def layer_block(self, i: int) -> Block:
        """Block i's block (an MTP depth k: i = n_layers + k)."""
        if self.is_linear_layer(i):
            return self.linear_block
        return self.moe_block if self.moe_block is not None and self.is_moe_layer(i) else self.dense

    def layer_attention(self, i: int) -> AttentionShape:
        """Block i's attention: `attention` with the block's window."""
        window = self.windows[i] if i < len(self.windows) else None
        return self.attention if window is None else replace(self.attention, window=window)

    def layer_kind(self, i: int | None = None) -> LayerKind:
        """Block i's kind, one object per distinct kind; None: `block` under `attention`."""
        block = self.block if i is None else self.layer_block(i)
        att = self.attention if i is None else self.layer_attention(i)
        return memoized(self, "kind", (id(block), att), lambda: LayerKind(block, att))

    def kinds(self, layers: Iterable[int]) -> list[tuple[LayerKind, int]]:
        """The distinct kinds of these blocks with how many of them each, in first-seen order."""
        counts: dict[int, list] = {}
        for i in layers:
            kind = self.layer_kind(i)
            counts.setdefault(id(kind), [kind, 0])[1] += 1
        return [(kind, n) for kind, n in counts.values()]

    def matmuls(self, fused: bool = False) -> list[Matmul]:
        """The block's matmuls; `fused`: its fused groups as one each (`Block.fused`)."""
        return self.block.matmuls(fused)

    def flops(self, seq_len: int) -> int:
        """`flops_per_token(seq_len)`, computed once per sequence length."""
        return memoized(self, "flops", (seq_len,), lambda: self.flops_per_token(seq_len))

    def cheap_matmuls(self) -> list[Matmul]:
        """The block's matmuls among `cheap_to_recompute` (what selective "cheap" runs again)."""
        return [m for m in self.matmuls() if m.name in self.cheap_to_recompute]

    def collectives(self, tp: int, cp: int, ep: int, dispatch: Dispatch = Dispatch()) -> list[BlockCollective]:
        return self.block.collectives(tp, cp, ep, self.attention, dispatch)


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
