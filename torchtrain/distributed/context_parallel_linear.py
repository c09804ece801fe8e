"""Context parallelism for linear attention (Gated DeltaNet): each CP rank runs its share of the sequence
and receives, exactly, the recurrent state and the convolution context of the tokens before it.

The sequence is cut into segments in sequence order -- the CP chunks, a rank holding one (contiguous split)
or two (the load-balanced head and tail, `context_parallel.py`). For one segment, starting from the state
S0 (d_k x d_v per value head), the gated delta rule is affine in S0 (`delta_rule.py`: every update is
S <- A_t S + B_t with A_t = e^(g_t) (I - beta_t k_t k_t^T)):

    S_end = M S0 + N,        o_t = o0_t + R_t^T S0   (R_t: d_k per token, M: d_k x d_k, N: d_k x d_v)

All four come from one run of the kernel from the augmented state [I | 0] with values [0 | v] (value width
d_k + d_v): its outputs are [R_t | o0_t], its final state [M | N]. So the exchange is

1. every rank runs its segments from [I | 0] (no waiting on the ranks before it);
2. one all-gather of every segment's (M, N) over the CP group -- one collective whatever the CP degree,
   instead of a chain of sends that would make rank r wait for r - 1 (its size grows with cp, the
   latency does not);
3. each rank scans the gathered transforms in sequence order, S_in(j + 1) = M_j S_in(j) + N_j from zeros,
   for its own segments' incoming states (2 cp small (d_k x d_k)(d_k x d_v) products, redundant on every
   rank and negligible), and adds R_t^T S_in to its outputs.

Autograd carries the gradients back through the scan and the all-gather (whose backward reduce-scatters:
each segment's M and N receive the gradients of every later segment). A document start inside a segment
resets the state there, so M and the later R_t are zero: the exchange stays exact with packed documents.

**The convolutions** (K taps) read the K - 1 tokens before each token: a segment's first tokens take them
from the end of the segment before it, all-gathered the same way (K - 1 rows of every channel per segment;
the tap masks of document boundaries are the token's own positions). Each segment must hold at least K - 1
tokens (the model's layout check names `training.seq_len`).

**Cost** per linear layer and rank: the kernel on value width d_k + d_v instead of d_v (about twice the
delta rule's work: the price of not waiting), one all-gather of 2 cp segment transforms of
B H_v d_k (d_k + d_v) floats (fp32) and one of 2 cp x (K - 1) rows of the convolution channels, forward;
the same reduce-scattered in backward.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from torchtrain.models.common import delta_rule
from torchtrain.models.common.attention import AttentionContext
from torchtrain.models.common.linear_attention import LinearAttentionCore, causal_conv, document_starts

_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def segments_of(cp: int, rank: int, balanced: bool) -> list[int]:
    """The sequence-order indices of the segments CP rank `rank` holds, in its local order."""
    return [rank, 2 * cp - 1 - rank] if balanced else [rank]


def _gather(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """All ranks' `t` (segments on dim 0) stacked on dim 0, rank-major, differentiable."""
    return _all_gather_autograd(t.contiguous(), gather_dim=0, group=mesh)


def _tied(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """`out`, made to depend on `gathered` with a zero weight: the rank holding the sequence's first segment
    reads nothing gathered, yet the gather's backward (a reduce-scatter every rank must join) has to run on
    it too."""
    return out + gathered.flatten()[:1].sum().to(out.dtype) * 0


class ContextParallelLinearAttention(LinearAttentionCore):
    """`LinearAttentionCore` over a sequence sharded on a CP group (module doc)."""

    def __init__(self, core: LinearAttentionCore, cp_mesh: DeviceMesh, balanced: bool = True):
        super().__init__(core.kernel, core.chunk_size)
        self.cp_mesh, self.cp, self.rank, self.balanced = cp_mesh, cp_mesh.size(), cp_mesh.get_local_rank(), balanced
        self.per_rank = 2 if balanced else 1

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cp={self.cp}"

    def _gathered(self) -> dict[int, int]:
        """Sequence-order index of a segment -> its place among the gathered ones (rank-major, `per_rank` a rank)."""
        order = [s for r in range(self.cp) for s in segments_of(self.cp, r, self.balanced)]
        return {seq: i for i, seq in enumerate(order)}

    def _split(self, t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.chunk(self.per_rank, dim=1))

    def conv(self, x: torch.Tensor, weight: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        taps = weight.shape[1] - 1
        parts = self._split(x)
        tails = _gather(torch.stack([p[:, -taps:] for p in parts]), self.cp_mesh)  # (segments, B, K-1, C)
        by_order = self._gathered()
        positions = self._split(ctx.positions) if ctx.positions is not None else [None] * len(parts)
        out = []
        for seq, part, pos in zip(segments_of(self.cp, self.rank, self.balanced), parts, positions):
            left = tails[by_order[seq - 1]] if seq > 0 else part.new_zeros(part.shape[0], taps, part.shape[2])
            out.append(causal_conv(part, left, weight, pos))
        return _tied(torch.cat(out, dim=1), tails)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            ctx: AttentionContext) -> torch.Tensor:
        batch, heads, dk = q.shape[0], v.shape[2], q.shape[-1]
        resets = document_starts(ctx)
        identity = torch.eye(dk, device=q.device, dtype=torch.float32).expand(batch, heads, dk, dk)
        start = torch.cat([identity, identity.new_zeros(batch, heads, dk, v.shape[-1])], dim=-1)
        outs, transforms = [], []
        starts = self._split(resets) if resets is not None else [None] * self.per_rank
        for qs, ks, vs, gs, bs, rs in zip(*(self._split(t) for t in (q, k, v, g, beta)), starts):
            values = torch.cat([vs.new_zeros(*vs.shape[:-1], dk), vs], dim=-1)
            out, final = delta_rule.gated_delta_rule(qs, ks, values, gs, bs, initial_state=start, resets=rs,
                                                     kernel=self.kernel, chunk_size=self.chunk_size)
            outs.append(out)
            transforms.append(final)
        gathered = _gather(torch.stack(transforms), self.cp_mesh)  # (segments, B, H, dk, dk + dv): [M | N]
        by_order = self._gathered()
        state = gathered.new_zeros(batch, heads, dk, v.shape[-1])
        incoming = {}
        for seq in range(len(by_order)):
            incoming[seq] = state
            m, n = gathered[by_order[seq]].split([dk, v.shape[-1]], dim=-1)
            state = m @ state + n
        result = []
        for seq, out in zip(segments_of(self.cp, self.rank, self.balanced), outs):
            reads, own = out.float().split([dk, v.shape[-1]], dim=-1)  # R_t (B, L, H, dk), o0 (B, L, H, dv)
            result.append(own + torch.einsum("blhk,bhkv->blhv", reads, incoming[seq]))
        return _tied(torch.cat(result, dim=1), gathered).to(q.dtype)
