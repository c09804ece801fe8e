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

Memory, per patch, with b compute bytes, s the LayerNorm statistics' bytes, P a patch's values, H heads and tp
the TP degree (counted op by op on the real encoder: tests/test_planner_vlm.py):

    stored by a block    4 b d + 4 s                      both LayerNorms' inputs and outputs, their statistics
                         + (4 b d + 4 H + 2 b f) / tp     rotated q, k, v, the attention output and log-sum-exp,
                                                          the MLP's hidden (its first layer's output and GELU's)
                         + b d / tp                       with several frames packed: the attention output's copy
                                                          (its per-frame parts concatenated) that W_o reads
    stored outside them  b P + 32 + 4 b                   cast pixels, the position table's 4 taps and weights
                         + 2 b d + 2 s + 2 b d / tp       the merger's LayerNorm in and out, its hidden
                         + 4 d / H                        the patches' RoPE angles (float32, shared by the blocks)
    kept by a block under op-level checkpointing: its input and every matmul and attention output,
                         3 b d + (4 b d + 4 H + b f) / tp
    moved forward by a block's memory-bound kernels: two LayerNorms, RoPE on q and k, two residual adds, GELU and
    the attention output's copy (compiled blocks fuse them).
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

    def block_bytes_per_patch(self, b: int, s: int, tp: int, packed_frames: bool) -> float:
        """Bytes one block stores per patch for backward, without checkpointing (module doc)."""
        d = self.dim
        copy = b * d if packed_frames else 0.0
        return 4 * b * d + 4 * s + (4 * b * d + 4 * self.heads + 2 * b * self.hidden + copy) / tp

    def rest_bytes_per_patch(self, b: int, s: int, tp: int) -> float:
        """Bytes the encoder stores per patch outside its blocks (module doc)."""
        d = self.dim
        return b * self.patch_dim + 32 + 4 * b + 2 * b * d + 2 * s + 2 * b * d / tp + (4 * self.head_dim if self.depth
                                                                                       else 0)

    def op_kept_bytes_per_patch(self, b: int, tp: int) -> float:
        """Bytes a block keeps per patch under op-level checkpointing (module doc)."""
        return 3 * b * self.dim + (4 * b * self.dim + 4 * self.heads + b * self.hidden) / tp

    def memory_bytes_per_patch(self, b: int, tp: int, compiled: bool, norm: float) -> float:
        """Forward bytes per patch a block's memory-bound kernels move, `norm` per normalised element."""
        d, f = self.dim, self.hidden
        rope = (2 * b if compiled else 2 * b + 16) * 2 * d / tp
        return 2 * norm * d + rope + (4 if compiled else 6) * b * d + (2 * b * f + 2 * b * d) / tp

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
