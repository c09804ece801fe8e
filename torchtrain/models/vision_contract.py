"""A vision encoder as the planner reads it (`ModelContract.vision`): the shared encoder of
`models/common/vision.py` declared from its arguments -- sizes, one block's modules and the rest's (patch
embedding, position table, merger), each with the tensor-parallel styles its plan applies
(`models/common/tp.py::vision_encoder_plan`, read here, not restated) -- and what follows from them.

An image of t x h x w patches (N = t h w, frames of F = h w patches) costs, forward, with d the encoder's
width, f its MLP width, P the patch's values, m the merge side, M = d m^2 and D the decoder's width:

    2 N P d                                patch embedding
    + depth (2 N (4 d^2 + 2 d f)           per block: q, k, v, o and the MLP
             + 4 t F^2 d)                  bidirectional attention within each frame (q k^T and a v)
    + 2 (N / m^2)(M^2 + M D)               the merger's two layers, per decoder token

and training three times that (the 6N convention; the patch embedding's input gradient, 2 N P d, is not
run: pixels need none). Its tensor-parallel collectives come from the plan over plain replicated
patches (`block_modules.tp_collectives(..., plain_inputs=True)`): per block an all-reduce of N x d after
each row-parallel layer in forward and one of each column-parallel layer's input gradient in backward;
the merger's likewise, per decoder token.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.models.block_modules import tp_collectives, vision_block_modules, vision_rest_modules
from torchtrain.models.block_shape import Block
from torchtrain.models.collectives import BlockCollective
from torchtrain.models.common.tp import vision_encoder_plan


@dataclass(frozen=True)
class VisionShape:
    """The encoder's sizes and modules (module doc)."""

    depth: int
    dim: int
    heads: int
    hidden: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    patch_dim: int
    """Values of one patch: channels x temporal_patch_size x patch_size^2."""
    out_dim: int
    """The decoder's width (the merger's output)."""
    block: Block
    """One encoder block: its modules and TP styles (names relative to the block)."""
    rest: Block
    """The patch embedding, position table and merger (names relative to the encoder)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def merged(self) -> int:
        """The merger's width: m^2 patches concatenated."""
        return self.dim * self.merge_size ** 2

    @property
    def num_params(self) -> int:
        shapes = self.block.params(1, 1)[0] * self.depth + self.rest.params(1, 1)[0]
        return sum(r * c for r, c in shapes)

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Decoder tokens of an image of `grid` (t, h, w) patches."""
        t, h, w = grid
        return t * h * w // self.merge_size ** 2

    def forward_flops(self, grid: tuple[int, int, int]) -> int:
        """Forward FLOPs of one image of `grid` (t, h, w) patches (module doc)."""
        t, h, w = grid
        n, d = t * h * w, self.dim
        block = 2 * n * sum(m.in_features * m.out_features for m in self.block.matmuls()) + 4 * t * (h * w) ** 2 * d
        merger = 2 * self.tokens(grid) * sum(m.in_features * m.out_features for m in self.rest.matmuls()
                                             if m.name.startswith("merger."))
        return 2 * n * self.patch_dim * d + self.depth * block + merger

    def flops(self, grid: tuple[int, int, int]) -> int:
        """Training FLOPs of one image (forward and backward: 3 x forward, module doc)."""
        return 3 * self.forward_flops(grid)

    def block_collectives(self, tp: int) -> list[BlockCollective]:
        """One block's TP collectives, `per_token` meaning per patch."""
        return tp_collectives(self.block.plan, self.block.modules, tp, plain_inputs=True)

    def merger_collectives(self, tp: int) -> list[BlockCollective]:
        """The merger's TP collectives, `per_token` meaning per decoder token."""
        return tp_collectives(self.rest.plan, self.rest.modules, tp, plain_inputs=True)


def declare_vision(args, out_dim: int) -> VisionShape | None:
    """The encoder of `args` (a family's `VisionArgs`) feeding a decoder of width `out_dim`; None without one."""
    if not args.vision:
        return None
    d, plan = args.vision_dim, vision_encoder_plan(["0"])
    block_plan = {k.removeprefix("layers.0."): v for k, v in plan.items() if k.startswith("layers.0.")}
    rest_plan = {k: v for k, v in plan.items() if not k.startswith("layers.")}
    block = Block(block_plan, vision_block_modules(d, args.vision_hidden_dim), dim=d)
    rest = Block(rest_plan, vision_rest_modules(args.patch_dim, d, args.vision_num_position_embeddings,
                                                args.vision_merge_size, out_dim), dim=d)
    return VisionShape(args.vision_depth, d, args.vision_heads, args.vision_hidden_dim, args.vision_patch_size,
                       args.vision_temporal_patch_size, args.vision_merge_size, args.patch_dim, out_dim, block, rest)
