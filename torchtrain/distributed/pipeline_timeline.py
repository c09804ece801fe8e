"""A pipeline schedule's timeline and bubble, computed from the schedule's own action lists.

`torch.distributed.pipelining` schedules describe, per rank, the ordered compute actions they run:
F (forward of one micro-batch on one stage), B (full backward), I / W (backward split into the input
gradient and the weight gradient, for zero-bubble schedules). This module replays those lists with
their data dependencies

    F(s, m) after F(s-1, m);   B or I (s, m) after F(s, m) and B/I(s+1, m);   W(s, m) after I(s, m)

with unit costs F = I = W = 1 and B = 2 (a backward is about twice a forward) and no communication
time, giving each rank's busy intervals. The bubble fraction is the idle share of
ranks x makespan. For GPipe and 1F1B with p ranks and m micro-batches this gives exactly the
textbook (p - 1) / (m + p - 1); interleaved and zero-bubble schedules come out lower.
"""

from __future__ import annotations

from dataclasses import dataclass

COST = {"F": 1, "B": 2, "I": 1, "W": 1}


@dataclass(frozen=True)
class Slot:
    start: int
    end: int
    label: str


@dataclass
class Timeline:
    slots: dict[int, list[Slot]]
    makespan: int
    bubble_fraction: float

    def render(self, max_units: int = 160) -> str:
        width = max((len(s.label) for row in self.slots.values() for s in row), default=2) + 1
        lines = []
        for rank, row in sorted(self.slots.items()):
            cells = ["." * (width - 1)] * self.makespan
            for s in row:
                for t in range(s.start, s.end):
                    cells[t] = s.label if t == s.start else "~" * (width - 1)
            shown = cells[:max_units]
            tail = " ..." if self.makespan > max_units else ""
            lines.append(f"rank {rank:>2} | " + " ".join(c.ljust(width - 1) for c in shown) + tail)
        return "\n".join(lines)


def _compute_actions(action) -> list:
    """Flatten an action (OVERLAP_F_B holds sub-actions) to its compute parts; drop non-compute ones."""
    if action is None:
        return []
    kind = action.computation_type.value
    if action.sub_actions:
        return [a for sub in action.sub_actions for a in _compute_actions(sub)]
    return [action] if kind in COST else []


def simulate(order: dict[int, list], num_stages: int, multi_stage: bool) -> Timeline:
    """Replay per-rank action lists with dependencies; raise ValueError if the schedule deadlocks."""
    queues = {rank: [a for act in acts for a in _compute_actions(act)] for rank, acts in order.items()}
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> finish time
    free = {rank: 0 for rank in queues}
    pos = {rank: 0 for rank in queues}
    slots: dict[int, list[Slot]] = {rank: [] for rank in queues}

    def ready_at(a) -> int | None:
        kind, s, m = a.computation_type.value, a.stage_index, a.microbatch_index
        deps: list[tuple[str, int, int]] = []
        if kind == "F" and s > 0:
            deps.append(("F", s - 1, m))
        if kind in ("B", "I"):
            deps.append(("F", s, m))
            if s < num_stages - 1:
                deps.append(("B", s + 1, m) if ("B", s + 1, m) in done else ("I", s + 1, m))
        if kind == "W":
            deps.append(("I", s, m))
        if any(d not in done for d in deps):
            return None
        return max((done[d] for d in deps), default=0)

    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progressed = False
        for rank, queue in queues.items():
            while pos[rank] < len(queue):
                a = queue[pos[rank]]
                t = ready_at(a)
                if t is None:
                    break
                kind = a.computation_type.value
                start = max(t, free[rank])
                end = start + COST[kind]
                done[(kind, a.stage_index, a.microbatch_index)] = end
                label = f"{a.stage_index}{kind}{a.microbatch_index}" if multi_stage else f"{kind}{a.microbatch_index}"
                slots[rank].append(Slot(start, end, label))
                free[rank] = end
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(q[pos[r]]) for r, q in queues.items() if pos[r] < len(q)}
            raise ValueError(f"pipeline schedule cannot progress; next actions per rank: {stuck}")
    makespan = max(free.values())
    busy = sum(s.end - s.start for row in slots.values() for s in row)
    bubble = 1.0 - busy / (len(slots) * makespan) if makespan else 0.0
    return Timeline(slots, makespan, bubble)


def peak_in_flight(order: dict[int, list]) -> dict[int, int]:
    """Per rank, the most (stage, micro-batch) forwards whose activations are held at once, in the
    order the rank runs its actions: a forward stores them, the backward (B, or I for split
    backwards) frees them. GPipe holds all m micro-batches on every rank, 1F1B at most p - r on
    rank r."""
    out = {}
    for rank, actions in order.items():
        live = peak = 0
        for a in (x for act in actions for x in _compute_actions(act)):
            kind = a.computation_type.value
            live += 1 if kind == "F" else -1 if kind in ("B", "I") else 0
            peak = max(peak, live)
        out[rank] = peak
    return out
