"""Gated DeltaNet: linear attention by the gated delta rule, the token mixer of the hybrid decoders'
linear layers (Qwen3.5, Qwen3-Next). For x (B, L, D):

    q, k, v = silu(conv(x W_q)), silu(conv(x W_k)), silu(conv(x W_v))   causal depthwise convolutions of
                                                                        K taps over the sequence
    q, k   <- L2-normalised per head;  q <- q / sqrt(d_k)
    beta    = sigmoid(x W_b)                                 one per value head
    g       = -exp(A_log) softplus(x W_a + dt_bias)          log-decay per value head (<= 0)
    o       = gated delta rule(q, k, v, g, beta)             (`delta_rule.py`: a recurrent state per head)
    y       = W_o [RMSNorm(o_h) silu(z_h)]_h,  z = x W_z      (one norm weight shared by the heads)

Heads: H_k query/key heads of width d_k and H_v value heads of width d_v, H_v a multiple of H_k (each key
head serves H_v / H_k consecutive value heads). Cost per token: the projections' matmuls plus the delta
rule's O(d_k d_v) per value head -- linear in the sequence, with a state of H_v d_k d_v floats.

**Documents** (block-causal masks: `ctx.positions`, 0 at each document start): the state is reset at a
document's first token and a convolution tap s tokens back is used only where the token's position in
its document is >= s, so packed documents compute what each alone does.

**Parallelism** is applied from outside: tensor parallelism splits the heads (the input projections
column-parallel, the convolutions' channels and the per-head decay parameters with them
(`models/common/tp.py::LocalShards`), the output projection row-parallel, the shared norm weight's
gradient summed); context parallelism replaces `core` (`LinearAttentionCore`) by its sequence-sharded
version (`distributed/context_parallel_linear.py`), which hands each shard the exact recurrent state and
convolution context of the tokens before it.

**Incremental decoding** (`kv_cache.py`): the core reads and keeps the convolution's last inputs and the
recurrent state in the cache; left padding and scratch slots are identity steps (zero inputs, no write, no decay).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.models.base import InitSpec
from torchtrain.models.common import delta_rule
from torchtrain.models.common.attention import AttentionContext
from torchtrain.models.common.layers import RMSNorm, local_tensor


def causal_conv(x: torch.Tensor, left: torch.Tensor, weight: torch.Tensor,
                positions: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution over the sequence: out_t = sum_s weight[:, K-1-s] x_{t-s} for x (B, L, C),
    the K - 1 tokens before it `left` (B, K-1, C: zeros at a sequence start), weight (C, K). With document
    `positions` (B, L), tap s is used only where positions >= s (the token s back is in the same document)."""
    taps = weight.shape[1]
    ext = torch.cat([left.to(x.dtype), x], dim=1)
    if positions is None:
        return F.conv1d(ext.transpose(1, 2), weight.unsqueeze(1).to(x.dtype), groups=weight.shape[0]).transpose(1, 2)
    length = x.shape[1]
    out = x * weight[:, taps - 1].to(x.dtype)
    for s in range(1, taps):
        visible = (positions >= s).unsqueeze(-1).to(x.dtype)
        out = out + ext[:, taps - 1 - s:taps - 1 - s + length] * visible * weight[:, taps - 1 - s].to(x.dtype)
    return out


def document_starts(ctx: AttentionContext) -> torch.Tensor | None:
    """(B, L) True at each document's first token (block-causal forwards), else None."""
    return None if ctx.positions is None else ctx.positions == 0


FUSED_PART = re.compile(r"^(.*\.)(in_proj|conv)_([qkv])\.weight$")
"""A Gated DeltaNet parameter Hugging Face stores fused with two others: (prefix, "in_proj" or "conv", part)."""


def fused_part(key: str) -> tuple[str, str, int] | None:
    """(prefix, kind, index) when `key` is the q (0), k (1) or v (2) part of the layer's q/k/v projection
    ("in_proj") or convolution ("conv"), which Hugging Face stores as one tensor each (`in_proj_qkv`,
    `conv1d`, rows [q | k | v]); None otherwise."""
    match = FUSED_PART.match(key)
    return (match.group(1), match.group(2), "qkv".index(match.group(3))) if match else None


