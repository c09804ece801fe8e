"""Pipeline arithmetic: which layers each stage owns, micro-batches in flight, bubble fraction.

Split. The n_layers blocks are cut into S = pp x v contiguous stages (v = virtual stages per rank for
interleaved schedules) as evenly as possible: the first n_layers mod S stages get one block more.
Stage k runs on pipeline rank k mod pp (the "looped" placement of interleaved schedules); the token
embedding lives on stage 0 and the final norm + output projection on stage S - 1.

In-flight micro-batches (activations stored at a rank's peak), for m micro-batches and rank r:

* GPipe: all m forwards run before any backward, so every rank holds m.
* 1F1B: rank r runs pp - r warm-up forwards before its first backward: min(m, pp - r).
* Interleaved 1F1B (Megatron-LM): rank r runs 2 (pp - r - 1) + (v - 1) pp warm-up chunk forwards, so
  it holds min(m v, 2 (pp - r - 1) + (v - 1) pp + 1) chunks of layers/(pp v) blocks each.

Bubble fraction (idle share of the step's wall time) with equal stage times:

* GPipe and 1F1B: (pp - 1) / (m + pp - 1)
* Interleaved 1F1B: (pp - 1) / (v m + pp - 1)  (each bubble slot is a chunk, 1/v of a stage)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    index: int
    """Stage index in 0..pp x v - 1 (forward order)."""
    layers: tuple[int, ...]
    """Global indices of the blocks this stage owns."""
    first: bool
    last: bool


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, ...]]:
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for k in range(n_stages):
        size = base + (1 if k < extra else 0)
        out.append(tuple(range(start, start + size)))
        start += size
    return out


def rank_stages(n_layers: int, pp: int, v: int, rank: int) -> list[Stage]:
    """The stages pipeline rank `rank` runs (one, or v for interleaved schedules)."""
    n = pp * v
    split = split_layers(n_layers, n)
    return [Stage(k, split[k], k == 0, k == n - 1) for k in range(rank, n, pp)]


def in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> int:
    """Micro-batches (interleaved: layer chunks) whose activations a rank holds at its peak."""
    if pp == 1:
        return 1
    if schedule == "GPipe":
        return m * v
    if schedule.startswith("Interleaved"):
        return min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
    return min(m, pp - rank)


def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1) -> float:
    if pp == 1:
        return 0.0
    if schedule.startswith("Interleaved"):
        return (pp - 1) / (v * m + pp - 1)
    return (pp - 1) / (m + pp - 1)


def structure(n_layers: int, pp: int, v: int, rank: int) -> tuple:
    """What a rank's model part looks like: ranks with equal structure hold the same modules and
    differ only in how many micro-batches they keep in flight (one trace serves them all)."""
    return tuple((len(s.layers), s.first, s.last) for s in rank_stages(n_layers, pp, v, rank))
