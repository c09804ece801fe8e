"""The token dispatcher of an MoE layer: how each token's routed copies reach their experts and how the
experts' results come back as the token's gate-weighted sum.

The interface: `dispatcher(compute, tokens, idx, weights) -> (T, D)`, for the T tokens (T, D) of one
forward, their top-k expert ids `idx` (T, k) and gate weights `weights` (T, k, float32). `compute(x,
counts)` runs this rank's experts over rows `x` sorted by expert (`counts` rows per local expert) --
the routed experts' forward (`experts.py`). The result is, for every token t,

    out_t = sum_j weights[t, j] * expert_{idx[t, j]}(tokens[t])      (summed in top-k order here)

A dispatcher is written as a *route*: a generator over one slice of the tokens that issues its
communication asynchronously and yields while it is in flight, returning the slice's result. The
base class runs one route over all tokens, or -- with `chunks` > 1 -- one route per chunk of the
tokens, round-robin: while one chunk's all-to-all is in flight the others compute (the overlap of
`parallelism.expert_parallel_overlap_chunks`). Every route yields at the same points on every rank,
so the ranks issue their collectives in the same order.

`LocalDispatcher` (one process, or no expert parallelism) sorts the (token, expert) pairs by expert
with a stable sort, computes, unsorts and sums. The expert-parallel dispatchers are in
`distributed/token_dispatch.py`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Generator

import torch

Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Route = Generator[None, None, torch.Tensor]


def histogram(keys: torch.Tensor, bins: int, ordered: torch.Tensor | None = None) -> torch.Tensor:
    """How many of `keys` (integers in [0, bins)) fall in each bin, by sorting (`ordered`: keys already
    sorted): deterministic on every device and static in shape (it also runs on the planner's fake
    tensors, unlike bincount)."""
    if ordered is None:
        ordered = torch.sort(keys.reshape(-1)).values
    edges = torch.searchsorted(ordered, torch.arange(bins + 1, device=keys.device, dtype=keys.dtype))
    return edges.diff()


def sort_pairs(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the (token, slot) pairs of `idx` (T, k) in expert order (stable) and the
    pairs per expert."""
    pairs = idx.reshape(-1)
    order = torch.argsort(pairs, stable=True)
    return order, histogram(pairs, num_experts, ordered=pairs[order])


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of permutation `perm`."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def weighted_sum(routed: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(T, D): each token's k results (T k, D), in top-k order, summed with its gate weights (T, k)."""
    routed = routed.view(weights.shape[0], weights.shape[1], -1)
    return (routed * weights.unsqueeze(-1).to(routed.dtype)).sum(1)


def run_round_robin(routes: list[Route]) -> list[torch.Tensor]:
    """Advance every route to its next yield in turn until all have returned; their results in order."""
    results: list[torch.Tensor | None] = [None] * len(routes)
    active = list(range(len(routes)))
    while active:
        still = []
        for i in active:
            try:
                next(routes[i])
                still.append(i)
            except StopIteration as done:
                results[i] = done.value
        active = still
    return results  # type: ignore[return-value]


class TokenDispatcher(abc.ABC):
    """Base of the dispatchers: splits the tokens into `chunks` and runs their routes round-robin."""

    chunks: int = 1

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    @abc.abstractmethod
    def route(self, compute: Compute, tokens: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> Route:
        """One chunk's journey: a generator that yields while its communication is in flight and returns
        the chunk's combined output."""

    def __call__(self, compute: Compute, tokens: torch.Tensor, idx: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        n = max(1, min(self.chunks, tokens.shape[0]))
        if n == 1:
            return run_round_robin([self.route(compute, tokens, idx, weights)])[0]
        parts = zip(tokens.tensor_split(n), idx.tensor_split(n), weights.tensor_split(n))
        return torch.cat(run_round_robin([self.route(compute, t, i, w) for t, i, w in parts]))


class LocalDispatcher(TokenDispatcher):
    """All experts on this rank: sort the pairs by expert, compute, unsort, sum."""

    def route(self, compute: Compute, tokens: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> Route:
        order, counts = sort_pairs(idx, self.num_experts)
        routed = compute(tokens[order // idx.shape[1]], counts)
        return weighted_sum(routed[inverse(order)], weights)
        yield  # a generator without communication