def to_fused(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """Part `key` (`fused_part`) in Hugging Face's layout: a convolution's (channels, taps) as (channels, 1, taps)."""
    return tensor.unsqueeze(1) if fused_part(key)[1] == "conv" else tensor


def from_fused(key: str, tensor: torch.Tensor, key_width: int, value_width: int) -> torch.Tensor:
    """Part `key`'s rows of Hugging Face's fused tensor (q and k `key_width` rows each, v `value_width`), in
    torchtrain's layout."""
    _, kind, part = fused_part(key)
    start = key_width * min(part, 2)
    rows = tensor[start:start + (value_width if part == 2 else key_width)]
    return rows.squeeze(1) if kind == "conv" else rows


class LinearAttentionCore(nn.Module):
    """The sequence-dependent part of a linear-attention layer on one rank: the causal convolutions (zeros
    before the sequence) and the delta rule (zero initial state). Context parallelism replaces it."""

    def __init__(self, kernel: str = "chunked", chunk_size: int = 64):
        super().__init__()
        self.kernel, self.chunk_size = kernel, chunk_size

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}, chunk_size={self.chunk_size}"

    def conv(self, x: torch.Tensor, weight: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        cache = ctx.extra.get("kv_cache")
        if cache is None:
            left = x.new_zeros(x.shape[0], weight.shape[1] - 1, x.shape[2])
            return causal_conv(x, left, weight, ctx.positions)
        # incremental decoding (`kv_cache.py`): the inputs before these slots from the cache; padding and scratch
        # slots read as zeros (as before a sequence start) and are not kept
        valid = cache.valid(x.shape[1])
        x = x * valid.unsqueeze(-1).to(x.dtype)
        left = cache.state(self, "conv")
        if left is None:
            left = x.new_zeros(x.shape[0], weight.shape[1] - 1, x.shape[2])
        kept = int(valid.shape[1] if cache.keep is None else cache.keep)
        cache.set_state(self, "conv", torch.cat([left, x[:, :kept]], dim=1)[:, kept:])
        return causal_conv(x, left, weight, None)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            ctx: AttentionContext) -> torch.Tensor:
        cache = ctx.extra.get("kv_cache")
        if cache is None:
            out, _ = delta_rule.gated_delta_rule(q, k, v, g, beta, resets=document_starts(ctx), kernel=self.kernel,
                                                 chunk_size=self.chunk_size)
            return out
        valid = cache.valid(q.shape[1]).unsqueeze(-1)  # padding and scratch slots: no write (beta 0), no decay (g 0)
        out, state = delta_rule.gated_delta_rule(q, k, v, g * valid, beta * valid, cache.state(self, "delta"),
                                                 kernel=self.kernel, chunk_size=self.chunk_size)
        cache.set_state(self, "delta", state)
        return out


class ShortConv(nn.Module):
    """The weight (channels, taps) of a depthwise causal convolution; forward returns this rank's channels."""

    def __init__(self, channels: int, taps: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, taps))

    def forward(self) -> torch.Tensor:
        return local_tensor(self.weight)


class DecayGate(nn.Module):
    """g = -exp(A_log) softplus(a + dt_bias) per value head: A_log and dt_bias (H_v,), in float32."""

    def __init__(self, heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        a_log, dt_bias = local_tensor(self.A_log), local_tensor(self.dt_bias)
        return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """x (B, L, D) -> (B, L, D); see the module doc. `forward(x, rope, ctx)` takes the attention layers'
    arguments (RoPE is unused), so a decoder block holds either kind."""

    def __init__(self, dim: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, conv_taps: int,
                 norm_eps: float, kernel: str = "chunked", chunk_size: int = 64):
        super().__init__()
        self.key_dim, self.value_dim = key_dim, value_dim
        self.in_proj_q = nn.Linear(dim, key_heads * key_dim, bias=False)
        self.in_proj_k = nn.Linear(dim, key_heads * key_dim, bias=False)
        self.in_proj_v = nn.Linear(dim, value_heads * value_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, value_heads * value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, value_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, value_heads, bias=False)
        self.conv_q = ShortConv(key_heads * key_dim, conv_taps)
        self.conv_k = ShortConv(key_heads * key_dim, conv_taps)
        self.conv_v = ShortConv(value_heads * value_dim, conv_taps)
        self.decay = DecayGate(value_heads)
        self.norm = RMSNorm(value_dim, norm_eps)
        self.out_proj = nn.Linear(value_heads * value_dim, dim, bias=False)
        self.core = LinearAttentionCore(kernel, chunk_size)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, ctx: AttentionContext) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x)
        widths = [q.shape[-1], k.shape[-1], v.shape[-1]]
        weight = torch.cat([self.conv_q(), self.conv_k(), self.conv_v()])
        mixed = F.silu(self.core.conv(torch.cat([q, k, v], dim=-1), weight, ctx))
        q, k, v = mixed.split(widths, dim=-1)
        q = l2_normalise(q.view(bsz, seqlen, -1, self.key_dim)) * self.key_dim ** -0.5
        k = l2_normalise(k.view(bsz, seqlen, -1, self.key_dim))
        v = v.reshape(bsz, seqlen, -1, self.value_dim)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = self.decay(self.in_proj_a(x))
        out = self.core.mix(q, k, v, g, beta, ctx).to(x.dtype)
        z = self.in_proj_z(x).view(bsz, seqlen, -1, self.value_dim)
        out = self.norm(out) * F.silu(z)
        return self.out_proj(out.reshape(bsz, seqlen, -1))

    @staticmethod
    def init_spec(name: str, std: float, out_std: float, conv_taps: int) -> InitSpec | None:
        """Init of the layer's parameter `name` (relative to the layer), None for its linear layers' weights
        but the output projection (the caller's default): the convolutions truncated N(0, 1/taps) (a
        default convolution's scale), A_log the log of U(0.01, 16) (decay rates spread over orders of
        magnitude), dt_bias 1, the norm 1, out_proj truncated N(0, out_std^2)."""
        if name.startswith("conv_"):
            return InitSpec("trunc_normal", std=conv_taps ** -0.5)
        if name == "decay.A_log":
            return InitSpec("log_uniform", low=0.01, high=16.0)
        if name in ("decay.dt_bias", "norm.weight"):
            return InitSpec("ones")
        if name == "out_proj.weight":
            return InitSpec("trunc_normal", std=out_std)
        return None
