"""Which window is global sample g: seeded permutations and deterministic mixtures, in O(1) per sample.

Everything here is arithmetic on the global sample index g, so any rank finds its own samples without
reading, or even enumerating, anybody else's, and a loader's whole state is g (docs/data.md):

* **Windows.** A source of T tokens holds W = floor(T / (seq_len + 1)) windows; window w is tokens
  [w (seq_len+1), (w+1)(seq_len+1)) of its stream.
* **Epoch order.** Source sample j is window  perm_e(j mod W)  of epoch  e = j div W, where perm_e is
  a seeded pseudo-random bijection of [0, W) (`Permutation`: a 4-round Feistel network on the next
  even power of two >= W, with cycle walking back into [0, W)). It costs O(1) memory and time,
  whatever W is, and a new seed per epoch reshuffles every epoch.
* **Mixtures.** Source weights w_s are rounded to integer quotas q_s with sum P (largest remainders,
  P = 10,000). One period of P samples is laid out by largest deficit: sample t of the period goes
  to the source with the largest  (t + 1) q_s / P - c_s(t)  (c_s(t): its samples so far; ties to the
  first source), so every prefix of the period, and hence any run of consecutive samples, holds each
  source within about one sample of its share. Global sample g = c P + t is then the
  (c q_s + rank of t among the source's samples in the period)-th sample of source s.
* **Ranks.** Data-parallel rank r of dp takes the global samples g = r, r + dp, r + 2 dp, ...
"""

from __future__ import annotations

import abc

import numpy as np
import torch
from torch.utils.data import Dataset

_MASK64 = (1 << 64) - 1
MIXTURE_PERIOD = 10_000


def _mix64(x: int) -> int:
    """A 64-bit integer hash with full avalanche (the SplitMix64 finaliser)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Permutation:
    """A seeded bijection of range(n), evaluated one index at a time in O(1) memory."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"cannot permute {n} elements")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_mix64(_mix64(seed) + r + 1) for r in range(self.ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} outside [0, {self.n})")
        x = self._feistel(i)
        while x >= self.n:  # cycle walking: the domain is < 4n, so ~1-4 rounds on average
            x = self._feistel(x)
        return x


def quotas(weights: list[float], period: int = MIXTURE_PERIOD) -> list[int]:
    """Integer shares of `period` proportional to `weights` (largest remainders), each >= 1."""
    total = float(sum(weights))
    exact = [w / total * period for w in weights]
    q = [int(e) for e in exact]
    for i in sorted(range(len(q)), key=lambda i: (q[i] - exact[i], i))[: period - sum(q)]:
        q[i] += 1
    return q


class Mixture:
    """Global sample index -> (source, the source's own sample index), deterministic (module docstring)."""

    def __init__(self, weights: list[float]):
        if len(weights) == 1:
            self.q, self.period = [1], 1
        else:
            self.period = MIXTURE_PERIOD
            self.q = quotas(weights, self.period)
        k = len(self.q)
        source = np.empty(self.period, dtype=np.int32)
        rank = np.empty(self.period, dtype=np.int64)
        count = [0] * k
        for t in range(self.period):
            deficits = [(t + 1) * self.q[s] - count[s] * self.period for s in range(k)]
            s = max(range(k), key=lambda i: (deficits[i], -i))
            source[t], rank[t] = s, count[s]
            count[s] += 1
        self.source, self.rank = source, rank

    def locate(self, g: int) -> tuple[int, int]:
        cycle, t = divmod(g, self.period)
        s = int(self.source[t])
        return s, cycle * self.q[s] + int(self.rank[t])

    def counts_before(self, g: int) -> list[int]:
        """How many of the global samples [0, g) each source supplied."""
        cycle, t = divmod(g, self.period)
        partial = np.bincount(self.source[:t], minlength=len(self.q))
        return [cycle * q + int(p) for q, p in zip(self.q, partial)]


class SampleDataset(Dataset, abc.ABC):
    """A map-style dataset over global sample indices whose `sample(g)` gives the (input_ids, labels,
    positions) int64 arrays of one seq_len row; items and the DataLoader's batched fetch are built here."""

    @abc.abstractmethod
    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (input_ids, labels, positions) of global sample g (each subclass's own layout)."""

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        x, y, p = self.sample(g)
        return {"input_ids": torch.from_numpy(x), "labels": torch.from_numpy(y), "positions": torch.from_numpy(p)}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """A whole batch at once (the DataLoader's batched fetch): stacked (len(indices), seq_len)."""
        parts = [self.sample(g) for g in indices]
        return {name: torch.from_numpy(np.stack([p[i] for p in parts]))
                for i, name in enumerate(("input_ids", "labels", "positions"))}
