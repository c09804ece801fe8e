"""The gated delta rule: the token mixer of Gated DeltaNet (the linear-attention layers of Qwen3.5 and Qwen3-Next).

Per value head the state S is a (Dk, Dv) float32 matrix. For t = 1..L, with query q_t and key k_t (Dk),
value v_t (Dv), log-decay g_t <= 0 and learning rate beta_t in (0, 1):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t

that is: S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q. This is the recurrence of
transformers' `torch_recurrent_gated_delta_rule` once q and k are L2-normalised over Dk and q is scaled by
Dk^-0.5: the kernels here do neither -- the caller normalises and scales.

Shapes: q, k (B, L, Hk, Dk); v (B, L, Hv, Dv); g, beta (B, L, Hv), Hv a multiple of Hk (value head j reads
query/key head j // (Hv // Hk)); initial_state (B, Hv, Dk, Dv) or None (zeros). Every kernel returns
(o (B, L, Hv, Dv) in q's dtype, the final state (B, Hv, Dk, Dv) float32) and computes in float32.

Documents: `resets` (B, L) bool is True at a token that starts a new document of a packed sequence: the state
before it is discarded (S_{t-1} := 0 for that token; at t = 0 that discards the initial state), so a packed
sequence computes exactly what each document computes alone.

The chunked form (Yang et al., "Gated Delta Networks", the WY/UT representation). Split the sequence into
chunks of C tokens; within a chunk let G_i = g_1 + ... + g_i (i = 1..C), S_0 the incoming state and
seg_i = the number of resets among tokens 1..i of the chunk (a token's document within the chunk). Masks:
same_ij = [seg_i == seg_j], first_i = [seg_i == 0] (token i still sees S_0), last_j = [seg_j == seg_C]
(token j's document reaches the chunk's end), open = [seg_C == 0] (no reset in the chunk). Then with

    D_ij = exp(G_i - G_j) [j <= i] same_ij              (decay from token j to token i, same document)
    A_ij = beta_i (k_i . k_j) D_ij [j < i]              (strictly lower triangular)
    T = (I + A)^-1,   U = T diag(beta) V,   W = T diag(beta exp(G) first) K
    V_new = U - W S_0                                   (the chunk's deltas, "pseudo-values")
    O = diag(exp(G) first) Q S_0 + ((Q K^T) * D) V_new
    S_C = exp(G_C) open S_0 + (K * exp(G_C - G) last)^T V_new

so a chunk is a handful of batched matmuls and only S_0 -> S_C is carried from chunk to chunk: one short loop of
two matmuls a chunk, on every (batch, head) at once. Masked decays enter as exp(-inf) = 0, never as a huge
negative g (whose float32 cumulative sums would lose the small decays). Lengths are padded to a multiple of C
with g = 0, beta = 0, k = 0, which leaves the state unchanged. T is formed by 2 x 2 blocks (LAPACK's batched
triangular solve is slow on many small matrices) in a small autograd Function (dA = -(T^T dT T^T), strictly
lower); everything else is plain autograd, and nothing branches on tensor values, so `torch.compile` traces the
kernel whole. The Hv // Hk value heads of one key head share its K K^T and Q K^T (computed once per key head)
and, their rows stacked, one T-times-K matmul.

"fla" (`gated_delta_rule(kernel="fla")`) is flash-linear-attention's Triton kernel (CUDA, an optional extra),
given the same convention (scale 1, no in-kernel normalisation); packed documents go to it as varlen
cu_seqlens over the batch flattened into one row (see `_fla_gated_delta_rule`).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from torchtrain.config.fields import ConfigError

KERNELS = ("chunked", "recurrent", "fla")


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    """Whether flash-linear-attention (`import fla`) is importable; cached."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        importlib.import_module("fla")
    except Exception:
        return False
    return True


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                  resets: Tensor | None) -> tuple[int, int, int, int, int, int]:
    """(B, L, Hk, Dk, Hv, Dv), after checking that the shapes agree."""
    B, L, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (B, L) or g.shape != (B, L, Hv) or beta.shape != (B, L, Hv):
        raise ValueError(f"gated delta rule: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)} do not agree")
    if Hv % Hk:
        raise ValueError(f"gated delta rule: {Hv} value heads are not a multiple of {Hk} key heads")
    if initial_state is not None and initial_state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"gated delta rule: initial_state {tuple(initial_state.shape)} != {(B, Hv, Dk, Dv)}")
    if resets is not None and resets.shape != (B, L):
        raise ValueError(f"gated delta rule: resets {tuple(resets.shape)} != {(B, L)}")
    return B, L, Hk, Dk, Hv, Dv


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None,
                               resets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The token-by-token recurrence of the module docstring: the reference, clear rather than fast.

    Returns (o (B, L, Hv, Dv) in q's dtype, the final state (B, Hv, Dk, Dv) float32); differentiable with
    respect to every tensor argument, the initial state included."""
    B, L, Hk, Dk, Hv, Dv = _check_shapes(q, k, v, g, beta, initial_state, resets)
    out_dtype, f32 = q.dtype, torch.float32
    q, k = (x.to(f32).repeat_interleave(Hv // Hk, dim=2) for x in (q, k))  # value head j reads key head j // G
    v, beta = v.to(f32), beta.to(f32)
    decay = g.to(f32).exp()
    if resets is not None:  # S_{t-1} := 0 before a document's first token
        decay = decay.masked_fill(resets.unsqueeze(-1).bool(), 0.0)
    state = v.new_zeros(B, Hv, Dk, Dv) if initial_state is None else initial_state.to(f32)
    outs = []  # unbind, not x[:, t]: the backward of L selects would write L full-size gradients
    for q_t, k_t, v_t, decay_t, beta_t in zip(*(x.unbind(1) for x in (q, k, v, decay, beta))):
        state = state * decay_t[:, :, None, None]
        delta = beta_t.unsqueeze(-1) * (v_t - torch.einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q_t))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, Hv, Dv)
    return o.to(out_dtype), state


def _to_chunks(x: Tensor, chunks: int, size: int, heads_k: int) -> Tensor:
    """(B, L, H[, D]) -> float32 (N, B, Hk, H // Hk, C[, D]), zero-padded to N * C tokens, contiguous: chunk
    first, so that one chunk's slice is one contiguous batch of matrices."""
    B, L, H = x.shape[:3]
    tail = x.shape[3:]
    x = torch.nn.functional.pad(x.to(torch.float32), (0, 0) * len(tail) + (0, 0, 0, chunks * size - L))
    x = x.view(B, chunks, size, heads_k, H // heads_k, *tail)
    return x.permute(1, 0, 3, 4, 2, *range(5, 5 + len(tail))).contiguous()


def _unit_lower_inverse(a: Tensor) -> Tensor:
    """(I + strictly_lower(a))^-1 over the last two dims, by 2 x 2 blocks down to 16 x 16 (LAPACK's batched
    triangular solve is slow on many small matrices): [[L1, 0], [X, L2]]^-1 = [[T1, 0], [-T2 X T1, T2]]."""
    c = a.shape[-1]
    if c <= 16:
        eye = torch.eye(c, dtype=a.dtype, device=a.device).expand_as(a)
        return torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True).contiguous()
    h = c // 2
    t1, t2 = _unit_lower_inverse(a[..., :h, :h]), _unit_lower_inverse(a[..., h:, h:])
    t21 = -(t2 @ (a[..., h:, :h] @ t1))
    return torch.cat([torch.cat([t1, t1.new_zeros(*t1.shape[:-1], c - h)], -1), torch.cat([t21, t2], -1)], -2)


class _UnitLowerInverse(torch.autograd.Function):
    """T = (I + A)^-1 for A the strictly lower part of the input; dA = -(T^T dT T^T), strictly lower."""

    @staticmethod
    def forward(a: Tensor) -> Tensor:
        return _unit_lower_inverse(a)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (t,) = ctx.saved_tensors
        return -(t.mT @ grad @ t.mT).tril(-1)


def chunked_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             initial_state: Tensor | None = None, resets: Tensor | None = None,
                             chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The chunked (WY/UT) form of the module docstring: equal to `recurrent_gated_delta_rule` up to float32
    rounding, in batched matmuls within chunks of `chunk_size` tokens and one short loop carrying the state.

    Differentiable with respect to every tensor argument, the initial state included (autograd, with one small
    Function for the triangular inverse); no branch on tensor values: `torch.compile` traces it whole (the chunk
    loop unrolls). Returns (o (B, L, Hv, Dv) in q's dtype, the final state (B, Hv, Dk, Dv) float32)."""
    B, L, Hk, Dk, Hv, Dv = _check_shapes(q, k, v, g, beta, initial_state, resets)
    if chunk_size < 1:
        raise ValueError(f"gated delta rule: chunk_size {chunk_size} < 1")
    out_dtype, f32, C = q.dtype, torch.float32, chunk_size
    N, G = max(1, -(-L // C)), Hv // Hk
    # padding: k = 0, beta = 0, g = 0 leave the state as it is; the padded outputs are dropped
    q, k = (_to_chunks(x, N, C, Hk) for x in (q, k))  # (N, B, Hk, 1, C, Dk): one key head serves G value heads
    v = _to_chunks(v, N, C, Hk)  # (N, B, Hk, G, C, Dv)
    g, beta = _to_chunks(g, N, C, Hk), _to_chunks(beta, N, C, Hk)  # (N, B, Hk, G, C)
    cum = g.cumsum(-1)  # G_i
    total = cum[..., -1:]  # G_C
    pairs = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    ninf = torch.tensor(float("-inf"), dtype=f32, device=q.device)
    if resets is None:
        decay_in, decay_out, decay_chunk = cum.exp(), (total - cum).exp(), total.exp()
    else:
        r = torch.nn.functional.pad(resets, (0, N * C - L)).view(B, N, C).transpose(0, 1)
        seg = r.to(torch.int32).cumsum(-1)[:, :, None, None, :]  # (N, B, 1, 1, C): the document within the chunk
        pairs = pairs & (seg.unsqueeze(-1) == seg.unsqueeze(-2))  # same document
        decay_in = torch.where(seg == 0, cum, ninf).exp()  # exp(G_i), 0 where the incoming state was discarded
        decay_out = torch.where(seg == seg[..., -1:], total - cum, ninf).exp()  # exp(G_C - G_j), 0: not carried
        decay_chunk = torch.where(seg[..., -1:] == 0, total, ninf).exp()  # exp(G_C), 0 if the chunk resets
    # D_ij = exp(G_i - G_j) for j <= i in one document (-inf before exp elsewhere: no overflow, zero gradient)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~pairs, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)  # at Hk heads
    a = kk * (decay * beta.unsqueeze(-1))  # A + diagonal: the solve reads the strictly lower part only
    t = _UnitLowerInverse.apply(a)  # (I + A)^-1
    t = t * beta.unsqueeze(-2)  # T diag(beta): scaling C x C rather than C x D
    u = t @ v  # (N, B, Hk, G, C, Dv)
    # -W = -T diag(beta exp(G)) K, the G value heads' rows stacked against their one key head (k not repeated)
    w = ((t * -decay_in.unsqueeze(-2)).view(N, B, Hk, G * C, C) @ k.squeeze(3)).view(N, B, Hk, G, C, Dk)
    k_out = (k * decay_out.unsqueeze(-1)).transpose(-1, -2)  # (N, B, Hk, G, Dk, C)
    # the carried recurrence, on (B * Hv) batches of matrices: V_new = U + (-W) S; S <- exp(G_C) S + K_out^T V_new
    # (unbind, not u[c]: the backward of N selects would write N full-size gradients)
    state = (q.new_zeros(B, Hv, Dk, Dv) if initial_state is None else initial_state.to(f32)).reshape(B * Hv, Dk, Dv)
    states, v_new = [], []
    for u_c, w_c, k_c, d_c in zip(u.flatten(1, 3).unbind(0), w.flatten(1, 3).unbind(0), k_out.flatten(1, 3).unbind(0),
                                  decay_chunk.reshape(N, B * Hv, 1, 1).unbind(0)):
        states.append(state)
        v_new.append(torch.baddbmm(u_c, w_c, state))
        state = torch.baddbmm(state * d_c, k_c, v_new[-1])
    s_in = torch.stack(states).view(N, B, Hk, G, Dk, Dv)
    v_new = torch.stack(v_new).view(N, B, Hk, G, C, Dv)
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk (Q K^T) * D
    o = torch.baddbmm((attn @ v_new).view(-1, C, Dv), (q * decay_in.unsqueeze(-1)).view(-1, C, Dk),
                      s_in.view(-1, Dk, Dv))  # (N * B * Hv, C, Dv)
    o = o.view(N, B, Hk, G, C, Dv).permute(1, 0, 4, 2, 3, 5).reshape(B, N * C, Hv, Dv)[:, :L]
    return o.to(out_dtype), state.view(B, Hv, Dk, Dv)


def _fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                          resets: Tensor | None) -> tuple[Tensor, Tensor]:
    """flash-linear-attention's chunked kernel (CUDA, Triton), in its own precision (it takes q, k, v in the
    caller's dtype -- bfloat16 -- and keeps its own accumulators). Its q/k heads must equal the value heads:
    they are repeated. Documents (`resets`) go in as fla's varlen `cu_seqlens` over the batch flattened into
    one row: every row and every document starts a sequence; a row's first sequence starts from the row's
    `initial_state` (unless a reset at its first token discards it), every other one from zeros, and a row's
    final state is that of the sequence holding its last token."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, L, Hk, Dk, Hv, Dv = _check_shapes(q, k, v, g, beta, initial_state, resets)
    out_dtype = q.dtype
    if Hv != Hk:
        q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    if resets is None:
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, initial_state=initial_state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=False)
        return o.to(out_dtype), state.to(torch.float32)
    starts = resets.clone()
    starts[:, 0] = True
    flat = starts.reshape(-1)
    cu_seqlens = torch.cat([flat.nonzero().flatten(), flat.new_tensor([B * L], dtype=torch.long)])
    sequence_of = flat.to(torch.long).cumsum(0) - 1  # each token's sequence
    rows = torch.arange(B, device=q.device) * L
    first, last = sequence_of[rows], sequence_of[rows + L - 1]
    init = v.new_zeros(cu_seqlens.numel() - 1, Hv, Dk, Dv, dtype=torch.float32)
    if initial_state is not None:  # a reset at a row's first token discards its initial state
        init = init.index_copy(0, first, initial_state.float() * (~resets[:, 0]).float().view(B, 1, 1, 1))
    o, state = chunk_gated_delta_rule(*(x.reshape(1, B * L, *x.shape[2:]) for x in (q, k, v, g, beta)), scale=1.0,
                                      initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=False,
                                      cu_seqlens=cu_seqlens)
    return o.view(B, L, Hv, Dv).to(out_dtype), state[last].to(torch.float32)


def check_kernel(kernel: str) -> None:
    """ConfigError (naming `model.linear_attn_kernel`) when `kernel` is "fla" and flash-linear-attention is not
    installed; ValueError for an unknown kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"gated delta rule: unknown kernel {kernel!r}; one of {', '.join(KERNELS)}")
    if kernel == "fla" and not fla_available():
        raise ConfigError("[model.linear_attn_kernel] \"fla\" needs flash-linear-attention: pip install "
                          "'torchtrain[fla]' (CUDA only); use \"chunked\"")


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None,
                     resets: Tensor | None = None, kernel: str = "chunked",
                     chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The gated delta rule (module docstring) by `kernel`, one of KERNELS: "chunked" (this module's chunked
    form, any device), "recurrent" (the token-by-token reference) or "fla" (flash-linear-attention's Triton
    kernel: CUDA, an optional extra). Returns (o (B, L, Hv, Dv) in q's dtype, the final state float32)."""
    check_kernel(kernel)
    if kernel == "chunked":
        return chunked_gated_delta_rule(q, k, v, g, beta, initial_state, resets, chunk_size=chunk_size)
    if kernel == "recurrent":
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, resets)
    return _fla_gated_delta_rule(q, k, v, g, beta, initial_state, resets)
