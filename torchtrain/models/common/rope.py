"""Rotary position embeddings (RoPE) of the decoder families: one table format, three frequency
schedules, three pair layouts.

A table is (max_seq_len, d) float32: for each pair i < d/2 the rotation scale x e^(i x angle), angle =
position x freq_i, stored as (cos, sin) pairs -- the layout of a complex tensor, so it reads as complex
numbers without a copy. `rope` arguments are the table (rows 0..seq-1 are used), per-token
rows (batch or 1, seq, d) (`common/attention.py::attention_inputs`, for document positions and context
parallelism), or those rows already shaped as (cos, sin) pairs (`rotations`: what the decoder hands its
blocks, prepared once per forward). A rotation is one complex multiplication in float32: the fewest
operations eagerly, and one fused kernel under torch.compile.

Frequencies (`frequencies`): theta^(-2i/d), optionally rescaled for long contexts by

* Llama 3's schedule (`llama3_scaled`): wavelengths above original_max / low_freq_factor are divided by
  the factor, those below original_max / high_freq_factor kept, the ones between interpolated;
* YaRN (`yarn_scaled`, DeepSeek-V3): kept above beta_fast rotations over the original context,
  divided by the factor below beta_slow, linear in between (HF transformers'
  `_compute_yarn_parameters`, which the published checkpoints use); its table is also scaled by the
  attention factor (`rope_table(scale=...)`).

Pair layouts (`apply_rope(layout=...)`):

* `pairs`: (x[2i], x[2i+1]) rotated in place (Meta's Llama layout);
* `half`: (x[i], x[i + d/2]) rotated in place (Hugging Face's "rotate half", Qwen3);
* `pairs_to_half`: (x[2i], x[2i+1]) rotated, the result holding the rotated first elements then the
  second ones (DeepSeek-V3's interleaved checkpoints: the same permutation for queries and keys, so
  their dot products are unchanged).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

PairLayout = Literal["pairs", "half", "pairs_to_half"]


def frequencies(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies theta^(-2i/dim), float64."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))


def llama3_scaled(freqs: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_seq_len: int) -> torch.Tensor:
    """Llama 3's long-context scaling of `freqs` (see the module doc)."""
    lo, hi, old_len = low_freq_factor, high_freq_factor, original_max_seq_len
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - lo) / (hi - lo)
    interpolated = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > old_len / lo, freqs / factor, interpolated)
    return torch.where(wavelen < old_len / hi, freqs, out)


def yarn_scaled(freqs: torch.Tensor, theta: float, factor: float, original_max_seq_len: int, beta_fast: float,
                beta_slow: float, truncate: bool = True) -> torch.Tensor:
    """YaRN's blend of `freqs` (see the module doc); unchanged when `factor` <= 1. `truncate`: the ramp's
    ends are rounded to whole dimensions (DeepSeek-V3; gpt-oss keeps them fractional)."""
    if factor <= 1:
        return freqs
    d = 2 * freqs.shape[0]

    def dim_of(rotations: float) -> float:
        return d * math.log(original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64, device=freqs.device) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention-temperature correction: 0.1 mscale ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_table(freqs: torch.Tensor, max_seq_len: int, scale: float = 1.0) -> torch.Tensor:
    """(max_seq_len, 2 x len(freqs)) float32 on `freqs`' device: (cos, sin) of each angle, pair by pair,
    times `scale` (see the module doc)."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=freqs.device), freqs)
    return (torch.stack([angles.cos(), angles.sin()], dim=-1).flatten(-2) * scale).float()


def mrope_axes(pairs: int, sections: tuple[int, ...]) -> torch.Tensor:
    """(pairs,) the position axis (0 time, 1 height, 2 width) each RoPE pair turns by under multimodal RoPE,
    interleaved (Qwen3-VL / Qwen3.5): pair i follows height when i % 3 == 1 and i < 3 x sections[1], width
    when i % 3 == 2 and i < 3 x sections[2], time otherwise."""
    i = torch.arange(pairs)
    axis = torch.zeros(pairs, dtype=torch.long)
    axis[(i % 3 == 1) & (i < 3 * sections[1])] = 1
    axis[(i % 3 == 2) & (i < 3 * sections[2])] = 2
    return axis


def mrope_rows(table: torch.Tensor, positions: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """Per-token rows (batch, seq, d) of a RoPE `table` for three positions per token (batch, seq, 3): pair i
    is the table's pair i at the position of axis `axes[i]` (`mrope_axes`). Three equal positions give the
    table's row at that position."""
    rows = table[positions.to(table.device)]  # (batch, seq, 3, d)
    column_axis = axes.to(table.device).repeat_interleave(2)  # each pair's (cos, sin) columns
    index = column_axis.view(1, 1, 1, -1).expand(*rows.shape[:2], 1, -1)
    return rows.gather(2, index).squeeze(2)


def rotations(rope: torch.Tensor, seqlen: int) -> torch.Tensor:
    """The (cos, sin) pairs (batch or 1, seqlen, 1, d/2, 2) of a table's first `seqlen` rows or of per-token
    rows (batch, seq, d); views, no copy. Pairs already in that shape keep their first `seqlen` rows."""
    if rope.dim() == 5:
        return rope if rope.shape[1] == seqlen else rope[:, :seqlen]
    if rope.dim() == 2:
        rope = rope[:seqlen].unsqueeze(0)
    return rope.unflatten(-1, (-1, 2)).unsqueeze(2)


def apply_rope(x: torch.Tensor, rope: torch.Tensor, layout: PairLayout = "pairs") -> torch.Tensor:
    """Rotate the pairs of x (batch, seq, heads, d) by their angles, in float32; `layout` as the module
    doc says. Eagerly, the pair layouts are one complex multiplication of a view of x (the fewest
    operations); "half" pairs and torch.compile use the same products in real arithmetic ("half" would
    otherwise store its complex numbers as a new tensor for backward; Inductor fuses the real products
    into one kernel and generates no complex code)."""
    rot = rotations(rope, x.shape[1])
    if rot.dtype in (torch.bfloat16, torch.float16):  # a table cast down on its way (a wrapper's input cast)
        rot = rot.float()
    xf = x.float()
    half = x.shape[-1] // 2
    if layout == "half" or torch.compiler.is_compiling():  # "half": its complex numbers would be a new tensor
        first, second = (xf[..., :half], xf[..., half:]) if layout == "half" else (xf[..., 0::2], xf[..., 1::2])
        cos, sin = rot[..., 0], rot[..., 1]
        turned = (first * cos - second * sin, second * cos + first * sin)
        out = torch.stack(turned, dim=-1).flatten(-2) if layout == "pairs" else torch.cat(turned, dim=-1)
        return out.to(x.dtype)
    z = torch.view_as_complex(xf.unflatten(-1, (-1, 2)) if xf.is_contiguous() else
                              xf.contiguous().unflatten(-1, (-1, 2)))
    turned = z * torch.view_as_complex(rot)
    out = torch.view_as_real(turned).flatten(-2) if layout == "pairs" else torch.cat([turned.real, turned.imag], -1)
    return out.to(x.dtype)
