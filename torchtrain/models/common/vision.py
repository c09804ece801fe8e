"""A vision transformer over packed image patches (Qwen2.5/3/3.5-VL's encoder shape), its arguments, and
the patch merger that turns its output into decoder tokens.

An image is resized to a grid of (h, w) patches of p x p pixels (`data/image/pixels.py`), each repeated over T
frames (a still image is its own video of T = temporal_patch_size frames), so a patch is one vector of
C T p p values. Patches come in **merge-block order**: the m x m patches that become one decoder token are
consecutive (block row, block column, row in block, column in block). Images of a batch are packed into
one sequence of N patches with no padding; `grid` (images, 3) holds each one's (t, h, w).

    x_n   = W_patch patch_n + b + sum_k w_nk E[i_nk]        learned positions: the side x side table E
                                                            resampled to the image's h x w grid
                                                            (bilinear, corners aligned: 4 taps i_nk, w_nk)
    x    <- x + Attn(LN1(x));  x <- x + MLP(LN2(x))         per block (pre-LayerNorm, GELU-tanh MLP)
    Attn: softmax(q k^T / sqrt(d)) v within each image frame (no attention across images: per-image
          boundaries, exactly what encoding each image alone gives), 2D RoPE on q and k:
          pair i of a head (x_i, x_{i+d/2}) turns by row x f_i for i < d/4, by column x f_{i-d/4} after,
          f_i = theta^(-4i/d)  (the "rotate half" layout, `rope.py`)
    token = W_2 GELU(W_1 concat(LN(x_n) for the m^2 patches of a block)) + b     (the patch merger)

so an image of t x h x w patches gives t h w / m^2 decoder tokens of the decoder's width. The patch
embedding is HF's Conv3d with stride = kernel, i.e. one matmul per patch: a Linear here (TP and float8 see
a plain matmul). Queries, keys and values are three projections (HF fuses them in one `qkv`), so tensor
parallelism splits them by heads. No parallel code: TP/FSDP/PP are applied from outside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.models.base import InitSpec
from torchtrain.models.common.rope import apply_rope, frequencies
from torchtrain.utils.not_compiled import not_compiled


@dataclass
class VisionArgs:
    """The vision encoder's arguments (a family's args inherit them; `vision_depth = 0`: no encoder)."""

    vision_depth: int = 0
    """Encoder blocks (HF vision_config.depth); 0 builds a text-only model."""

    vision_dim: int = 1152
    """Encoder width (HF vision_config.hidden_size)."""

    vision_heads: int = 16
    """Encoder attention heads (HF vision_config.num_heads)."""

    vision_hidden_dim: int = 4304
    """Encoder MLP hidden size (HF vision_config.intermediate_size)."""

    vision_patch_size: int = 16
    """Patch side in pixels."""

    vision_temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""

    vision_merge_size: int = 2
    """Side of the block of patches the merger turns into one decoder token."""

    vision_in_channels: int = 3
    """Colour channels of a patch."""

    vision_num_position_embeddings: int = 2304
    """Rows of the learned position table (a square: side = sqrt of this)."""

    vision_rope_theta: float = 10000.0
    """Base of the encoder's 2D RoPE."""

    vision_norm_eps: float = 1e-6
    """LayerNorm epsilon of the encoder and the merger."""

    @property
    def vision(self) -> bool:
        return self.vision_depth > 0

    @property
    def patch_dim(self) -> int:
        return self.vision_in_channels * self.vision_temporal_patch_size * self.vision_patch_size ** 2

    def image_geometry(self) -> tuple[int, int, int] | None:
        if not self.vision:
            return None
        return self.vision_patch_size, self.vision_temporal_patch_size, self.vision_merge_size

    def validate_vision(self) -> None:
        if not self.vision:
            if self.vision_depth < 0:
                raise ConfigError(f"[model.vision_depth] must be >= 0, got {self.vision_depth}")
            return
        for key in ("vision_dim", "vision_heads", "vision_hidden_dim", "vision_patch_size",
                    "vision_temporal_patch_size", "vision_merge_size", "vision_in_channels",
                    "vision_num_position_embeddings"):
            if getattr(self, key) < 1:
                raise ConfigError(f"[model.{key}] must be >= 1, got {getattr(self, key)}")
        if self.vision_dim % self.vision_heads or (self.vision_dim // self.vision_heads) % 4:
            raise ConfigError(f"[model.vision_heads] {self.vision_heads} must divide model.vision_dim "
                              f"{self.vision_dim} into heads whose width is a multiple of 4 (2D RoPE: a quarter "
                              f"of each head's pairs per axis)")
        side = round(self.vision_num_position_embeddings ** 0.5)
        if side * side != self.vision_num_position_embeddings:
            raise ConfigError(f"[model.vision_num_position_embeddings] {self.vision_num_position_embeddings} must be "
                              f"a square (the learned positions are a side x side grid)")

    def vision_params(self) -> int:
        """Parameters of the encoder and its merger (`output_dim`: the decoder's width)."""
        if not self.vision:
            return 0
        d, f, merged = self.vision_dim, self.vision_hidden_dim, self.vision_dim * self.vision_merge_size ** 2
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        merger = 2 * d + merged * merged + merged + merged * self.dim + self.dim
        return (self.patch_dim + 1) * d + self.vision_num_position_embeddings * d + self.vision_depth * block + merger


# --------------------------------------------------------------------------- geometry of packed patches
def patch_coordinates(grid: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, height-of-its-image, width-of-its-image) of every packed patch, in merge-block order
    (module doc), frames repeated; `grid` (images, 3) of (t, h, w)."""
    grid = grid.long()
    counts = grid.prod(-1)
    h = torch.repeat_interleave(grid[:, 1], counts)
    w = torch.repeat_interleave(grid[:, 2], counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    within = (torch.arange(int(counts.sum()), device=grid.device) - starts) % (h * w)  # index in its frame
    blocks_w = w // merge
    block, inside = within // (merge * merge), within % (merge * merge)
    row = (block // blocks_w) * merge + inside // merge
    col = (block % blocks_w) * merge + inside % merge
    return row, col, h, w


def frame_lengths(grid: torch.Tensor) -> list[int]:
    """Patches per attention segment: each frame of each image (h x w), in packed order."""
    return torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).tolist()


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (2) and weights into a `side`-long axis for target `index` of an axis of `size`, corners
    aligned (target 0 -> source 0, target size-1 -> source side-1)."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    low = torch.floor(src)
    frac = src - low
    taps = torch.stack([low.long(), low.long() + 1], dim=-1).clamp(0, side - 1)
    return taps, torch.stack([1 - frac, frac], dim=-1)


def position_taps(grid: torch.Tensor, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, weights) (N, 4) into the flattened side x side learned table resampling it to every packed
    patch's place in its image (module doc)."""
    row, col, h, w = patch_coordinates(grid, merge)
    rt, rw = _axis_taps(row, h, side)
    ct, cw = _axis_taps(col, w, side)
    indices = (rt[:, :, None] * side + ct[:, None, :]).flatten(1)
    weights = (rw[:, :, None] * cw[:, None, :]).flatten(1)
    return indices, weights


def vision_rope_rows(grid: torch.Tensor, merge: int, head_dim: int, theta: float) -> torch.Tensor:
    """(1, N, head_dim) per-patch RoPE rows (`rope.py`'s (cos, sin) pairs format): the first head_dim / 4
    pairs turn by the patch's row, the next head_dim / 4 by its column."""
    row, col, _, _ = patch_coordinates(grid, merge)
    freqs = frequencies(head_dim // 2, theta, grid.device).float()
    angles = torch.cat([row[:, None].float() * freqs, col[:, None].float() * freqs], dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).flatten(-2).unsqueeze(0)


# --------------------------------------------------------------------------- modules
@not_compiled
def per_frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention of (1, heads, N, d) packed frames, each alone (no N x N mask). Left out of
    compiled graphs (`utils/not_compiled.py`): the frame lengths change with every batch (the projections around
    it compile)."""
    if len(lengths) <= 1:
        return F.scaled_dot_product_attention(q, k, v)
    return torch.cat([F.scaled_dot_product_attention(*parts)
                      for parts in zip(*(t.split(lengths, dim=2) for t in (q, k, v)))], dim=2)


class VisionAttention(nn.Module):
    """Bidirectional attention within each frame (module doc); heads by `-1`, so a TP shard runs it too."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q, k, v = (proj(x).unflatten(-1, (-1, self.head_dim)).unsqueeze(0) for proj in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, rope, "half"), apply_rope(k, rope, "half")
        out = per_frame_attention(*(t.transpose(1, 2) for t in (q, k, v)), lengths)  # (1, heads, N, head_dim)
        return self.wo(out.transpose(1, 2).flatten(2).squeeze(0))


class VisionMLP(nn.Module):
    """w2(gelu_tanh(w1 x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """x + attention(LN(x)), then + MLP(LN(.)); the decoder block's names."""

    def __init__(self, dim: int, n_heads: int, hidden: int, eps: float):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim, eps=eps)
        self.attention = VisionAttention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim, eps=eps)
        self.feed_forward = VisionMLP(dim, hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class PatchMerger(nn.Module):
    """Each block of m^2 consecutive patches -> one token: w2(gelu(w1 concat(LN(patches))))."""

    def __init__(self, dim: int, merge: int, out_dim: int, eps: float):
        super().__init__()
        self.merged = dim * merge * merge
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.w1, self.w2 = nn.Linear(self.merged, self.merged), nn.Linear(self.merged, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(self.norm(x).reshape(x.shape[0] // (self.merged // x.shape[1]), self.merged))))


class VisionEncoder(nn.Module):
    """(pixel patches (N, C T p p), grid (images, 3)) -> decoder tokens (N / m^2, out_dim); module doc."""

    def __init__(self, args: VisionArgs, out_dim: int):
        super().__init__()
        a = self.args = args
        self.patch_embed = nn.Linear(a.patch_dim, a.vision_dim)
        self.pos_embed = nn.Embedding(a.vision_num_position_embeddings, a.vision_dim)
        self.layers = nn.ModuleDict({str(i): VisionBlock(a.vision_dim, a.vision_heads, a.vision_hidden_dim,
                                                         a.vision_norm_eps) for i in range(a.vision_depth)})
        self.merger = PatchMerger(a.vision_dim, a.vision_merge_size, out_dim, a.vision_norm_eps)

    def forward(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        a = self.args
        side = round(a.vision_num_position_embeddings ** 0.5)
        taps, weights = position_taps(grid, a.vision_merge_size, side)
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        x = x + (self.pos_embed(taps) * weights.unsqueeze(-1).to(x.dtype)).sum(1)
        rope = vision_rope_rows(grid, a.vision_merge_size, a.vision_dim // a.vision_heads, a.vision_rope_theta)
        lengths = frame_lengths(grid)
        for block in self.layers.values():
            x = block(x, rope, lengths)
        return self.merger(x)


def vision_init_spec(fqn: str) -> InitSpec:
    """Initialisation of encoder parameter `fqn` (relative to the encoder): LayerNorms 1 and 0, biases 0,
    the position table N(0, 0.02^2), every matrix truncated N(0, 0.02^2)."""
    if "norm." in fqn:
        return InitSpec("ones" if fqn.endswith("weight") else "zeros")
    if fqn.endswith("bias"):
        return InitSpec("zeros")
    if fqn == "pos_embed.weight":
        return InitSpec("normal", std=0.02)
    return InitSpec("trunc_normal", std=0.02)
